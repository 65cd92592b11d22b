"""The engine: input processing (prompts to token ids, chat templates, images), the engine core
(scheduler + executor, data-parallel coordination, step recovery, EPLB driver) and output
processing (detokenising, stop strings, metrics).

Offline, `LLMEngine` (llm_engine.py) runs all three in the caller's process. Under `moe serve`
the engine core runs in processes of its own (core_process.py), reached through core_client.py
with the messages of serialization.py; input and output processing run in the API processes."""
