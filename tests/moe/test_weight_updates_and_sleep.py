"""RL rollouts between trainer steps: LLM.update_weights loads another checkpoint's tensors (by their
Hugging Face names) in place and then gives that checkpoint's outputs, with the prefix cache reset;
LLM.sleep frees the KV cache (level 1 keeps the weights, level 2 drops them) and wake_up restores
the engine. On a GPU the freed memory is measured."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from moe import LLM, SamplingParams
from models.loader import checkpoint_files
from tests.factories import make_qwen3_moe_checkpoint

PROMPTS = [[random.Random(n).randrange(1, 500) for _ in range(n)] for n in (5, 23, 40)]


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in checkpoint_files(path):
        out.update(load_file(f))
    return out


def _greedy(llm: LLM, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, **kw)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a = make_qwen3_moe_checkpoint(str(tmp_path_factory.mktemp("policy_a")), seed=0)
    b = make_qwen3_moe_checkpoint(str(tmp_path_factory.mktemp("policy_b")), seed=1)
    with LLM(b, dtype="float32", device="cpu") as llm:
        b_tokens = _greedy(llm)
    return a, b, b_tokens


def test_update_weights_gives_the_other_checkpoints_outputs(ckpts):
    a, b, b_tokens = ckpts
    with LLM(a, dtype="float32", device="cpu", enable_prefix_caching=True) as llm:
        a_tokens = _greedy(llm)
        assert a_tokens != b_tokens, "the two checkpoints must differ for the test to mean anything"
        assert llm.update_weights(_tensors(b).items()) > 0
        outs = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                              ignore_eos=True), use_tqdm=False)
        assert outs[0].num_cached_tokens == 0, "blocks computed with the old weights must not be reused"
        assert _greedy(llm) == b_tokens
        # a subset: one tensor back to A's changes the outputs again
        llm.update_weights([("lm_head.weight", _tensors(a)["lm_head.weight"])])
        assert _greedy(llm) != b_tokens


def test_bad_updates_are_refused_by_name(ckpts):
    a, _, _ = ckpts
    with LLM(a, dtype="float32", device="cpu") as llm:
        with pytest.raises(ValueError, match="model.layers.0.mlp.nonexistent.weight"):
            llm.update_weights([("model.layers.0.mlp.nonexistent.weight", torch.zeros(2))])
        with pytest.raises(ValueError, match=r"lm_head.weight.*has shape \[3, 4\]"):
            llm.update_weights([("lm_head.weight", torch.zeros(3, 4))])
        with pytest.raises(ValueError, match="not a torch.Tensor"):
            llm.update_weights([("lm_head.weight", [[0.0]])])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up(ckpts, level):
    a, _, _ = ckpts
    with LLM(a, dtype="float32", device="cpu") as llm:
        before = _greedy(llm)
        llm.sleep(level=level)
        assert llm.is_sleeping()
        runner = llm.llm_engine.executor.runner
        assert runner.kv_caches == [] and all(a.kv_cache is None for a in runner.model.attention_layers())
        if level == 2:
            assert all(p.numel() == 0 for p in runner.model.parameters()), "level 2 drops the weights"
        with pytest.raises(RuntimeError, match="wake_up"):
            _greedy(llm)
        with pytest.raises(RuntimeError, match="wake_up"):
            llm.update_weights(_tensors(a).items())
        with pytest.raises(RuntimeError, match="already asleep"):
            llm.sleep(level=1)
        llm.wake_up()
        assert not llm.is_sleeping()
        if level == 2:  # the weights are new allocations: load them
            llm.update_weights(_tensors(a).items())
        assert _greedy(llm) == before


def test_sleep_needs_an_idle_engine(ckpts):
    a, _, _ = ckpts
    with LLM(a, dtype="float32", device="cpu") as llm:
        llm.llm_engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="1 request"):
            llm.sleep()
        llm.llm_engine.abort_request("busy")
        with pytest.raises(ValueError, match="sleep level"):
            llm.sleep(level=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory needs a GPU")
def test_sleep_frees_and_wake_up_restores_gpu_memory(ckpts):
    """Level 1 and level 2 on the GPU, CUDA graphs on: memory freed, restored, the same tokens (level 2
    after the weights are loaded again with update_weights)."""
    a, _, _ = ckpts
    kv_bytes = 64 << 20
    with LLM(a, device="cuda", dtype="float32", kv_cache_memory_bytes=kv_bytes) as llm:
        before = _greedy(llm)
        weight_bytes = sum(p.nbytes for p in llm.llm_engine.executor.runner.model.parameters())
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        llm.sleep(level=1)
        # the KV cache and the weights are gone (the step's buffers stay, as in vLLM)
        assert awake - torch.cuda.memory_allocated() > 0.95 * (kv_bytes + weight_bytes)
        llm.wake_up()
        assert torch.cuda.memory_allocated() > 0.98 * awake
        assert _greedy(llm) == before
        llm.sleep(level=2)
        assert awake - torch.cuda.memory_allocated() > 0.95 * (kv_bytes + weight_bytes)
        llm.wake_up()
        assert llm.update_weights(_tensors(a).items()) > 0
        assert torch.cuda.memory_allocated() > 0.98 * awake
        assert _greedy(llm) == before
