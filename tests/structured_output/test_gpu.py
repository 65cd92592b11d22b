"""Structured outputs on a GPU (skipped elsewhere): the engine's CUDA defaults (async scheduling,
CUDA graphs for decode, the Triton mask kernel) give schema-valid outputs, and the unconstrained
requests of the batch their tokens alone."""
from __future__ import annotations

import pytest
import torch

from moe import SamplingParams
from tests.structured_output.helpers import check_schema, completions, json_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["Hello", "The quick brown fox", "Numbers: 0 1 2", "Mixture-of-experts models route"] * 8


def test_mixed_batch_on_cuda_defaults():
    from moe import LLM

    llm = LLM("tiny-qwen3-moe", device="cuda", max_model_len=256)
    assert llm.llm_engine.core.async_scheduling, "async scheduling is CUDA's default"
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = completions(llm, PROMPTS, plain)
    mixed = completions(llm, PROMPTS * 2, [plain] * len(PROMPTS) + [json_params(temperature=0.8, seed=i)
                                                                     for i in range(len(PROMPTS))])
    assert [o[0].token_ids for o in mixed[:len(PROMPTS)]] == [o[0].token_ids for o in alone]
    for (out,) in mixed[len(PROMPTS):]:
        assert out.finish_reason == "stop"
        check_schema(out.text)
    llm.shutdown()
