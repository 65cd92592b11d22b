"""CUDA-graph decode: the capture sizes and the padding rule (on any machine), the engine
arguments that steer them, and on a GPU the same greedy tokens with graphs as without."""
import pytest
import torch

from moe.config import EngineArgs
from moe.worker.cuda_graphs import StepGraphs, default_capture_sizes


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and all(s % 8 == 0 for s in sizes[3:])


def test_padded_size_is_the_smallest_captured_size_that_fits():
    graphs = StepGraphs([8, 1, 4, 2, 4])
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.padded_size(3) is None  # nothing captured yet: run eagerly
    graphs.graphs = {s: object() for s in graphs.sizes}
    assert [graphs.padded_size(b) for b in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


@pytest.mark.parametrize("sizes", [[], [0, 4], [-1]])
def test_bad_capture_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(model="m", cudagraph_capture_sizes=sizes).validate()


def test_capture_sizes_flag():
    import argparse
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--cudagraph-capture-sizes", "1", "2", "4",
                                                       "--enforce-eager"]))
    assert args.cudagraph_capture_sizes == [1, 2, 4] and args.enforce_eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graph_logits", [True, False])  # the LM head inside the graphs, or after a replay
def test_graphs_give_the_eager_tokens(graph_logits, monkeypatch):
    import random

    import moe.worker.model_runner as model_runner
    from moe import LLM, SamplingParams
    monkeypatch.setattr(model_runner, "GRAPH_LOGITS", graph_logits)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (1, 9, 33, 70, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs, logprobs = {}, {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 gpu_memory_utilization=0.2) as llm:
            runner = llm.llm_engine.executor.runner
            graphs = runner.graphs
            assert (graphs is None) == eager and (eager or sorted(graphs.graphs) == [1, 2, 4])
            assert (runner.graph_logits is not None) == (graph_logits and not eager)
            done = llm.generate(prompts, params, use_tqdm=False)
            outs[eager] = [o.outputs[0].token_ids for o in done]
            logprobs[eager] = [[[step[t].logprob for t in sorted(step)] for step in o.outputs[0].logprobs]
                               for o in done]
    assert len(outs[False]) == len(prompts) and outs[False] == outs[True]
    got = torch.tensor([lp for steps in logprobs[False] for step in steps for lp in step])
    want = torch.tensor([lp for steps in logprobs[True] for step in steps for lp in step])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_async_scheduling_gives_the_synchronous_tokens_with_graphs():
    """On the GPU the next step's pending inputs are filled on the device before a graph replay."""
    import random

    from moe import LLM, SamplingParams
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (1, 9, 33, 70, 5, 17)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10 + i, logprobs=1)
              for i in range(len(prompts))]
    outs = {}
    for requested in (False, None):  # None, the default, is async on CUDA
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.2,
                 async_scheduling=requested) as llm:
            assert llm.llm_engine.core.async_scheduling is (requested is None)
            outs[requested] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                               for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[None] == outs[False]


def test_default_mixed_sizes():
    from moe.worker.cuda_graphs import default_mixed_sizes
    for fine in (True, False):
        assert default_mixed_sizes(100, fine) == [64, 100]
    sizes = default_mixed_sizes(8192, fine=True)
    assert sizes[:5] == [64, 128, 256, 512, 768] and sizes[-1] == 8192 and 4096 in sizes
    gaps = [b - a for a, b in zip(sizes[3:], sizes[4:])]
    assert set(gaps[:sizes.index(4096) - 3]) == {256} and set(gaps[sizes.index(4096) - 3:]) == {512}
    assert default_mixed_sizes(2000, fine=True)[-2:] == [1792, 2000]
    coarse = default_mixed_sizes(8192, fine=False)
    assert coarse[:5] == [64, 128, 256, 512, 1024] and all(b - a == 512 for a, b in zip(coarse[4:], coarse[5:]))
    assert default_mixed_sizes(2000, fine=False)[-2:] == [1536, 2000]


def test_mixed_graph_max_tokens_is_the_least_of_the_attention_layers(monkeypatch):
    """Unified attention graphs mixed steps of any size, MLA up to the steps it runs absorbed, the
    varlen prefill kernel and MLA's forced modes none."""
    import sys

    import models.layers.attention as attention
    import models.layers.mla_attention as mla
    from models.config import RopeConfig
    cfg = mla.MLAConfig(hidden_size=16, num_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, max_position_embeddings=64, rope=RopeConfig(10000.0))
    gqa, latent = attention.Attention(4, 8, 2, 0.3), mla.MLAAttention(cfg)
    assert attention.mixed_graph_max_tokens([gqa, gqa]) == sys.maxsize
    assert attention.mixed_graph_max_tokens([gqa, latent]) == mla.ABSORBED_MAX_TOKENS == 2048
    assert attention.mixed_graph_max_tokens([]) == 0
    assert attention.mixed_graph_max_tokens([gqa, mla.MLAAttention(cfg, mode="expanded")]) == 0
    monkeypatch.setattr(attention, "UNIFIED_ATTENTION", False)
    assert attention.mixed_graph_max_tokens([gqa]) == 0


def _mixed_step_prompts(seed: int, vocab: int) -> tuple[list[dict], list]:
    """Prompts whose steps mix prefill chunks with decodes: three sharing a 40-token prefix (prefix
    hits), six of their own; greedy, 2 logprobs, outputs of different lengths (requests finish mid-run)."""
    import random

    from moe import SamplingParams
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(1, vocab) for _ in range(n)]} for n in (3, 30, 61)]
    prompts += [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in (1, 9, 70, 5, 17, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mixed_sizes", [None, [16, 32]])  # [16, 32]: larger steps fall back to eager
def test_mixed_step_graphs_give_the_eager_tokens(mixed_sizes, monkeypatch):
    """Steps that mix prefill chunks with decodes replay the mixed graphs (chunked prefill across
    token buckets, shared prefixes hitting the cache, requests finishing mid-batch, preemption
    with a small KV cache) and give the eager tokens and logprobs (up to a near-tie)."""

    import moe.worker.model_runner as model_runner
    from moe import LLM
    if mixed_sizes is not None:
        monkeypatch.setattr(model_runner, "default_mixed_sizes", lambda max_tokens: mixed_sizes)
    prompts, params = _mixed_step_prompts(seed=2, vocab=512)
    outs, replays = {}, {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 max_num_batched_tokens=64, max_model_len=192, kv_cache_memory_bytes=12 * 64 * 1024,
                 gpu_memory_utilization=0.2) as llm:
            runner = llm.llm_engine.executor.runner
            assert (runner.mixed_graphs is None) == eager
            if not eager:
                assert runner.mixed_graphs.sizes == (mixed_sizes or [64])
                real_replay = runner.mixed_graphs.replay
                replays[eager] = []
                runner.mixed_graphs.replay = lambda t: replays[eager].append(t) or real_replay(t)
            outs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if not eager:
                preempted = {m.name: m.value for m in llm.get_metrics()}.get("moe:num_preemptions", 0)
    assert replays[False], "no mixed step replayed a graph"
    assert preempted > 0, "the KV cache was large enough to never preempt: the test lost its edge case"
    compared = sum(_agree_until_a_near_tie(g, e) for g, e in zip(outs[False], outs[True]))
    assert compared >= sum(p.max_tokens for p in params) // 4  # the comparison reached far enough


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mla_mixed_step_graphs_give_the_tokens_of_expanded_eager_steps(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA): mixed steps of little prefill attention replay graphs with every query row
    absorbed, the others run eagerly with their prefill rows expanded (both kinds in one run), and
    the tokens and logprobs are those of eager steps alone (the expanded form), up to a near-tie;
    chunked prefill across the token buckets, prefix hits, requests finishing mid-batch."""

    import models.layers.mla_attention as mla
    from moe import LLM
    from tests.factories_deepseek import make_deepseek_v3_checkpoint
    path = make_deepseek_v3_checkpoint(str(tmp_path / "ds"))
    prompts, params = _mixed_step_prompts(seed=4, vocab=500)
    outs, replays, fits = {}, [], []
    for eager in (True, False):
        with LLM(path, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4, max_num_batched_tokens=64,
                 max_model_len=192, gpu_memory_utilization=0.2) as llm:
            runner = llm.llm_engine.executor.runner
            assert (runner.mixed_graphs is None) == eager
            if not eager:
                layer = runner.model.attention_layers()[0]
                # a chunk of 64 new tokens over 64 cached ones is past the limit; short chunks are not
                monkeypatch.setattr(mla, "ABSORBED_MAX_HEAD_PAIRS", 64 * 64 * layer.num_local_heads - 1)
                real_replay, real_fits = runner.mixed_graphs.replay, runner.mixed_graph_fits
                runner.mixed_graphs.replay = lambda t: replays.append(t) or real_replay(t)
                runner.mixed_graph_fits = lambda n, lens: fits.append(real_fits(n, lens)) or fits[-1]
            outs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert replays and fits.count(True) == len(replays), "no mixed step replayed a graph"
    assert False in fits, "no mixed step ran eagerly beside the graphs: the test lost its edge case"
    # fp32: the two forms differ in the last bits only, so only ties within 1e-3 end a comparison
    compared = sum(_agree_until_a_near_tie(g, e, margin=1e-3) for g, e in zip(outs[False], outs[True]))
    assert compared >= sum(p.max_tokens for p in params) // 4  # the comparison reached far enough


def test_mla_mixed_graph_fits_counts_the_chunks_pairs_times_heads(monkeypatch):
    import numpy as np

    import models.layers.mla_attention as mla
    from models.config import RopeConfig
    cfg = mla.MLAConfig(hidden_size=16, num_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, max_position_embeddings=64, rope=RopeConfig(10000.0))
    layer = mla.MLAAttention(cfg)
    monkeypatch.setattr(mla, "ABSORBED_MAX_HEAD_PAIRS", 4 * (100 * 300 + 20 * 20))
    n, lens = np.array([1, 1, 100, 20]), np.array([5000, 7000, 300, 20])  # decode rows do not count
    assert layer.mixed_graph_fits(n, lens)
    assert not layer.mixed_graph_fits(n, lens + np.array([0, 0, 0, 1]))


def _agree_until_a_near_tie(graphs_out, eager_out, margin: float = 0.02) -> int:
    """Greedy tokens and their logprobs agree, up to the first step whose two best eager logprobs
    lie within `margin`: a padded graph runs other GEMM shapes (other kernel configs, sums in another order),
    whose last-bit differences may pick the other token there. Returns the steps compared."""
    for i, (tok, lp) in enumerate(zip(eager_out.token_ids, eager_out.logprobs)):
        assert graphs_out.token_ids[i] == tok, f"token {i} differs away from a near-tie"
        assert graphs_out.logprobs[i][tok].logprob == pytest.approx(lp[tok].logprob, abs=1e-2)
        best = sorted((v.logprob for v in lp.values()), reverse=True)
        if len(best) > 1 and best[0] - best[1] < margin:
            return i + 1
    return len(eager_out.token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mixed_step_graphs_survive_aborts_mid_prefill_and_mid_decode():
    """Requests aborted while their prompt is half prefilled (its chunk sat in a mixed step) and
    while decoding leave the others' tokens as eager steps give them, and free their blocks."""
    import random

    from moe import LLM, SamplingParams
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (50, 120, 7, 33, 140)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outs, replayed = {}, {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 max_num_batched_tokens=48, max_model_len=256, gpu_memory_utilization=0.2) as llm:
            engine = llm.llm_engine
            if not eager:
                graphs = engine.executor.runner.mixed_graphs
                real_replay, replayed[eager] = graphs.replay, []
                graphs.replay = lambda t: replayed[eager].append(t) or real_replay(t)
            for i, p in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": p}, params)
            tokens: dict[str, list[int]] = {}
            for step in range(200):
                if step == 3:  # "1" (120 tokens) is mid-prefill in chunks of <= 48, "0" decoding
                    req = engine.scheduler.requests["1"]
                    assert 0 < req.num_computed_tokens < len(prompts[1]), "the abort lost its edge case"
                    engine.abort_request(["1", "0"])
                for out in engine.step():
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                if not engine.has_unfinished_requests():
                    break
            assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.num_blocks
            outs[eager] = {k: v for k, v in tokens.items() if k not in ("0", "1")}
    assert replayed[False], "no mixed step replayed a graph"
    assert sorted(outs[False]) == ["2", "3", "4"] and outs[False] == outs[True]
