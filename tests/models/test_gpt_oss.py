"""gpt-oss token for token with Hugging Face transformers, through the whole engine: attention sinks,
an 8-token sliding window on alternate layers, YaRN, router and expert biases, the clamped SwiGLU;
transformers' layout (sharded too) and the hub's MXFP4 experts (against a dense twin of the same
values); chunked prefill; TP=2 and TP=2 + EP=2 on gloo; bad checkpoints named."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moe import LLM
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_gpt_oss import make_gpt_oss_checkpoint, make_gpt_oss_mxfp4_checkpoint

PROMPT_LENGTHS = [1, 5, 9, 17, 40]  # inside, at and well past the 8-token window; across 16-token blocks


def assert_matches_hf(model_dir: str, hf_dir: str | None = None, max_tokens: int = 10, **llm_kwargs) -> None:
    _, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(hf_dir or model_dir), prompts, outs, max_tokens)


@pytest.mark.parametrize("shards", [1, 2])
def test_transformers_layout_matches_hf(tmp_path, shards):
    assert_matches_hf(make_gpt_oss_checkpoint(str(tmp_path / "ckpt"), shards=shards, seed=shards))


def test_mxfp4_experts_match_hf_on_their_dequantised_twin(tmp_path):
    path, twin = make_gpt_oss_mxfp4_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "twin"), seed=3)
    assert_matches_hf(path, twin)


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}])
def test_mxfp4_experts_kept_packed_match_hf(tmp_path, monkeypatch, layout):
    """quantization="mxfp4": the experts stay packed (the expert layer dequantises per call here; the
    Triton kernel in its K loop on CUDA), also sliced for TP (F 64 -> 32 a rank: one scale column)."""
    for var, value in [("MOE_COLLECTIVE_TIMEOUT_S", "60"), ("MOE_STEP_TIMEOUT_S", "90"),
                       ("MOE_WORKER_START_TIMEOUT_S", "120")]:
        monkeypatch.setenv(var, value)
    path, twin = make_gpt_oss_mxfp4_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "twin"), seed=5)
    llm, prompts, outs = generate_greedy(path, PROMPT_LENGTHS, 8, quantization="mxfp4", **layout)
    if not layout:
        params = dict(llm.llm_engine.executor.model.named_parameters())
        assert params["model.layers.0.mlp.experts.w13_weight"].dtype == torch.uint8
        assert params["model.layers.0.mlp.experts.w2_weight_scale"].shape == (6, 64, 2)
    llm.llm_engine.shutdown()
    assert_outputs_match_hf(load_hf_model(twin), prompts, outs, 8)


def test_quantization_mxfp4_needs_an_mxfp4_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="quantization='mxfp4' needs an MXFP4 checkpoint"):
        LLM(make_gpt_oss_checkpoint(str(tmp_path / "ckpt")), device="cpu", quantization="mxfp4")


def test_chunked_prefill_and_small_blocks_match_hf(tmp_path):
    """Chunks of 4 tokens and blocks of 4: the window spans blocks and chunks start inside it."""
    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"), seed=4, layer_types=["full_attention",
                                                                                "sliding_attention",
                                                                                "sliding_attention"])
    assert_matches_hf(path, block_size=4, max_num_batched_tokens=8, max_num_seqs=3, max_tokens=12)


def test_sliding_layers_release_blocks_without_prefix_caching(tmp_path):
    """Prefix caching off: the sliding layers' own KV-cache group holds only the window's blocks and
    the tokens equal transformers'; on: the same two groups, both caching (tests/models/test_kv_cache_groups.py
    checks their hits)."""
    from moe import SamplingParams

    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"), seed=7)
    kwargs = dict(block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16)
    llm, prompts, outs = generate_greedy(path, PROMPT_LENGTHS, 24, **kwargs)
    assert_outputs_match_hf(load_hf_model(path), prompts, outs, 24)
    engine, kv = llm.llm_engine, llm.llm_engine.scheduler.kv
    full, window = kv.groups
    assert full.chunk_size is None and full.sliding_window is None and window.sliding_window == 8
    assert window.num_blocks < full.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    again, max_live = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            again[out.request_id] = out.outputs[0].token_ids
        for blocks in kv.local[0].req_to_blocks.values():
            max_live = max(max_live, sum(b is not None for b in blocks))
    assert [again[str(i)] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in outs]
    assert max_live <= 2 + 1 + 4 + 1  # the window, a partial block, one step's span of 16 tokens (+1 unaligned)
    assert kv.local[0].pool.num_free_blocks == kv.local[0].pool.num_blocks
    shared = LLM(path, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True)
    kv = shared.llm_engine.scheduler.kv
    assert [g.sliding_window for g in kv.groups] == [None, 8] and kv.enable_caching and kv.local[0].pool.enable_caching


def test_the_clamps_and_the_window_act_in_the_fixture(tmp_path):
    """The fixture exercises what it should: some expert gates exceed swiglu_limit, and outputs
    differ from the same model with a window longer than every prompt (the window acts)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"))
    model = load_hf_model(path)
    seen = []
    original = hf.GptOssExperts._apply_gate
    hf.GptOssExperts._apply_gate = lambda self, gu: (seen.append(gu.detach().abs().max()), original(self, gu))[1]
    try:
        ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            windowed = model(ids).logits
    finally:
        hf.GptOssExperts._apply_gate = original
    assert max(seen) > model.config.swiglu_limit
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    with torch.no_grad():
        full = model(ids).logits
    assert not torch.allclose(windowed[0, -1], full[0, -1], atol=1e-3)


def test_bad_configs_are_refused_by_name(tmp_path):
    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"))
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        good = json.load(f)
    for change, message in [({"layer_types": ["full_attention"]}, "layer_types must list 3"),
                            ({"layer_types": ["chunked_attention"] * 3}, "layer_types must list 3"),
                            ({"sliding_window": None}, "sliding_window=None must be a positive integer"),
                            ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8' is not supported")]:
        with open(config_file, "w") as f:
            json.dump({**good, **change}, f)
        with pytest.raises(ValueError, match=message):
            LLM(path, device="cpu")


def test_a_missing_or_mistyped_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_gpt_oss_mxfp4_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "twin"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    scales = tensors.pop("model.layers.2.mlp.experts.down_proj_scales")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.2\.mlp\.experts\.down_proj'"):
        LLM(path, device="cpu")
    tensors["model.layers.2.mlp.experts.down_proj_scales"] = scales.float()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj_scales.*dtype torch\.float32, but the model expects torch\.uint8"):
        LLM(path, device="cpu")


PARALLEL = {
    "tp2": dict(tensor_parallel_size=2),  # heads, sinks and expert F split; down's bias added once
    "tp2_ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),  # 3 experts a rank, with their biases
    "pp2": dict(pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16),  # the sliding layer, the full one
}


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_parallel_matches_hf(tmp_path, monkeypatch, layout):
    """Spawned gloo workers."""
    for var, value in [("MOE_COLLECTIVE_TIMEOUT_S", "60"), ("MOE_STEP_TIMEOUT_S", "90"),
                       ("MOE_WORKER_START_TIMEOUT_S", "120")]:
        monkeypatch.setenv(var, value)
    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"), seed=6, num_hidden_layers=2)
    llm, prompts, outs = generate_greedy(path, PROMPT_LENGTHS, 6, **PARALLEL[layout])
    llm.llm_engine.shutdown()
    assert_outputs_match_hf(load_hf_model(path), prompts, outs, 6)


# openai/gpt-oss-120b's config.json (the fields that matter; -20b has 24 layers and 32 experts)
HUB_CONFIG = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=128, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
    max_position_embeddings=131072, initial_context_length=4096, rms_norm_eps=1e-5, swiglu_limit=7.0,
    attention_bias=True, hidden_act="silu", tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999,
    torch_dtype="bfloat16", layer_types=["sliding_attention", "full_attention"] * 18,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}, rope_theta=150000,
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                             "model.layers.*.mlp.router",
                                                                             "model.embed_tokens", "lm_head"]},
)


def test_the_hub_config_parses():
    from models.gpt_oss import GptOssConfig

    cfg = GptOssConfig.from_hf(HUB_CONFIG, "GptOssForCausalLM")
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.head_dim, cfg.sliding_window) == (128, 4, 64, 128)
    assert cfg.mxfp4 and cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert cfg.rope.scaling_type == "yarn" and cfg.rope.factor == 32.0 and cfg.rope.theta == 150000
    assert cfg.rope.original_max_position_embeddings == 4096 and not cfg.rope.params["truncate"]


def test_a_model_of_only_sliding_layers_reads_through_the_full_group(tmp_path):
    path = make_gpt_oss_checkpoint(str(tmp_path / "ckpt"), seed=8, layer_types=["sliding_attention"] * 3)
    llm, prompts, outs = generate_greedy(path, PROMPT_LENGTHS, 8, enable_prefix_caching=False)
    assert len(llm.llm_engine.scheduler.kv.groups) == 1
    assert_outputs_match_hf(load_hf_model(path), prompts, outs, 8)
