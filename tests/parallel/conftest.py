"""Fixtures for the multi-process tests: one tiny checkpoint for the module, its single-process
fp32 reference outputs, and short collective / step timeouts so a bug fails instead of hanging."""
from __future__ import annotations

import os
import random

import pytest

from moe import LLM, SamplingParams
from tests.factories import make_qwen3_moe_checkpoint

# Inherited by every worker a test spawns (set before any executor starts).
os.environ.setdefault("MOE_COLLECTIVE_TIMEOUT_S", "60")
os.environ.setdefault("MOE_STEP_TIMEOUT_S", "90")
os.environ.setdefault("MOE_WORKER_START_TIMEOUT_S", "120")

# 4 layers (pipeline stages of 2), layer 1 dense: each stage holds a MoE and the first a dense MLP.
CKPT_OVERRIDES = dict(num_hidden_layers=4, mlp_only_layers=[1])
PROMPT_LENGTHS = [1, 5, 17, 33]
# Different lengths of output: data-parallel replicas run out of work at different steps, so the
# idle one runs dummy batches while the other decodes.
MAX_TOKENS = [7, 2, 5, 3]


def prompts(vocab: int = 512) -> list[dict]:
    rng = random.Random(11)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in PROMPT_LENGTHS]


def sampling_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_TOKENS]


def summarize(outs) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprob of each token) per prompt."""
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return res


@pytest.fixture(scope="session")
def parallel_ckpt(tmp_path_factory) -> str:
    return make_qwen3_moe_checkpoint(str(tmp_path_factory.mktemp("qwen3_pp")), seed=5, **CKPT_OVERRIDES)


def routed_experts(outs) -> list:
    """Each prompt's returned routed experts [forwarded tokens, MoE layers, top_k]."""
    return [o.outputs[0].routed_experts for o in outs]


@pytest.fixture(scope="session")
def single_process_run(parallel_ckpt):
    """Greedy tokens and logprobs of one process (fp32), its expert load (the counts the
    single-process tests check against the router's choices) and its routed experts."""
    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", enable_return_routed_experts=True)
    raw = llm.generate(prompts(), sampling_params(), use_tqdm=False)
    return summarize(raw), llm.get_expert_load(), routed_experts(raw)


@pytest.fixture(scope="session")
def reference(single_process_run):
    return single_process_run[0]


@pytest.fixture(scope="session")
def reference_load(single_process_run):
    return single_process_run[1]


@pytest.fixture(scope="session")
def reference_routed(single_process_run):
    return single_process_run[2]


def assert_same_as_reference(got, reference) -> None:
    # lengths first: zip stops at the shorter list, and an empty output would compare equal
    assert len(reference) > 0 and len(got) == len(reference), (len(got), len(reference))
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference):
        assert tokens == ref_tokens and len(tokens) > 0
        assert len(lps) == len(ref_lps) > 0
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
