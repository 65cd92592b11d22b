"""DeepSeek-V3 with FP8 routed experts: the engine's choice (quantization, device, backend), the
FP8 expert parameters and their loading (gate/up scales stacked, TP slices on 128-blocks, EP
local experts only, fallback to dequantising when F does not split into blocks), and the
engine's tokens against the dequantised twin: forced on the CPU (torch backend, exact), and on
CUDA through the Triton FP8 kernel (skipped without a GPU).

Legend: D hidden, E experts, F expert intermediate size.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

import kernels
from models.fp8 import Fp8BlockConfig, dequantize_fp8_block, quantize_fp8_block, resolve_fp8_experts
from models.layers.moe import FusedMoE
from models.parallel.state import ParallelState, get_parallel_state, set_parallel_state
from moe import LLM, SamplingParams
from moe.config import EngineArgs
from tests.factories_deepseek import DSV3_FP8, make_deepseek_v3_checkpoint

# F = 256: two whole 128-row blocks (and 128 per rank under TP=2); D = 160 keeps partial blocks.
DSV3_FP8_EXPERTS = dict(DSV3_FP8, moe_intermediate_size=256)
PROMPT_LENGTHS = [1, 5, 17, 40]
CPU = torch.device("cpu")


def _prompts(seed: int = 3, vocab: int = 512) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in PROMPT_LENGTHS]


def _run(path: str, max_tokens: int = 6, logprobs: int = 1, **kwargs):
    llm = LLM(path, block_size=8, **{"dtype": "float32", "device": "cpu", **kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    return llm, [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _expert_params(llm) -> dict[str, torch.Tensor]:
    model = llm.llm_engine.executor.model
    return {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}


def _chosen_logprobs(comp) -> torch.Tensor:
    return torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)])


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3_fp8_experts")
    fp8_dir, twin_dir = str(root / "fp8"), str(root / "twin")
    make_deepseek_v3_checkpoint(fp8_dir, seed=4, fp8_twin_path=twin_dir, **DSV3_FP8_EXPERTS)
    return fp8_dir, twin_dir


@pytest.fixture(scope="module")
def twin_outputs(fp8_ckpt):
    return _run(fp8_ckpt[1])[1]


# ---- the engine's choice ------------------------------------------------------------------------

def test_resolve_fp8_experts(monkeypatch):
    fp8, cuda = Fp8BlockConfig(), torch.device("cuda", 0)
    monkeypatch.setattr(kernels, "available_backends", lambda device: ["triton", "torch"])
    decide = lambda q=None, dev=cuda, backend=None, fmt="auto", cfg=fp8, ok=True: (  # noqa: E731
        resolve_fp8_experts(cfg, q, dev, backend, fmt, ok))
    assert decide() and decide(backend="triton")
    assert not decide(dev=CPU) and not decide(backend="torch") and not decide(q="none")
    assert not decide(fmt="dummy") and not decide(cfg=None) and not decide(ok=False)
    assert not decide(cfg=Fp8BlockConfig(block=(64, 64)))
    assert decide(q="fp8", dev=CPU) and decide(q="fp8", backend="torch")
    monkeypatch.setattr(kernels, "available_backends", lambda device: ["torch"])
    assert not decide()
    with pytest.raises(ValueError, match="quantization='fp8' needs a block-FP8 checkpoint"):
        decide(q="fp8", cfg=None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        decide(q="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model="x", quantization="fp16").validate()


def test_default_on_cpu_dequantises_experts_at_load(fp8_ckpt, twin_outputs):
    """No CUDA: auto keeps today's behaviour, everything dequantised at load (also "none")."""
    for kwargs in ({}, {"quantization": "none"}):
        llm, outs = _run(fp8_ckpt[0], **kwargs)
        params = _expert_params(llm)
        assert params["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float32
        assert params["model.layers.1.mlp.experts.w13_weight_scale_inv"].dim() == 1  # the flat companion
        assert [o.token_ids for o in outs] == [o.token_ids for o in twin_outputs]


def test_quantization_fp8_on_unquantised_checkpoint_raises(fp8_ckpt):
    with pytest.raises(ValueError, match="quantization='fp8' needs a block-FP8 checkpoint"):
        LLM(fp8_ckpt[1], dtype="float32", device="cpu", quantization="fp8")


# ---- the engine with FP8 experts forced on the CPU (torch backend) -----------------------------

def test_fp8_experts_forced_on_cpu_match_dequantised_twin(fp8_ckpt, twin_outputs):
    llm, outs = _run(fp8_ckpt[0], quantization="fp8")
    params = _expert_params(llm)
    E, F = DSV3_FP8_EXPERTS["n_routed_experts"], DSV3_FP8_EXPERTS["moe_intermediate_size"]
    p = "model.layers.1.mlp.experts."
    assert params[p + "w13_weight"].dtype == params[p + "w2_weight"].dtype == torch.float8_e4m3fn
    assert tuple(params[p + "w13_weight_scale_inv"].shape) == (E, 2 * F // 128, 2)
    assert tuple(params[p + "w2_weight_scale_inv"].shape) == (E, 2, F // 128)
    # Everything else is still dequantised at load: shared experts, attention, dense MLP.
    model = llm.llm_engine.executor.model
    assert model.model.layers[1].mlp.shared_experts.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float32
    for ours, theirs in zip(outs, twin_outputs):
        assert ours.token_ids == theirs.token_ids
        # The torch backend dequantises exactly as the load-time path does.
        torch.testing.assert_close(_chosen_logprobs(ours), _chosen_logprobs(theirs), atol=1e-5, rtol=0)


def test_misaligned_intermediate_falls_back_to_dequantising(tmp_path, caplog, monkeypatch):
    """F = 72: gate's and up's scale blocks would share a w13 block, so FP8 experts are refused
    (one log line) and the model is exactly the dequantised one."""
    monkeypatch.setattr("models.layers.moe._FALLBACKS_LOGGED", set())  # logged once per process
    fp8_dir, twin_dir = str(tmp_path / "fp8"), str(tmp_path / "twin")
    make_deepseek_v3_checkpoint(fp8_dir, seed=2, fp8_twin_path=twin_dir, with_tokenizer=False, **DSV3_FP8)
    with caplog.at_level(logging.INFO, logger="models.layers.moe"):
        llm, outs = _run(fp8_dir, max_tokens=3, quantization="fp8")
    assert sum("does not split into whole 128x128 scale blocks" in r.message for r in caplog.records) == 1
    assert _expert_params(llm)["model.layers.1.mlp.experts.w2_weight"].dtype == torch.float32
    _, twin = _run(twin_dir, max_tokens=3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in twin]


# ---- FusedMoE loading under TP / EP (in-process: a faked ParallelState) --------------------------

def _hub_experts(E: int, D: int, F: int, seed: int = 0):
    """Per-expert hub tensors: {(shard, e): (fp8 [out, in], scale_inv)} and the dequantised
    stacked w13 [E, 2F, D] / w2 [E, D, F]."""
    g = torch.Generator().manual_seed(seed)
    hub, w13, w2 = {}, [], []
    for e in range(E):
        for shard, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
            hub[(shard, e)] = quantize_fp8_block(torch.randn(shape, generator=g))
        w13.append(torch.cat([dequantize_fp8_block(*hub[(s, e)], (128, 128)) for s in ("w1", "w3")]))
        w2.append(dequantize_fp8_block(*hub[("w2", e)], (128, 128)))
    return hub, torch.stack(w13), torch.stack(w2)


def _load(moe: FusedMoE, hub: dict) -> set:
    """What models/loader.load_weights does, per checkpoint tensor."""
    filled = set()
    for (shard, e), (q, s) in hub.items():
        for name, t in ((("w2_weight" if shard == "w2" else "w13_weight"), q),
                        (("w2_weight_scale_inv" if shard == "w2" else "w13_weight_scale_inv"), s)):
            param = getattr(moe, name)
            assert tuple(t.shape) == param.param_loader.ckpt_shape(shard, e)
            filled |= {(name, *piece) for piece in param.param_loader.load(param, t.to(param.dtype), shard, e)}
    return filled


@pytest.fixture
def parallel_state():
    saved = get_parallel_state()
    yield lambda **kw: set_parallel_state(ParallelState(**kw))
    set_parallel_state(saved)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tp_slices_fp8_experts_on_whole_blocks(parallel_state, tp_rank):
    E, D, F = 3, 160, 256
    parallel_state(tp_size=2, tp_rank=tp_rank)
    moe = FusedMoE(E, D, F, fp8_block=(128, 128))
    assert moe.fp8_block == (128, 128) and moe.w13_weight.dtype == torch.float8_e4m3fn
    hub, w13, w2 = _hub_experts(E, D, F)
    _load(moe, hub)
    f0, Fl = tp_rank * F // 2, F // 2
    got13 = dequantize_fp8_block(moe.w13_weight, moe.w13_weight_scale_inv, (128, 128))
    got2 = dequantize_fp8_block(moe.w2_weight, moe.w2_weight_scale_inv, (128, 128))
    assert torch.equal(got13, torch.cat([w13[:, f0:f0 + Fl], w13[:, F + f0:F + f0 + Fl]], dim=1))
    assert torch.equal(got2, w2[:, :, f0:f0 + Fl])


def test_tp_slice_off_the_blocks_falls_back(parallel_state):
    parallel_state(tp_size=2, tp_rank=1)
    moe = FusedMoE(2, 160, 384, fp8_block=(128, 128))  # 192 per rank: not whole 128-blocks
    assert moe.fp8_block is None and moe.w13_weight.dtype == torch.get_default_dtype()
    assert not hasattr(moe, "w13_weight_scale_inv")


def test_ep_holds_only_local_fp8_experts(parallel_state):
    E, D, F = 4, 160, 128
    parallel_state(ep_size=2, ep_rank=1, enable_expert_parallel=True, expert_placement_strategy="round_robin")
    moe = FusedMoE(E, D, F, fp8_block=(128, 128))
    assert tuple(moe.w13_weight.shape) == (2, 2 * F, D) and tuple(moe.w13_weight_scale_inv.shape) == (2, 2, 2)
    hub, w13, w2 = _hub_experts(E, D, F, seed=1)
    filled = _load(moe, hub)
    assert {e for (_, _, e) in filled} == {1, 3}  # round robin: rank 1 holds experts 1 and 3
    assert torch.equal(dequantize_fp8_block(moe.w13_weight, moe.w13_weight_scale_inv, (128, 128)), w13[[1, 3]])
    assert torch.equal(dequantize_fp8_block(moe.w2_weight, moe.w2_weight_scale_inv, (128, 128)), w2[[1, 3]])


# ---- CUDA: the Triton FP8 kernel in the engine -----------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 experts through Triton need CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_experts_on_cuda_close_to_dequantised_twin(fp8_ckpt, dtype):
    """Auto mode on CUDA keeps the experts FP8; activations are quantised per 128-group there,
    so the first step's distribution is compared within a tolerance, not token for token."""
    # A small KV cache: by default each LLM takes 90% of the GPU, and three are made here.
    kw = dict(device="cuda", dtype=dtype, max_tokens=1, logprobs=20, kv_cache_memory_bytes=1 << 28)
    llm, outs = _run(fp8_ckpt[0], **kw)
    assert _expert_params(llm)["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    _, twin = _run(fp8_ckpt[1], **kw)
    tol = 2e-2 if dtype == "float32" else 5e-2
    for ours, theirs in zip(outs, twin):
        a, b = ours.logprobs[0], theirs.logprobs[0]
        common = set(a) & set(b)
        assert len(common) >= 15
        assert max(abs(a[t].logprob - b[t].logprob) for t in common) < tol
        best_twin = sorted((lp.logprob for lp in b.values()), reverse=True)
        if best_twin[0] - best_twin[1] > 2 * tol:  # a clear winner must win in FP8 too
            assert ours.token_ids == theirs.token_ids
    # Decoding several steps with FP8 experts stays finite and full length.
    _, longer = _run(fp8_ckpt[0], device="cuda", dtype=dtype, max_tokens=8, kv_cache_memory_bytes=1 << 28)
    assert all(len(o.token_ids) == 8 and torch.isfinite(_chosen_logprobs(o)).all() for o in longer)
