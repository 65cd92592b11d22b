"""Multimodal inputs: image loading and processing, prompt expansion into image tokens, and the
caches of processed inputs (processor, API-process <-> engine-core IPC, shared memory)."""
