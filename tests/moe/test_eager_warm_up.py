"""The warm-up of eagerly run mixed steps (ModelRunner.warm_up_eager_steps): its step layout, that
it leaves no trace (requests, expert load, later outputs), and on a GPU that the first real
mixed steps of a model whose larger mixed steps run eagerly (MLA) compile no Triton kernel."""
from __future__ import annotations

import numpy as np
import pytest

from moe import LLM, SamplingParams
from moe.worker.step_inputs import StepBatch


def test_warm_up_batch_layout():
    b = StepBatch.warm_up(num_tokens=40, num_decode_rows=7, max_chunk=15, block_size=4, num_groups=2)
    assert len(b.input_ids_T) == 40 and not b.decode_only
    assert b.num_tokens_B.tolist() == [1] * 7 + [15, 15, 3]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 22, 37, 40]
    assert b.seq_lens_B.tolist() == [16] * 7 + [15, 15, 3]
    # decode rows one past the first chunk; every chunk from position 0
    assert b.positions_T[:7].tolist() == [15] * 7
    assert b.positions_T[7:22].tolist() == list(range(15)) and b.positions_T[37:].tolist() == [0, 1, 2]
    # every position a sequence writes lies inside its table (blocks 0..3 of 4 slots)
    assert len(b.tables) == 2 and b.tables[0].shape == (10, 4)
    slots = b.slots(0, 4)
    assert slots.min() == 0 and slots.max() == 15
    assert b.sample_rows == [] and b.states == []


@pytest.mark.parametrize("tokens, decode_rows", [(7, 7), (5, -1)])
def test_warm_up_batch_needs_a_chunk(tokens, decode_rows):
    with pytest.raises(ValueError, match="needs a chunk"):
        StepBatch.warm_up(tokens, decode_rows, 8, 4, 1)


def test_warm_up_runs_every_size_and_leaves_no_trace():
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM("tiny-qwen3-moe", device="cpu", max_num_batched_tokens=200, max_model_len=96) as fresh:
        want = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    with LLM("tiny-qwen3-moe", device="cpu", max_num_batched_tokens=200, max_model_len=96) as llm:
        runner = llm.llm_engine.executor.runner
        ran, real = [], runner._run_batch

        def record(batch, **kwargs):
            ran.append((len(batch.input_ids_T), int(batch.num_tokens_B.max()), kwargs.get("counted", True)))
            return real(batch, **kwargs)
        runner._run_batch = record
        before = llm.get_expert_load().counts.sum()
        runner.warm_up_eager_steps()
        # chunks of 16 and 32, 64, then three short of 128 and of the budget (200), and the
        # budget: chunks of at most max_model_len - 1 tokens
        assert ran == [(23, 16, False), (39, 32, False), (64, 57, False), (125, 95, False), (197, 95, False),
                       (200, 95, False)]
        runner._run_batch = real
        assert llm.get_expert_load().counts.sum() == before
        assert runner.requests == {}
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_gpu_first_mixed_steps_compile_nothing_after_the_warm_up(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA) runs mixed steps of more than its largest mixed graph (64 tokens here) or
    of much prefill attention eagerly; with the warm-up at start-up, mixed steps of sizes the
    warm-up did not run (odd token counts, several chunks, decode rows of longer contexts) compile
    no new Triton kernel, nor do those that replay the mixed graphs."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import triton

    import models.layers.mla_attention as mla
    from tests.factories_deepseek import make_deepseek_v3_checkpoint
    monkeypatch.setattr(mla, "ABSORBED_MAX_TOKENS", 64)
    path = make_deepseek_v3_checkpoint(str(tmp_path / "ds"))
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(1, 500, int(n)).tolist()} for n in rng.integers(20, 300, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=512,
             max_model_len=512, gpu_memory_utilization=0.3) as llm:
        runner = llm.llm_engine.executor.runner
        assert runner.use_cuda_graphs and runner.mixed_graphs.sizes == [64]  # MLA: larger mixed steps eager
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # sampling kernels
        compiled = []
        triton.knobs.runtime.jit_cache_hook = lambda *a, **k: compiled.append(k.get("repr", a)) and False
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            triton.knobs.runtime.jit_cache_hook = None
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert compiled == [], f"{len(compiled)} Triton kernels compiled after the warm-up: {compiled}"
