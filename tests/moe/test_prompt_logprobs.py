"""SamplingParams.prompt_logprobs through the whole engine (vLLM's shape): one entry per prompt
token, None for the first, else {token id: Logprob} of the prompt token (its rank in the raw
distribution of the position before) and the top-k there.

Values are compared with Hugging Face transformers' log_softmax of its logits on the tiny random
checkpoints (Qwen3-MoE, DeepSeek-V3, Llama-4), with chunked prefill (a prompt over several steps),
sub-chunked lm_head calls, prefix caching, n > 1, async scheduling and preemption giving the same
values; the GPU tests check CUDA graphs against eager and that no launch waits for the device."""
from __future__ import annotations

import random

import pytest
import torch

import moe.worker.prompt_logprobs as prompt_logprobs_mod
from moe import LLM, SamplingParams
from tests.factories import load_hf_model

PROMPT_LENGTHS = [1, 2, 17, 33]  # one token (only None), two, and across 16-token blocks


def _prompts(lengths, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[P, V] log_softmax of transformers' fp32 logits: row j - 1 scores prompt token j."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches_reference(entries, prompt: list[int], ref: torch.Tensor, k: int, atol: float = 1e-4) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for j in range(1, len(prompt)):
        entry, row, tok = entries[j], ref[j - 1], prompt[j]
        assert tok in entry and next(iter(entry)) == tok, "the prompt token comes first"
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=atol), f"token {j}"
        # its rank in the raw distribution (1 = most likely), allowing for fp32 near-ties
        lo = int((row > row[tok] + atol).sum()) + 1
        hi = int((row > row[tok] - atol).sum()) + 1
        assert lo <= entry[tok].rank <= hi, f"token {j}: rank {entry[tok].rank} not in [{lo}, {hi}]"
        vals, ids = row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert set(entry) == {tok, *ids.tolist()}, f"token {j}: the prompt token and the top {k}"
        for r, (t, v) in enumerate(zip(ids.tolist(), vals.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=atol)
            if t != tok:
                assert entry[t].rank == r
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())


def _generate(model_dir: str, prompts, params, **llm_kwargs):
    llm = LLM(model_dir, dtype="float32", device="cpu", **llm_kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _values(entries) -> list:
    return [None if e is None else sorted((t, lp.logprob, lp.rank) for t, lp in e.items()) for e in entries]


def _assert_same(a, b, atol: float = 1e-5) -> None:
    """Two prompt_logprobs lists: the same tokens and ranks, logprobs within atol."""
    va, vb = _values(a), _values(b)
    assert len(va) == len(vb)
    for x, y in zip(va, vb):
        assert (x is None) == (y is None)
        if x is not None:
            assert [(t, r) for t, _, r in x] == [(t, r) for t, _, r in y]
            assert [lp for _, lp, _ in x] == pytest.approx([lp for _, lp, _ in y], abs=atol)


# ---- against transformers -------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 3])
def test_qwen3_matches_hf_whole_and_chunked(qwen3_ckpt, k, monkeypatch):
    """Unchunked, and with a 16-token budget (prompts over several steps) and lm_head calls of 5
    rows (the scoring's own sub-chunks): the same values as transformers."""
    prompts = _prompts(PROMPT_LENGTHS)
    hf = load_hf_model(qwen3_ckpt)
    refs = [_hf_logprobs(hf, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k, ignore_eos=True)
    _, whole = _generate(qwen3_ckpt, prompts, params)
    monkeypatch.setattr(prompt_logprobs_mod, "CHUNK_ELEMENTS", 5 * 512)
    llm, chunked = _generate(qwen3_ckpt, prompts, params, max_num_batched_tokens=16, block_size=4, max_num_seqs=3)
    assert llm.llm_engine.executor.runner.prompt_logprobs.rows_per_call == 5
    for prompt, ref, a, b in zip(prompts, refs, whole, chunked):
        assert_matches_reference(a.prompt_logprobs, prompt, ref, k)
        assert_matches_reference(b.prompt_logprobs, prompt, ref, k)
        _assert_same(a.prompt_logprobs, b.prompt_logprobs)
        if k == 0:
            assert all(len(e) == 1 for e in a.prompt_logprobs[1:]), "prompt_logprobs=0: the prompt token only"
        assert len(a.outputs[0].token_ids) == 3


def test_deepseek_v3_matches_hf(tmp_path):
    from tests.factories_deepseek import make_deepseek_v3_checkpoint
    path = make_deepseek_v3_checkpoint(str(tmp_path / "ds"), seed=0)
    prompts = _prompts([2, 21])
    hf = load_hf_model(path)
    _, outs = _generate(path, prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                        max_num_batched_tokens=8, block_size=4)
    for p, o in zip(prompts, outs):
        assert_matches_reference(o.prompt_logprobs, p, _hf_logprobs(hf, p), 2)


def test_llama4_matches_hf(tmp_path):
    """Prompts across the 8-token attention chunks (chunked-local layers: their own KV group)."""
    from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint
    hf = make_llama4_model(seed=0)
    path = save_llama4_checkpoint(hf, str(tmp_path / "l4"))
    prompts = _prompts([3, 20])
    _, outs = _generate(path, prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                        max_num_batched_tokens=8, block_size=4)
    for p, o in zip(prompts, outs):
        assert_matches_reference(o.prompt_logprobs, p, _hf_logprobs(hf, p), 2)


# ---- the engine around it -------------------------------------------------------------------

def test_prefix_cache_is_not_read_but_filled(qwen3_ckpt):
    """A prompt the cache holds is computed again for its prompt logprobs (the cached positions
    have no logits; vLLM skips the cache likewise), with the same values, and still fills the
    cache for requests without them."""
    prompt = _prompts([40], seed=1)[0]
    llm = LLM(qwen3_ckpt, dtype="float32", device="cpu", enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    with_lp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    first = llm.generate({"prompt_token_ids": prompt}, with_lp, use_tqdm=False)[0]
    assert llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0].num_cached_tokens == 32
    again = llm.generate({"prompt_token_ids": prompt}, with_lp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _assert_same(first.prompt_logprobs, again.prompt_logprobs)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_mixed_batch_n_and_untouched_neighbours(qwen3_ckpt):
    """Requests with and without prompt_logprobs in one batch: the others get None and the
    tokens they get alone; n = 2 reports them once per request (sequence 0 computes them)."""
    prompts = _prompts([12, 30, 7], seed=2)
    sampled = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=4, prompt_logprobs=1)
    params = [SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=4), SamplingParams(temperature=0.0,
                                                                                               max_tokens=5), sampled]
    llm, outs = _generate(qwen3_ckpt, prompts, params, max_num_batched_tokens=16, enable_prefix_caching=True)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params[1], use_tqdm=False)[0]
    assert outs[1].prompt_logprobs is None and outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    hf = load_hf_model(qwen3_ckpt)
    assert_matches_reference(outs[0].prompt_logprobs, prompts[0], _hf_logprobs(hf, prompts[0]), 4)
    assert len(outs[2].outputs) == 2
    assert_matches_reference(outs[2].prompt_logprobs, prompts[2], _hf_logprobs(hf, prompts[2]), 1)
    n1 = llm.generate({"prompt_token_ids": prompts[2]}, sampled.clone(n=1), use_tqdm=False)[0]
    _assert_same(outs[2].prompt_logprobs, n1.prompt_logprobs)
    assert not llm.llm_engine.executor.runner.prompt_logprobs.active, "nothing left tracked"


def test_no_extra_lm_head_work_without_prompt_logprobs(qwen3_ckpt):
    """Without prompt_logprobs the lm_head sees only the sampling rows; with them, calls of at most
    rows_per_call rows (the [rows, V] float32 bound)."""
    llm = LLM(qwen3_ckpt, dtype="float32", device="cpu", max_num_batched_tokens=64)
    runner = llm.llm_engine.executor.runner
    real, rows = runner.model.compute_logits, []
    runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or real(h)
    prompts = [{"prompt_token_ids": p} for p in _prompts([50, 20], seed=3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert rows and max(rows) <= 2
    rows.clear()
    runner.prompt_logprobs.rows_per_call = 16
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    assert max(rows) == 16 and sum(rows) >= 49 + 19


PREEMPT_PROMPTS = _prompts([30, 45, 20, 38, 25], seed=4)
PREEMPT_PARAMS = SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy_outputs(qwen3_ckpt):
    return _generate(qwen3_ckpt, PREEMPT_PROMPTS, PREEMPT_PARAMS, max_model_len=96)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_async_scheduling_give_the_same_values(qwen3_ckpt, roomy_outputs, async_scheduling):
    """A KV cache small enough to preempt (requests recomputed before and after their first
    token), synchronous or async scheduling: prompt logprobs delivered once, as with a roomy cache."""
    tight, got = _generate(qwen3_ckpt, PREEMPT_PROMPTS, PREEMPT_PARAMS, max_model_len=96, num_gpu_blocks_override=8,
                           max_num_seqs=5, async_scheduling=async_scheduling)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"
    assert tight.llm_engine.core.async_scheduling is async_scheduling
    for w, g in zip(roomy_outputs, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        _assert_same(w.prompt_logprobs, g.prompt_logprobs, atol=1e-4)


@pytest.mark.parametrize("value,match", [(-1, "must be a non-negative integer"), (True, "must be an integer"),
                                         ("2", "must be an integer"), (2.0, "must be an integer"),
                                         (2**63, "must be at most")])
def test_bad_values_are_refused(value, match):
    with pytest.raises(ValueError, match=f"prompt_logprobs={value!r}.*{match}" if value != 2**63 else match):
        SamplingParams(prompt_logprobs=value)


def test_values_past_max_logprobs_are_refused(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, dtype="float32", device="cpu", max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs=6: at most max_logprobs=5"):
        llm.generate("hi", SamplingParams(prompt_logprobs=6), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(prompt_logprobs=5, max_tokens=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and all(len(e) >= 5 for e in out.prompt_logprobs[1:])


def test_streamed_deltas_carry_them_first_and_once():
    """The output side: no sequence's delta goes out before the prompt logprobs have come (only
    sequence 0 computes them; another may reach its first token first), then the first delta
    carries them and later ones do not."""
    from moe.engine.core import CoreRequest, CoreStepResult
    from moe.engine.input_processor import ProcessedPrompt, _child_params
    from moe.engine.metrics import EngineMetrics
    from moe.engine.output_processor import OutputProcessor
    from moe.worker.prompt_logprobs import PromptLogprobs
    from scheduler.output import EngineCoreOutput

    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, prompt_logprobs=1)
    children = [CoreRequest(f"{i}_r", [5, 6, 7], 3, _child_params(params, i)) for i in range(2)]
    assert children[0].params.prompt_logprobs == 1 and children[1].params.prompt_logprobs is None
    proc = OutputProcessor(None, EngineMetrics("m", 64))
    proc.add_request("r", ProcessedPrompt(None, [5, 6, 7]), children)
    parent = proc.parents["r"]
    proc.process(CoreStepResult([EngineCoreOutput("1_r", [9])]))
    held = parent.delta_output()
    assert held.outputs == [] and held.prompt_logprobs is None and not held.finished
    plp = PromptLogprobs(1, [-1.0, -2.0], [3, 1], [[8], [7]], [[-0.5], [-2.0]])
    proc.process(CoreStepResult([EngineCoreOutput("0_r", [4], prompt_logprobs=plp)]))
    first = parent.delta_output()
    assert sorted(o.index for o in first.outputs) == [0, 1]
    assert first.prompt_logprobs[0] is None
    assert [(t, lp.logprob, lp.rank) for t, lp in first.prompt_logprobs[1].items()] == [(6, -1.0, 3), (8, -0.5, 1)]
    assert list(first.prompt_logprobs[2]) == [7] and first.prompt_logprobs[2][7].rank == 1
    proc.process(CoreStepResult([EngineCoreOutput("0_r", [4])]))
    assert parent.delta_output().prompt_logprobs is None
    assert parent.to_output().prompt_logprobs == first.prompt_logprobs


def test_core_messages_carry_them():
    from moe.engine.serialization import decode, encode, pack_output, unpack_output
    from moe.worker.prompt_logprobs import PromptLogprobs
    from scheduler.output import EngineCoreOutput

    plp = PromptLogprobs(1, [-1.5], [2], [[3, 4]], [[-0.1, -1.5]])
    for co in (EngineCoreOutput("a", [1], prompt_logprobs=plp), EngineCoreOutput("b", [2])):
        back = unpack_output(decode(encode(pack_output(co))))
        assert back.prompt_logprobs == co.prompt_logprobs and back.new_token_ids == co.new_token_ids


# ---- GPU -----------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_graphs_give_the_eager_values_and_no_launch_waits():
    """CUDA graphs (decode and mixed steps; the scoring runs eagerly after a replay) give the eager
    values; no step's launch, with or without prompt logprobs, synchronizes with the stream."""
    prompts = [{"prompt_token_ids": p} for p in _prompts([1, 9, 33, 70, 5, 17], seed=6)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                             prompt_logprobs=None if i % 3 == 1 else i % 4) for i in range(len(prompts))]
    outs = {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 max_num_batched_tokens=48, gpu_memory_utilization=0.2) as llm:
            runner = llm.llm_engine.executor.runner
            assert (runner.graphs is None) == eager
            llm.generate(prompts, params, use_tqdm=False)  # kernels compile outside the strict run
            real, launched = runner.launch, []

            def strict(*args, **kwargs):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return real(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    launched.append(1)
            runner.launch = strict
            outs[eager] = llm.generate(prompts, params, use_tqdm=False)
            assert len(launched) > 8
    for e, g, p in zip(outs[True], outs[False], params):
        assert (g.prompt_logprobs is None) == (p.prompt_logprobs is None)
        if g.prompt_logprobs is None:
            continue
        assert len(g.prompt_logprobs) == len(e.prompt_logprobs) and g.prompt_logprobs[0] is None
        ids = p and prompts[params.index(p)]["prompt_token_ids"]
        for j, (ge, ee) in enumerate(zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]), start=1):
            assert len(ge) == len(ee)
            assert ge[ids[j]].logprob == pytest.approx(ee[ids[j]].logprob, abs=1e-3)
