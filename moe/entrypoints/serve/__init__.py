"""`moe serve`: the OpenAI-compatible HTTP server (api_server.py), its request bodies (protocol.py),
the completion and chat handlers (handlers.py, chat_handler.py, with chat_output.py for a reply's
reasoning, content and tool calls, tool_choice.py and constraints.py for tools and structured
outputs) and the engine as an API process sees it (async_llm.py). The reply parsers live in
moe/entrypoints/parsers/."""
