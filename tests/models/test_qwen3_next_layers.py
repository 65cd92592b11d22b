"""Qwen3-Next / Qwen3.5-MoE (models/qwen3_next.py) against transformers (fp32, CPU), without the engine:
the Gated DeltaNet layer (both projection layouts, state carried across steps per slot, a fresh
sequence in a slot holding garbage), the MoE block with its gated shared expert, the whole model over
two steps with a hand-built paged KV cache and state pools, TP=2 slices summed against TP=1, the
checkpoint layouts (per-expert and fused experts, the multimodal one under model.language_model, MTP and
vision tensors skipped) and config parsing / refusals."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.attention import AttentionMetadata
from models.loader import load_weights
from models.parallel.state import ParallelState, get_parallel_state, set_parallel_state
from models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextGatedDeltaNet
from models.registry import load_model_config

LIN, FULL = "linear_attention", "full_attention"
# Key dim 16 != value dim 8 and 2 key heads of 2 value heads each, so a swapped size or a wrong
# grouping shows; a quarter of each 16-dim attention head rotates; layer 2 dense (Qwen3-Next).
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, initializer_range=0.05, attn_implementation="eager",
)
FAMILIES = {"qwen3_next": ("Qwen3NextForCausalLM", dict(norm_topk_prob=True, mlp_only_layers=[2])),
            "qwen3_5": ("Qwen3_5MoeForCausalLM", {})}


def hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model, fp32, with every weight that transformers initialises to a
    constant (norms, A_log, dt_bias) or small (conv, gates) moved away from it."""
    from transformers import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig as HFConfig,
                              Qwen3NextForCausalLM as HFModel)

    arch, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cls_cfg, cls = (HFConfig, HFModel) if family == "qwen3_next" else (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)
    model = cls(cls_cfg(**{**TINY, **extra, **overrides})).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # zero-centred: the checkpoint holds w of (1 + w)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("conv1d.weight", "shared_expert_gate.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def save_checkpoint(model, path: str, layout: str = "per_expert") -> str:
    """save_pretrained (config.json, hub per-expert names), or with transformers' fused 3-D experts;
    plus fake multi-token-prediction tensors, which the loader must skip."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file) if layout == "per_expert" else {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(8, 8)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(8, 8)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def ours_from(path: str):
    cls, cfg = load_model_config(path)
    assert cls is Qwen3NextForCausalLM
    model = cls(cfg).float().eval()
    load_weights(model, path, progress=False)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, transformers model, ours loaded from its saved checkpoint)."""
    hf = hf_model(request.param)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf, ours_from(path)


# ---- steps by hand: paged KV cache, state pools, metadata -----------------------------------
BLOCK, BLOCKS_PER_SEQ, SLOTS = 4, 24, 6


def bind_caches(model) -> None:
    """Zeroed KV caches; state pools full of NaN (a sequence starting at position 0 must not read them)."""
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(attn.kv_cache_shape(SLOTS * BLOCKS_PER_SEQ, BLOCK))
    for layer in model.recurrent_layers():
        for name, (shape, dtype) in layer.state_shapes(SLOTS).items():
            setattr(layer, name, torch.full(shape, float("nan"), dtype=dtype))


def step_meta(new: list[int], cached: list[int], slots: list[int]):
    """(AttentionMetadata, positions) of one step; sequence b owns the blocks of slot slots[b]."""
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(cached, new)]
    tables = torch.tensor([[s * BLOCKS_PER_SEQ + i for i in range(BLOCKS_PER_SEQ)] for s in slots], dtype=torch.int32)
    positions = [p for c, L in zip(cached, seq_lens) for p in range(c, L)]
    kv_slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, (c, L) in enumerate(zip(cached, seq_lens))
                for p in range(c, L)]
    decode = [b for b, n in enumerate(new) if n == 1]
    meta = AttentionMetadata(qsl, seq_lens, tables, torch.tensor(kv_slots), decode,
                             [b for b, n in enumerate(new) if n != 1])
    if decode:
        meta.decode_token_idx = torch.tensor([qsl[b] for b in decode])
        meta.decode_seq_lens = torch.tensor([seq_lens[b] for b in decode])
        meta.decode_block_tables = tables[decode].contiguous()
    meta.state_slots_B = torch.tensor(slots, dtype=torch.int64)
    meta.has_initial_state_B = torch.tensor([c > 0 for c in cached])
    return meta, torch.tensor(positions)


# Step 1: three fresh sequences (one longer than a 64-token chunk of the delta rule); step 2: two of
# them decode, one continues with 3 tokens, and a fourth starts in a slot no step has written.
STEP1 = dict(new=[5, 1, 70], cached=[0, 0, 0], slots=[3, 0, 5])
STEP2 = dict(new=[1, 3, 1, 4], cached=[5, 1, 70, 0], slots=[3, 0, 5, 1])
TOTAL = [6, 4, 71, 4]  # each sequence's tokens over both steps


def split_steps(per_seq: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of each sequence's [L, ...] tensor in the flat batches of step 1 and step 2."""
    one = torch.cat([x[:n] for x, n in zip(per_seq, STEP1["new"])])
    two = torch.cat([x[c:c + n] for x, c, n in zip(per_seq, STEP2["cached"], STEP2["new"])])
    return one, two


# ---- layers ----------------------------------------------------------------------------------
@torch.no_grad()
def test_gated_deltanet_matches_hf_over_two_steps(pair):
    """Flat batches of varlen sequences through our layer (states in the slots, carried into the
    second step) give transformers' outputs over each whole sequence (its chunked delta rule)."""
    family, hf, ours = pair
    theirs_layer, layer = hf.model.layers[0].linear_attn, ours.model.layers[0].linear_attn
    assert isinstance(layer, Qwen3NextGatedDeltaNet)
    bind_caches(ours)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, TINY["hidden_size"], generator=gen) for n in TOTAL]
    want = [theirs_layer(x[None])[0] for x in xs]
    got = []
    for step in (STEP1, STEP2):
        meta, _ = step_meta(**step)
        x = split_steps(xs)[len(got)]
        got.append(layer(x, meta))
    for g, w in zip(got, split_steps(want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # the state of a slot no sequence used stays as it was
    assert torch.isnan(layer.ssm_state[2]).all() and torch.isnan(layer.conv_state[4]).all()


@pytest.mark.parametrize("mode", [None, "chunked", "recurrent"])
@torch.no_grad()
def test_triton_path_picks_the_delta_rule_kernel_by_step_and_switch(pair, monkeypatch, mode):
    """On the Triton path a step with prefill rows takes the chunked kernel unless
    MOE_GATED_DELTA_PREFILL=recurrent; a decode-only step always the recurrent one (the kernels
    stand in for their torch reference here, so the outputs still match the reference's)."""
    import models.qwen3_next as qn
    from kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen

    calls = []

    def spy(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return gated_delta_rule_varlen(*args, **kwargs)
        return kernel

    if mode is None:
        monkeypatch.delenv("MOE_GATED_DELTA_PREFILL", raising=False)
    else:
        monkeypatch.setenv("MOE_GATED_DELTA_PREFILL", mode)
    monkeypatch.setattr(qn, "use_triton_attention", lambda x: True)
    monkeypatch.setattr(qn, "causal_conv1d_varlen_triton", causal_conv1d_varlen)
    monkeypatch.setattr(qn, "gated_delta_rule_recurrent_triton", spy("recurrent"))
    monkeypatch.setattr(qn, "gated_delta_rule_chunked_triton", spy("chunked"))
    qn.chunked_prefill.cache_clear()
    try:
        family, hf, ours = pair
        layer = ours.model.layers[0].linear_attn
        bind_caches(ours)
        x = torch.randn(sum(STEP1["new"]), TINY["hidden_size"], generator=torch.Generator().manual_seed(4))
        got = layer(x, step_meta(**STEP1)[0])
        decode_meta = step_meta(new=[1, 1, 1], cached=[5, 1, 70], slots=[3, 0, 5])[0]
        decode_meta.decode_only = True
        layer(x[:3], decode_meta)
        bind_caches(ours)
        monkeypatch.setattr(qn, "use_triton_attention", lambda x: False)
        torch.testing.assert_close(got, layer(x, step_meta(**STEP1)[0]))
    finally:
        qn.chunked_prefill.cache_clear()
    assert calls == ["recurrent" if mode == "recurrent" else "chunked", "recurrent"]


def test_prefill_switch_refuses_unknown_modes(monkeypatch):
    import models.qwen3_next as qn

    monkeypatch.setenv("MOE_GATED_DELTA_PREFILL", "fast")
    qn.chunked_prefill.cache_clear()
    try:
        with pytest.raises(ValueError, match="MOE_GATED_DELTA_PREFILL='fast'"):
            qn.chunked_prefill()
    finally:
        qn.chunked_prefill.cache_clear()


def test_state_shapes(pair):
    family, _, ours = pair
    layer = ours.recurrent_layers()[0]
    C = 2 * 2 * 16 + 4 * 8
    assert layer.state_shapes(7) == {"conv_state": ((7, C, 3), torch.float32),
                                     "ssm_state": ((7, 4, 16, 8), torch.float32)}
    assert layer.conv_state is None or layer.conv_state.shape == (SLOTS, C, 3)


def test_layer_lists(pair):
    family, _, ours = pair
    layers = ours.model.layers
    assert ours.recurrent_layers() == [layers[i].linear_attn for i in range(3)]
    assert ours.attention_layers() == [layers[3].self_attn.attn]
    assert ours.config.kv_cache_keys()[3] is None and len(set(ours.config.kv_cache_keys()[:3])) == 1


@torch.no_grad()
def test_moe_block_matches_hf(pair):
    """Softmax top-k routing, the experts and the shared expert scaled by sigmoid(shared_expert_gate)."""
    family, hf, ours = pair
    x = torch.randn(9, TINY["hidden_size"], generator=torch.Generator().manual_seed(4))
    for i in (0, 3):
        torch.testing.assert_close(ours.model.layers[i].mlp(x), hf.model.layers[i].mlp(x[None])[0],
                                   atol=1e-5, rtol=1e-5)
    if family == "qwen3_next":  # the dense layer
        torch.testing.assert_close(ours.model.layers[2].mlp(x), hf.model.layers[2].mlp(x[None])[0],
                                   atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_zero_centred_norms_match_hf(pair):
    family, hf, ours = pair
    x, r = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6)).unbind(0)
    layer, theirs = ours.model.layers[3], hf.model.layers[3]
    torch.testing.assert_close(layer.input_layernorm(x), theirs.input_layernorm(x), atol=0, rtol=0)
    out, res = layer.post_attention_layernorm(x, r)
    torch.testing.assert_close(out, theirs.post_attention_layernorm(x + r), atol=0, rtol=0)
    torch.testing.assert_close(res, x + r, atol=0, rtol=0)
    heads = x.view(5, 4, 16)
    torch.testing.assert_close(layer.self_attn.q_norm(heads), theirs.self_attn.q_norm(heads), atol=0, rtol=0)
    torch.testing.assert_close(ours.model.norm(x), hf.model.norm(x), atol=0, rtol=0)


@torch.no_grad()
def test_whole_model_matches_hf_over_two_steps(pair):
    """Embedding -> 3 Gated DeltaNet layers and a gated-attention layer (paged KV cache) -> norm ->
    logits, over the same two steps, against transformers' logits over each whole sequence."""
    family, hf, ours = pair
    bind_caches(ours)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in TOTAL]
    want = [hf(input_ids=i[None], use_cache=False).logits[0] for i in ids]
    for step, ids_T, want_T in zip((STEP1, STEP2), split_steps(ids), split_steps(want)):
        meta, positions = step_meta(**step)
        logits = ours.compute_logits(ours(ids_T, positions, meta))
        torch.testing.assert_close(logits, want_T, atol=1e-5, rtol=1e-5)


# ---- tensor parallelism ------------------------------------------------------------------------
@pytest.fixture
def parallel_state():
    saved = get_parallel_state()
    yield lambda **kw: set_parallel_state(ParallelState(**kw))
    set_parallel_state(saved)


@torch.no_grad()
def test_tp2_slices_sum_to_tp1(pair, parallel_state, tmp_path):
    """Each of 2 TP ranks loads its slices (whole key-head groups of the fused or separate
    projections, their conv channels and out_proj columns; attention heads; expert F slices); run
    without the all-reduce (built with tp_size 2, run with 1), the ranks' partial outputs sum to TP=1's."""
    family, hf, ours = pair
    path = save_checkpoint(hf, str(tmp_path / "ckpt"))
    ranks = []
    for r in range(2):
        parallel_state(tp_size=2, tp_rank=r)
        ranks.append(ours_from(path))
    parallel_state()  # the forward: no collective, partial sums stay per rank
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(STEP1["new"]), TINY["hidden_size"], generator=gen)
    meta, positions = step_meta(**STEP1)
    for model in [ours] + ranks:
        bind_caches(model)
    layer = ranks[0].model.layers[0].linear_attn
    assert (layer.num_k_heads, layer.num_v_heads, layer.conv_dim) == (1, 2, 2 * 16 + 2 * 8)
    want = ours.model.layers[0].linear_attn(x, meta)
    got = sum(m.model.layers[0].linear_attn(x, meta) for m in ranks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want = ours.model.layers[3].self_attn(positions, x, meta)
    got = sum(m.model.layers[3].self_attn(positions, x, meta) for m in ranks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # routed experts split along F, the shared expert's MLP along its F (its gate replicated)
    want = ours.model.layers[0].mlp(x)
    got = sum(m.model.layers[0].mlp(x) for m in ranks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tp_refuses_splitting_a_head(pair, parallel_state):
    family, _, ours = pair
    parallel_state(tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match="linear_num_key_heads=2 is not divisible by tensor_parallel_size=4"):
        Qwen3NextGatedDeltaNet(ours.config)


# ---- checkpoint layouts ------------------------------------------------------------------------
def _params(model) -> dict[str, torch.Tensor]:
    return {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()}


def test_fused_experts_load_the_same(pair, tmp_path):
    """transformers' in-memory 3-D experts.gate_up_proj / down_proj load to the per-expert weights."""
    family, hf, ours = pair
    fused = ours_from(save_checkpoint(hf, str(tmp_path / "fused"), layout="fused"))
    for name, value in _params(ours).items():
        torch.testing.assert_close(_params(fused)[name], value, atol=0, rtol=0, msg=name)


def test_multimodal_layout_loads_the_text_model(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint: text fields under text_config, tensors under
    model.language_model.*, a vision tower (model.visual.*) and MTP tensors, all but the text skipped."""
    hf = hf_model("qwen3_5")
    flat = save_checkpoint(hf, str(tmp_path / "flat"))
    nested = str(tmp_path / "nested")
    os.makedirs(nested)
    with open(os.path.join(flat, "config.json")) as f:
        text = json.load(f)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": False, "text_config": {k: v for k, v in text.items() if k != "architectures"},
           "vision_config": {"depth": 1, "hidden_size": 8}}
    with open(os.path.join(nested, "config.json"), "w") as f:
        json.dump(raw, f)
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(os.path.join(flat, "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    save_file(tensors, os.path.join(nested, "model.safetensors"), metadata={"format": "pt"})
    cfg = Qwen3NextConfig.from_hf(raw, "Qwen3_5MoeForConditionalGeneration")
    assert cfg.nested_checkpoint and not cfg.fused_linear_projections
    model = Qwen3NextForCausalLM(cfg).float()
    load_weights(model, nested, progress=False)
    assert any(k.startswith("model.language_model.layers.") for k in model.state_dict())
    for name, value in _params(ours_from(flat)).items():
        torch.testing.assert_close(_params(model)[name], value, atol=0, rtol=0, msg=name)


def test_other_familys_projections_are_unexpected(tmp_path):
    """A Qwen3.5 checkpoint's separate in_proj_* under Qwen3NextForCausalLM are reported by name."""
    path = save_checkpoint(hf_model("qwen3_5"), str(tmp_path / "ckpt"))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["architectures"] = ["Qwen3NextForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="linear_attn.in_proj_(qkv|z|b|a).weight"):
        ours_from(path)


# ---- config ------------------------------------------------------------------------------------
def hub_config(family: str = "qwen3_next", **overrides) -> dict:
    """A config.json as transformers saves it for the tiny model."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig as HFConfig

    arch, extra = FAMILIES[family]
    cls = HFConfig if family == "qwen3_next" else Qwen3_5MoeTextConfig
    raw = cls(**{**TINY, **extra}).to_dict()
    raw["architectures"] = [arch]
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None or k in overrides}


def test_config_reads_every_field():
    cfg = Qwen3NextConfig.from_hf(hub_config(), "Qwen3NextForCausalLM")
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 16, 8, 4)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (8, 2, 32, 48)
    assert cfg.layer_types == [LIN, LIN, LIN, FULL] and cfg.mlp_only_layers == [2] and cfg.norm_topk_prob
    assert cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 4 and cfg.fused_linear_projections
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    q35 = Qwen3NextConfig.from_hf(hub_config("qwen3_5", norm_topk_prob=False, mlp_only_layers=[1]),
                                  "Qwen3_5MoeForCausalLM")
    # transformers' Qwen3.5 ignores both: every layer MoE, always renormalised
    assert q35.norm_topk_prob and all(q35.is_moe_layer(i) for i in range(4)) and not q35.fused_linear_projections


def test_config_defaults_as_transformers():
    """No layer_types: every full_attention_interval-th layer full; partial_rotary_factor at the top
    level (the hub's Qwen3-Next config.json) or absent (0.25)."""
    raw = hub_config(num_hidden_layers=8, full_attention_interval=4, partial_rotary_factor=0.5)
    del raw["layer_types"], raw["rope_parameters"]
    cfg = Qwen3NextConfig.from_hf(raw, "Qwen3NextForCausalLM")
    assert cfg.layer_types == [LIN, LIN, LIN, FULL] * 2 and cfg.partial_rotary_factor == 0.5
    del raw["full_attention_interval"], raw["partial_rotary_factor"]
    raw["num_hidden_layers"] = 5
    cfg = Qwen3NextConfig.from_hf(raw, "Qwen3NextForCausalLM")
    assert cfg.layer_types == [LIN, LIN, LIN, FULL, LIN] and cfg.rotary_dim == 4
    from transformers import Qwen3NextConfig as HFConfig
    assert HFConfig(num_hidden_layers=5).layer_types == cfg.layer_types


@pytest.mark.parametrize("overrides,message", [
    (dict(layer_types=[LIN, "sliding_attention", LIN, FULL]), "unsupported layer type.*'sliding_attention'"),
    (dict(layer_types=[LIN, FULL]), "layer_types lists 2 layers, but num_hidden_layers=4"),
    (dict(linear_num_key_heads=None), "lacks the field 'linear_num_key_heads'"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim=0 must be a positive integer"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    (dict(shared_expert_intermediate_size=None), "lacks the field 'shared_expert_intermediate_size'"),
    (dict(head_dim=None), "lacks the field 'head_dim'"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor=0.1 gives 1 rotary dims"),
    (dict(intermediate_size=0), r"layers \[2\] are dense MLP layers"),
    (dict(attn_output_gate=False), "attn_output_gate=False"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_config_refusals(overrides, message):
    raw = hub_config(**overrides)
    for k, v in overrides.items():
        if v is None:
            raw.pop(k, None)
    with pytest.raises(ValueError, match=message):
        Qwen3NextConfig.from_hf(raw, "Qwen3NextForCausalLM")


def test_qwen35_needs_experts():
    with pytest.raises(ValueError, match="needs num_experts > 0"):
        Qwen3NextConfig.from_hf(hub_config("qwen3_5", num_experts=0), "Qwen3_5MoeForCausalLM")
