"""Two GPUs: DP=2 + expert parallelism with the fixed-capacity dispatcher, decode steps replaying
CUDA graphs (prefills over the capacity falling back to all_to_all), gives the greedy tokens of one
GPU. Skipped without two CUDA devices."""
from __future__ import annotations

import pytest
import torch

from moe import LLM, SamplingParams
from tests.parallel.conftest import prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _tokens(llm) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 3, 9, 5)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), params, use_tqdm=False)]


def test_dp2_ep_low_latency_with_graphs_matches_one_gpu(parallel_ckpt):
    common = dict(dtype="float32", device="cuda", max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    with LLM(parallel_ckpt, **common) as one:
        want = _tokens(one)
    with LLM(parallel_ckpt, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="low_latency",
             **common) as llm:
        assert _tokens(llm) == want
        assert _tokens(llm) == want  # again, on the same captured graphs
