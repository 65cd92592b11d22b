"""Sampler filters and penalties on crafted logits."""
from __future__ import annotations

import torch

from moe.worker.sampler import SamplingBatch, sample


def batch(B, **kw):
    args = dict(temperature_B=torch.ones(B), top_k_B=None, top_p_B=None, min_p_B=None, seeds=[None] * B,
                all_greedy=False, max_num_logprobs=-1)
    args.update(kw)
    return SamplingBatch(**args)


def draws(logits, b, n=300):
    return {int(sample(logits, b).sampled_B[0]) for _ in range(n)}


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert draws(logits, batch(1)) == {0, 1, 2, 3}
    assert draws(logits, batch(1, top_k_B=torch.tensor([2]))) == {0, 1}
    # top_p=0.65: tokens 0 (0.4) and 1 (0.3) are needed to reach 0.65; token 2 is not.
    assert draws(logits, batch(1, top_p_B=torch.tensor([0.65]))) == {0, 1}
    assert draws(logits, batch(1, top_p_B=torch.tensor([0.7]))) == {0, 1}  # 0.4 + 0.3 reaches 0.7
    assert draws(logits, batch(1, top_p_B=torch.tensor([1.0]))) == {0, 1, 2, 3}
    # min_p=0.6: keep tokens with p >= 0.6 * 0.4 = 0.24.
    assert draws(logits, batch(1, min_p_B=torch.tensor([0.6]))) == {0, 1}


def test_greedy_rows_mixed_with_random_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    b = batch(2, temperature_B=torch.tensor([0.0, 1.0]))
    for _ in range(20):
        assert int(sample(logits, b).sampled_B[0]) == 1


def test_seeded_rows_repeat():
    logits = torch.randn(2, 50)
    b = batch(2, seeds=[7, None])
    first = [int(sample(logits, b).sampled_B[0]) for _ in range(5)]
    assert len(set(first)) == 1


def test_penalties_math():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, True, False]])
    b = batch(1, temperature_B=torch.zeros(1), all_greedy=True, output_counts_BV=counts, prompt_mask_BV=prompt,
              repetition_penalty_B=torch.tensor([2.0]), frequency_penalty_B=torch.tensor([0.5]),
              presence_penalty_B=torch.tensor([0.25]))
    from moe.worker.sampler import _apply_penalties

    out = _apply_penalties(logits, b)
    # token 0: 2/2 - 0.5*2 - 0.25 = -0.25; token 1: -2*2 - 0.5 - 0.25 = -4.75; token 2: 1/2; token 3 untouched.
    torch.testing.assert_close(out, torch.tensor([[-0.25, -4.75, 0.5, 0.5]]))


def test_logprobs_and_rank():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    b = batch(1, temperature_B=torch.zeros(1), all_greedy=True, max_num_logprobs=2)
    out = sample(logits, b)
    assert out.sampled_B.tolist() == [1] and out.sampled_rank_B.tolist() == [1]
    assert out.logprob_ids_BK.tolist() == [[1, 2]]
    torch.testing.assert_close(out.sampled_logprob_B, torch.log(torch.tensor([0.6])))
    b.banned_tokens = torch.tensor([[0], [1]])  # (row 0, token 1)
    out = sample(logits, b)
    assert out.sampled_B.tolist() == [2] and out.sampled_rank_B.tolist() == [2]


class _NoFloatCopy(torch.Tensor):
    """Logits whose float32 copy fails: the all-greedy path must argmax them as they are."""

    def float(self):
        raise AssertionError("all-greedy sampling made a float32 copy of the logits")


def test_all_greedy_argmax_of_half_logits_without_a_float_copy():
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(6, 300, generator=g)).to(torch.bfloat16)
    logits[2, 7] = logits[2, 200] = logits[2].max() + 1  # a tie: the first maximum wins, as in float32
    want = logits.float().argmax(-1)
    b = batch(6, temperature_B=None, seeds=None, all_greedy=True)
    got = sample(logits.as_subclass(_NoFloatCopy), b).sampled_B
    assert torch.equal(got.as_subclass(torch.Tensor), want) and int(got[2]) == 7
    # asking for logprobs (or penalties, or banned tokens) takes the float32 path
    with_logprobs = batch(6, temperature_B=None, seeds=None, all_greedy=True, max_num_logprobs=0)
    out = sample(logits, with_logprobs)
    assert torch.equal(out.sampled_B, want) and out.sampled_logprob_B is not None
