"""The grammar mask on the logits: the packed bits (llguidance's format) against a plain loop, the
sampler's use of them (only the constrained rows change; greedy, random and logprobs all see the
masked distribution), and the runner's mapping of mask rows to sampling rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.token_bitmask import allowed_tokens_reference, apply_token_bitmask_reference
from moe.worker.grammar_mask import grammar_mask_inputs
from moe.worker.sampler import SamplingBatch, sample
from scheduler import CachedRequestData, SchedulerOutput


def pack(allowed_RV: np.ndarray) -> np.ndarray:
    """bool [R, V] -> int32 [R, ceil(V / 32)]: bit t % 32 of word t // 32 (a loop, the spec)."""
    R, V = allowed_RV.shape
    words = np.zeros((R, -(-V // 32)), dtype=np.uint32)
    for r in range(R):
        for t in np.nonzero(allowed_RV[r])[0]:
            words[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 512])
def test_unpacking_matches_the_bit_layout(V):
    rng = np.random.default_rng(V)
    allowed = rng.random((3, V)) < 0.3
    allowed[:, -1] = True  # bit 31 of a full last word: the sign bit of an int32
    got = allowed_tokens_reference(torch.from_numpy(pack(allowed)), V)
    assert torch.equal(got, torch.from_numpy(allowed))


def test_matches_llguidance_own_reference():
    from llguidance.numpy import apply_token_bitmask_inplace  # (its torch version compiles: slow here)

    rng = np.random.default_rng(0)
    V = 77
    mask = pack(rng.random((4, V)) < 0.5)
    logits = torch.randn(4, V)
    want = logits.numpy().copy()
    apply_token_bitmask_inplace(want, mask)
    got = logits.clone()
    apply_token_bitmask_reference(got, torch.arange(4), torch.from_numpy(mask))
    assert torch.equal(got, torch.from_numpy(want))


def test_only_the_given_rows_change():
    V = 40
    logits = torch.randn(5, V)
    allowed = np.zeros((2, V), dtype=bool)
    allowed[0, [3, 7]] = True
    allowed[1, 39] = True
    got = logits.clone()
    apply_token_bitmask_reference(got, torch.tensor([4, 1]), torch.from_numpy(pack(allowed)))
    for row in (0, 2, 3):
        assert torch.equal(got[row], logits[row])
    assert torch.isfinite(got[4]).nonzero().flatten().tolist() == [3, 7]
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [39]
    assert torch.equal(got[4, [3, 7]], logits[4, [3, 7]])


def _batch(B, greedy, **kw) -> SamplingBatch:
    return SamplingBatch(temperature_B=torch.full((B,), 0.0 if greedy else 1.0), top_k_B=None, top_p_B=None,
                         min_p_B=None, seeds=[None] * B, all_greedy=greedy, max_num_logprobs=-1, **kw)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_sampler_draws_only_allowed_tokens_of_constrained_rows(greedy):
    V = 64
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    logits[1, [5, 9, 40]] = 0.0  # equally likely among themselves
    allowed = np.zeros((1, V), dtype=bool)
    allowed[0, [5, 9, 40]] = True
    bitmask = torch.from_numpy(pack(allowed))
    seen = set()
    for _ in range(1 if greedy else 200):
        b = _batch(3, greedy, grammar_rows_R=torch.tensor([1]), grammar_bitmask_RW=bitmask)
        out = sample(logits.clone(), b)
        seen.add(int(out.sampled_B[1]))
        if greedy:
            assert int(out.sampled_B[0]) == int(logits[0].argmax()) and int(out.sampled_B[2]) == int(logits[2].argmax())
            assert int(out.sampled_B[1]) == 5  # the first of the maxima, as argmax
    assert seen <= {5, 9, 40} and (greedy or len(seen) == 3)


def test_logprobs_are_of_the_masked_distribution():
    V = 32
    logits = torch.randn(1, V)
    allowed = np.zeros((1, V), dtype=bool)
    allowed[0, [2, 3]] = True
    b = _batch(1, True, grammar_rows_R=torch.tensor([0]), grammar_bitmask_RW=torch.from_numpy(pack(allowed)))
    b.max_num_logprobs = 3
    out = sample(logits.clone(), b)
    want = logits[0, [2, 3]].log_softmax(-1)
    assert out.logprob_ids_BK[0, :2].tolist() == ([2, 3] if want[0] >= want[1] else [3, 2])
    assert float(out.logprob_vals_BK[0, 2]) == float("-inf")
    assert float(out.sampled_logprob_B[0]) == pytest.approx(float(want.max()))


def test_mask_rows_follow_the_sampling_rows():
    so = SchedulerOutput([], CachedRequestData(), {}, 0)
    so.structured_output_request_ids = ["a", "b", "c"]
    so.grammar_bitmask = np.arange(9, dtype=np.int32).reshape(3, 3)
    rows, mask = grammar_mask_inputs(so, ["x", "c", "a"], torch.device("cpu"))  # "b" samples nothing here
    assert rows.tolist() == [2, 1] and mask.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert grammar_mask_inputs(so, ["x"], torch.device("cpu")) == (None, None)
