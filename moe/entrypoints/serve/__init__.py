"""`moe serve`: the OpenAI-compatible HTTP server (api_server.py), its request bodies (protocol.py),
the completion / chat handlers (handlers.py) and the engine as an API process sees it (async_llm.py)."""
