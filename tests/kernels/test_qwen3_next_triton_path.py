"""A whole Qwen3-Next model on the CUDA path (the runner's step buffers, Triton attention and the Gated
DeltaNet Triton kernels, recurrent and chunked; here under the interpreter on the CPU) gives the torch
reference path's greedy tokens and logprobs, across prefill chunks, decode steps and reused state
slots. The step buffers hand the slots over as a strided block-table column."""
from __future__ import annotations

import pytest
import torch

from tests.factories import generate_greedy
from tests.factories_qwen3_next import make_qwen3_next_checkpoint
from tests.kernels.triton_marks import CUDA, INTERPRET

pytest.importorskip("triton")


@pytest.mark.skipif(not INTERPRET or CUDA, reason="forces the Triton kernels on the CPU through the interpreter")
def test_linear_attention_through_the_triton_kernels_matches_the_reference(tmp_path, monkeypatch):
    import models.layers.attention as attention
    import models.qwen3_next as qwen3_next
    import moe.worker.model_runner as model_runner

    path = make_qwen3_next_checkpoint(str(tmp_path / "ckpt"), seed=7)
    layout = dict(block_size=4, max_num_batched_tokens=6, max_num_seqs=2)  # chunks, decodes beside them, slot reuse
    _, _, reference = generate_greedy(path, [3, 9, 14], 4, **layout)
    calls = []

    def counted(fn):
        def run(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return run

    for module in (qwen3_next, attention, model_runner):
        monkeypatch.setattr(module, "use_triton_attention", lambda x: True)
    for name in ("causal_conv1d_varlen_triton", "gated_delta_rule_recurrent_triton"):
        monkeypatch.setattr(qwen3_next, name, counted(getattr(qwen3_next, name)))
    # steps with prefill tokens go through the chunked kernel; its chunk path from 2 tokens (the
    # prefill chunks here are at most 6 tokens, under the default's token-by-token limit)
    chunked = qwen3_next.gated_delta_rule_chunked_triton

    def gated_delta_rule_chunked_triton(*args, **kwargs):
        return chunked(*args, **kwargs, chunk_size=16, recurrent_below=2)
    monkeypatch.setattr(qwen3_next, "gated_delta_rule_chunked_triton", counted(gated_delta_rule_chunked_triton))
    _, _, triton_outs = generate_greedy(path, [3, 9, 14], 4, **layout)
    assert {"causal_conv1d_varlen_triton", "gated_delta_rule_recurrent_triton",
            "gated_delta_rule_chunked_triton"} <= set(calls)
    for ref, got in zip(reference, triton_outs):
        a, b = ref.outputs[0], got.outputs[0]
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]),
                                   torch.tensor([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]),
                                   atol=1e-4, rtol=0)
