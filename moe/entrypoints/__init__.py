"""What a user calls, in the user's process: the offline `LLM` (llm.py), the `moe` command
(cli.py) and the OpenAI-compatible server's API processes (serve/)."""
