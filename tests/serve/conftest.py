"""Fixtures of the server tests: the chat-capable tiny checkpoint and the offline LLM on it."""
from __future__ import annotations

import pytest

from tests.serve.helpers import ENGINE_ARGS, make_chat_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="session")
def llm(model_dir):
    from moe import LLM

    llm = LLM(model_dir, **ENGINE_ARGS)
    yield llm
    llm.shutdown()
