"""A chat request's tools and tool_choice, as vLLM's server treats them:

* `"none"` (the default without tools): no calls are read from the output; the tools still go to
  the template (`--exclude-tools-when-tool-choice-none` leaves them out).
* `"auto"` (the default with tools): the model decides; its own call format is parsed by the
  server's `--tool-call-parser` (needs `--enable-auto-tool-choice`, else a 400 as by vLLM).
* `"required"` and a named function (`{"type": "function", "function": {"name": ...}}`): the grammar
  makes the model call, with arguments valid against the function's JSON schema. Named: the
  output is the arguments object. Required: a JSON array of `{"name", "parameters"}` objects, one
  of the tools each (vLLM's schema, closed to other keys); `parallel_tool_calls: false` makes it at
  most one.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from moe.entrypoints.parsers import TOOL_PARSERS, ToolParser
from moe.entrypoints.serve.protocol import ErrorResponse
from moe.structured_output import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags for tools."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's call format: "
                             f"one of {', '.join(TOOL_PARSERS)})")


@dataclass
class ToolPlan:
    """What one request does with its tools."""
    mode: str = "none"  # "none", "auto", "required" or "named"
    template_tools: list[dict] | None = None  # what the chat template gets as `tools`
    name: str | None = None  # the named function
    parallel: bool = True
    parser: ToolParser | None = None  # "auto": the model's call format
    tools: list[dict] = field(default_factory=list)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call ("required", named); None for "none" and "auto"."""
        if self.mode == "named":
            function = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputsParams(json=function.get("parameters") or _EMPTY_OBJECT)
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """A non-empty array of {"name": one tool's name, "parameters": its arguments}; each tool's
    "$defs" move to the top, where its "$ref"s point (#/$defs/...)."""
    defs: dict = {}
    items = []
    for tool in tools:
        function = tool["function"]
        parameters = copy.deepcopy(function.get("parameters") or _EMPTY_OBJECT)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise ErrorResponse(f"Tool definition {name!r} has multiple schemas, which is not supported.",
                                    param="tools")
            defs[name] = schema
        # closed to other keys (vLLM's leaves them open): a call is its name and its parameters
        items.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def plan_tools(body, settings: ToolSettings) -> ToolPlan:
    """The request's ToolPlan; an ErrorResponse (400, vLLM's messages) for a bad combination."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
    if tools == []:
        raise ErrorResponse("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                            "entirely.", param="tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        shown = None if settings.exclude_tools_when_tool_choice_none else tools
        return ToolPlan("none", shown, parallel=parallel, tools=tools or [])
    if not tools:
        raise ErrorResponse("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise ErrorResponse('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice")
        return ToolPlan("auto", tools, parallel=parallel, parser=TOOL_PARSERS[settings.tool_call_parser](tools),
                        tools=tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel, tools=tools)
    name = choice.function.name
    if not any(t["function"]["name"] == name for t in tools):
        raise ErrorResponse("The tool specified in `tool_choice` does not match any of the specified `tools`",
                            param="tool_choice")
    return ToolPlan("named", tools, name=name, parallel=parallel, tools=tools)
