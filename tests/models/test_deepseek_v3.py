"""DeepSeek-V3 token for token with Hugging Face transformers, through the whole engine; FP8
block-quantised checkpoints against their dequantised twins; config parsing."""
from __future__ import annotations


import pytest
import torch

from models.deepseek_v3 import DeepseekV3Config
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_deepseek import DSV3_FP8, YARN, make_deepseek_v3_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 33, 64]


def _generate(model_dir: str, max_tokens: int, **llm_kwargs):
    return generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)


def assert_matches_hf(model_dir: str, hf_dir: str | None = None, max_tokens: int = 10, **llm_kwargs):
    """`hf_dir`: the checkpoint transformers loads (default: the same)."""
    llm, prompts, outs = _generate(model_dir, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(hf_dir or model_dir), prompts, outs, max_tokens)
    return llm, outs


YARN_VARIANT = dict(rope_scaling=YARN, max_position_embeddings=128)


@pytest.fixture(scope="module")
def yarn_lora_ckpt(tmp_path_factory):
    """q LoRA, YaRN with mscale != mscale_all_dim, 4 groups keep 2, one dense layer, a shared expert."""
    return make_deepseek_v3_checkpoint(str(tmp_path_factory.mktemp("dsv3") / "yarn"), seed=0, **YARN_VARIANT)


def test_yarn_q_lora_matches_hf(yarn_lora_ckpt):
    assert_matches_hf(yarn_lora_ckpt)


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_all_absorbed_or_all_expanded_match_hf(yarn_lora_ckpt, mode, monkeypatch):
    """Default: prefill expanded, decode absorbed. Either form alone gives the same model."""
    from models.deepseek_v3 import DeepseekV3ForCausalLM

    monkeypatch.setattr(DeepseekV3ForCausalLM.__init__, "__defaults__", (mode, None))  # attn_mode, moe_parallel
    llm, _ = assert_matches_hf(yarn_lora_ckpt, max_tokens=4)
    assert {layer.self_attn.mode for layer in llm.llm_engine.executor.model.model.layers} == {mode}


def test_small_blocks_and_budget_match_hf(yarn_lora_ckpt):
    """Chunked prefill over steps and many 4-token blocks read the same latent context."""
    assert_matches_hf(yarn_lora_ckpt, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_no_q_lora_plain_rope_mtp_shards_match_hf(tmp_path, layout):
    """q_proj instead of the LoRA path, unscaled RoPE, no renormalisation, 2 of 8 groups,
    attention biases, extra multi-token-prediction layer tensors (ignored), three shards, hub
    per-expert or transformers' fused expert tensors."""
    path = make_deepseek_v3_checkpoint(str(tmp_path / "ckpt"), seed=1, shards=3, mtp=True, q_lora_rank=None,
                                       layout=layout,
                                       norm_topk_prob=False, n_routed_experts=16, n_group=8, topk_group=2,
                                       num_experts_per_tok=3, routed_scaling_factor=1.5, attention_bias=True)
    assert_matches_hf(path)


def test_fp8_block_checkpoint_matches_dequantised_twin(tmp_path):
    """FP8 e4m3 weights + 128x128 block scales (dims 160, 136, 144, 200, 72: partial edge blocks)
    load to exactly the dequantised twin's weights, and generate what transformers does with it."""
    fp8_dir, twin_dir = str(tmp_path / "fp8"), str(tmp_path / "twin")
    make_deepseek_v3_checkpoint(fp8_dir, seed=2, fp8_twin_path=twin_dir, mtp=True,
                                **{**DSV3_FP8, **YARN_VARIANT})
    llm, outs = assert_matches_hf(fp8_dir, hf_dir=twin_dir, max_tokens=6, block_size=8)
    twin_llm, twin_prompts, twin_outs = _generate(twin_dir, 6, block_size=8)
    ours = dict(llm.llm_engine.executor.model.named_parameters())
    theirs = dict(twin_llm.llm_engine.executor.model.named_parameters())
    scales = [n for n in ours if n.endswith("_scale_inv")]
    assert scales and set(ours) - set(scales) == set(theirs)
    assert any("experts.w13_weight_scale_inv" in n for n in scales)
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name
    for a, b in zip(outs, twin_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_config_parsing():
    base = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=100, hidden_size=64,
                intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=128, head_dim=8, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
                num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                first_k_dense_replace=2, moe_layer_freq=1, scoring_func="sigmoid", rope_theta=5000.0)
    old = dict(base, rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                                       beta_slow=1, original_max_position_embeddings=4096),
               quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]))
    new = dict(base, rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=40, mscale=1.0,
                                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                                          original_max_position_embeddings=4096))
    a = DeepseekV3Config.from_hf(old, "DeepseekV3ForCausalLM")
    b = DeepseekV3Config.from_hf(new, "DeepseekV3ForCausalLM")
    for c in (a, b):
        assert c.head_dim == 24 and c.num_key_value_heads == 4 and c.q_lora_rank is None
        assert c.rope.scaling_type == "yarn" and c.rope.factor == 40 and c.rope.theta == 5000.0
        assert c.rope.params["mscale_all_dim"] == 1.0 and c.rope.original_max_position_embeddings == 4096
        assert (c.n_group, c.topk_group, c.n_shared_experts, c.routed_scaling_factor) == (2, 1, 2, 2.5)
        assert [c.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert a.fp8 is not None and a.fp8.block == (128, 128) and b.fp8 is None
    with pytest.raises(ValueError, match="scoring_func"):
        DeepseekV3Config.from_hf(dict(base, scoring_func="tanh"), "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="weight_block_size"):
        DeepseekV3Config.from_hf(dict(base, quantization_config=dict(quant_method="fp8")), "DeepseekV3ForCausalLM")
