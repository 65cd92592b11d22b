"""DeepSeek-V3 pieces on their own: the grouped router, MLA absorbed vs expanded, YaRN tables,
FP8 block dequantisation and its loader pairing."""
from __future__ import annotations

import math

import pytest
import torch

from models.config import RopeConfig
from models.fp8 import Fp8BlockConfig, attach_fp8_scales, dequantize_fp8_block, quantize_fp8_block
from models.layers.linear import ReplicatedLinear
from models.layers.mla_attention import MLAAttention, MLAConfig
from models.layers.rotary_yarn import YarnRotaryEmbedding, yarn_softmax_scale
from routing.grouped_topk import grouped_topk
from tests.factories_deepseek import dequantize_block, mla_step_metadata, quantize_block


# ---- router ---------------------------------------------------------------------------------
def _direct_grouped_topk(logits, bias, top_k, n_group, topk_group, renorm, factor):
    """One token at a time, in plain Python, straight from the DeepSeek-V3 description."""
    T, E = logits.shape
    per = E // n_group
    ids_out, w_out = [], []
    for t in range(T):
        scores = [1 / (1 + math.exp(-float(x))) for x in logits[t]]
        biased = [s + float(b) for s, b in zip(scores, bias)]
        group_score = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        ids = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        w = [scores[e] for e in ids]
        if renorm:
            w = [x / sum(w) for x in w]
        ids_out.append(ids)
        w_out.append([x * factor for x in w])
    return ids_out, w_out


@pytest.mark.parametrize("E,n_group,topk_group,top_k,renorm,factor", [
    (16, 4, 2, 4, True, 2.5), (16, 8, 3, 5, False, 1.0), (8, 1, 1, 2, True, 1.0), (12, 3, 1, 1, True, 16.0),
    (8, 8, 4, 4, True, 2.5),  # one expert per group: a group's score is its single expert
])
@pytest.mark.parametrize("T", [1, 7])
def test_grouped_topk_matches_direct(E, n_group, topk_group, top_k, renorm, factor, T):
    gen = torch.Generator().manual_seed(E * 100 + T)
    logits = torch.randn(T, E, generator=gen)
    bias = 0.3 * torch.randn(E, generator=gen)
    out = grouped_topk(logits, top_k, n_group, topk_group, renorm, factor, bias)
    assert out.topk_ids_TK.dtype == torch.int32 and out.topk_weights_TK.dtype == torch.float32
    ids, w = _direct_grouped_topk(logits, bias, top_k, n_group, topk_group, renorm, factor)
    for t in range(T):
        order = out.topk_ids_TK[t].argsort()
        got_ids = out.topk_ids_TK[t][order].tolist()
        want = sorted(zip(ids[t], w[t]))
        assert got_ids == [i for i, _ in want]
        torch.testing.assert_close(out.topk_weights_TK[t][order], torch.tensor([x for _, x in want]),
                                   atol=1e-6, rtol=1e-6)


def test_grouped_topk_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    out = grouped_topk(logits, 2, 1, 1, False, 1.0, bias)
    assert sorted(out.topk_ids_TK[0].tolist()) == [0, 3]
    got = dict(zip(out.topk_ids_TK[0].tolist(), out.topk_weights_TK[0].tolist()))
    assert got[3] == pytest.approx(1 / (1 + math.exp(1.0)))  # sigmoid(-1), not biased


def test_grouped_topk_matches_transformers_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 32, generator=gen))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(32, generator=gen))
    x = torch.randn(9, 32, generator=gen)
    logits, w_ref, ids_ref = router(x)
    out = grouped_topk(logits, 6, 8, 3, True, 2.5, router.e_score_correction_bias)
    for t in range(9):
        a, b = ids_ref[t].argsort(), out.topk_ids_TK[t].argsort()
        assert ids_ref[t][a].tolist() == out.topk_ids_TK[t][b].tolist()
        torch.testing.assert_close(w_ref[t][a], out.topk_weights_TK[t][b])


def test_grouped_topk_rejects_bad_groups():
    with pytest.raises(ValueError, match="divisible"):
        grouped_topk(torch.zeros(1, 10), 2, 4, 2)
    with pytest.raises(ValueError, match="exceeds"):
        grouped_topk(torch.zeros(1, 8), 5, 4, 2)


# ---- MLA: absorbed vs expanded ------------------------------------------------------------
@pytest.mark.parametrize("q_lora_rank,rope", [
    (24, RopeConfig(10000.0, "yarn", 4.0, 16, {"mscale": 0.707, "mscale_all_dim": 1.0})),
    (None, RopeConfig(10000.0)),
])
def test_mla_absorbed_matches_expanded(q_lora_rank, rope):
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=40, num_heads=3, q_lora_rank=q_lora_rank, kv_lora_rank=20, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=256, rope=rope)
    modules = {m: MLAAttention(cfg, mode=m) for m in ("expanded", "absorbed", "auto")}
    ref = modules["expanded"]
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
        for m in modules.values():
            m.load_state_dict(ref.state_dict())
    block_size, num_blocks = 4, 64
    # Step 1: fresh prefills (one of a single token); step 2: chunked prefills over cached
    # context plus decodes (a context of 1, one ending on a block edge, longer ones).
    steps = [([5, 1, 9, 3], [0, 0, 0, 0]), ([1, 6, 1, 1], [5, 1, 9, 3])]
    outs = {m: [] for m in modules}
    for mode, mod in modules.items():
        mod.kv_cache = torch.zeros(mod.kv_cache_shape(num_blocks, block_size))
        gen = torch.Generator().manual_seed(1)
        for new, cached in steps:
            meta, positions = mla_step_metadata(new, cached, block_size, num_blocks)
            x = torch.randn(sum(new), cfg.hidden_size, generator=gen)
            outs[mode].append(mod(positions, x, meta))
    for mode in ("absorbed", "auto"):
        for a, b in zip(outs[mode], outs["expanded"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert modules["auto"].kv_cache.shape == (num_blocks, block_size, 28)
    m = 0.1 * math.log(4.0) + 1 if rope.scaling_type == "yarn" else 1.0  # mscale_all_dim = 1
    assert ref.scale == pytest.approx(20 ** -0.5 * m * m)


def test_mla_cache_holds_latent_and_rope_key_only():
    cfg = MLAConfig(hidden_size=16, num_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
                    qk_rope_head_dim=4, v_head_dim=4, max_position_embeddings=64, rope=RopeConfig())
    m = MLAAttention(cfg)
    assert m.kv_cache_shape(10, 16) == (10, 16, 12)


# ---- YaRN ---------------------------------------------------------------------------------
def test_yarn_tables_and_scale_match_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    params = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.8, mscale_all_dim=0.9,
                  original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
    hf_cfg = DeepseekV3Config(qk_rope_head_dim=16, max_position_embeddings=2560, rope_parameters=dict(params))
    hf = DeepseekV3RotaryEmbedding(hf_cfg)
    pos = torch.arange(0, 2560, 7)[None]
    cos_ref, sin_ref = hf(torch.zeros(1, dtype=torch.float32), pos)
    rope = RopeConfig.from_hf(dict(rope_parameters=params))
    ours = YarnRotaryEmbedding(16, 2560, rope, is_neox_style=False)
    torch.testing.assert_close(ours.cos_cache[pos[0]], cos_ref[0, :, :8])
    torch.testing.assert_close(ours.sin_cache[pos[0]], sin_ref[0, :, :8])
    assert yarn_softmax_scale(24, rope) == pytest.approx(yarn_apply_mscale(params, 24 ** -0.5), rel=1e-12)


# ---- FP8 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(160, 136), (128, 256), (7, 300), (3, 130, 72)])
def test_fp8_block_quant_roundtrip(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape[-2:] == (-(-shape[-2] // 128), -(-shape[-1] // 128))
    deq = dequantize_fp8_block(q, s, (128, 128))
    torch.testing.assert_close(deq, w, atol=0.07 * w.abs().max().item(), rtol=0.07)
    if len(shape) == 2:  # the factory's loop-by-block twin gives the same numbers
        q2, s2 = quantize_block(w)
        torch.testing.assert_close(s2, s)
        assert torch.equal(dequantize_fp8_block(q2, s2, (128, 128)), dequantize_block(q2, s2))


@pytest.mark.parametrize("scale_first", [False, True])
def test_fp8_loader_pairs_weight_and_scale_in_any_order(scale_first):
    lin = ReplicatedLinear(200, 150)
    attach_fp8_scales(lin, Fp8BlockConfig(), lambda name, m: ["weight"] if m is lin else [])
    w = torch.randn(150, 200)
    q, s = quantize_fp8_block(w)
    pieces = {}
    items = [("weight_scale_inv", s), ("weight", q.float())] if scale_first else [("weight", q.float()),
                                                                                   ("weight_scale_inv", s)]
    for name, t in items:
        p = getattr(lin, name)
        assert tuple(t.shape) == p.param_loader.ckpt_shape(None, None)
        pieces[name] = p.param_loader.load(p, t.to(p.dtype), None, None)
    assert pieces == {"weight": [(None, None)], "weight_scale_inv": [(None, None)]}
    assert torch.equal(lin.weight, dequantize_fp8_block(q, s, (128, 128)))
    assert torch.equal(lin.weight_scale_inv.view(2, 2), s)
