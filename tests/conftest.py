"""Shared fixtures: an isolated cache for the built-in model, tiny Hugging Face checkpoints."""
from __future__ import annotations

import os
import tempfile

import pytest

# The built-in tiny model is created once per test session, outside the user's cache.
os.environ.setdefault("MOE_CACHE_DIR", tempfile.mkdtemp(prefix="moe-test-cache-"))

from tests.factories import make_qwen3_moe_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (per-expert hub layout, one file, with a tokenizer)."""
    return make_qwen3_moe_checkpoint(str(tmp_path_factory.mktemp("qwen3")))
