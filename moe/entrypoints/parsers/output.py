"""What the output parsers return: tool calls (whole, or as OpenAI-style deltas) and the text
scanning helper their streaming states share."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as a JSON object's text."""
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A piece of call `index` of a streamed message: its first piece names the function, the
    pieces' `arguments` joined are the arguments' text."""
    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    """What one piece of generated text added to a message: reasoning, content, tool-call pieces."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: a streaming state
    holds them back until the next piece says whether the marker follows."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
