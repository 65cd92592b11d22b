"""MiniMax-M2 token for token with Hugging Face transformers, through the whole engine: hub and fused
layouts, chunked prefill, FP8 block checkpoints against their dequantised twins, tensor, expert and
pipeline parallelism (spawned gloo workers), config parsing and bad checkpoints."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.minimax_m2 import MiniMaxM2Config
from moe import LLM
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_minimax_m2 import HUB_FIELDS, HUB_QUANTIZATION, make_minimax_m2_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 33, 64]
ARCH = "MiniMaxM2ForCausalLM"


def assert_matches_hf(model_dir: str, hf_dir: str | None = None, max_tokens: int = 10, **llm_kwargs):
    """`hf_dir`: the checkpoint transformers loads (default: the same)."""
    llm, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(hf_dir or model_dir), prompts, outs, max_tokens)
    return llm


@pytest.fixture(scope="module")
def hub_ckpt(tmp_path_factory):
    """Hub names and config.json style (legacy rotary_dim), fake MTP tensors, two shards."""
    return make_minimax_m2_checkpoint(str(tmp_path_factory.mktemp("minimax_m2") / "hub"), seed=0, shards=2,
                                      mtp=True, hub_config=True)


def test_hub_checkpoint_matches_hf(hub_ckpt):
    assert_matches_hf(hub_ckpt)


def test_fused_layout_variant_matches_hf(tmp_path):
    """transformers' in-memory names; one KV head, full RoPE, tied embeddings, top-3."""
    path = make_minimax_m2_checkpoint(str(tmp_path / "ckpt"), seed=1, layout="fused", num_hidden_layers=2,
                                      num_key_value_heads=1, rotary_dim=16, tie_word_embeddings=True,
                                      num_experts_per_tok=3)
    assert_matches_hf(path)


def test_small_blocks_and_budget_match_hf(hub_ckpt):
    """Chunked prefill across steps and many 4-token blocks read the same context."""
    assert_matches_hf(hub_ckpt, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_block_checkpoint_matches_dequantised_twin(tmp_path, quantization):
    """The hub's FP8 config (fmt float8_e4m3fn, gate / bias / lm_head not converted): projections and
    experts dequantised at load (None on the CPU), or the experts kept FP8 ("fp8"); the expert
    width 128 keeps whole scale blocks. Generates what transformers does with the dequantised twin."""
    fp8_dir, twin_dir = str(tmp_path / "fp8"), str(tmp_path / "twin")
    make_minimax_m2_checkpoint(fp8_dir, seed=2, fp8_twin_path=twin_dir, mtp=True, hub_config=True,
                               num_hidden_layers=2, intermediate_size=128)
    llm = assert_matches_hf(fp8_dir, hf_dir=twin_dir, max_tokens=6, quantization=quantization)
    params = dict(llm.llm_engine.executor.model.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in params
    kept = params["model.layers.0.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    assert kept == (quantization == "fp8")


PARALLEL = {
    "tp2": (dict(tensor_parallel_size=2), 1),  # experts split along F; the one KV head on both ranks
    "tp2_ep2": (dict(tensor_parallel_size=2, enable_expert_parallel=True), 2),  # 4 experts a rank
    "pp2": (dict(pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16), 2),  # a layer a stage
}


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_parallel_matches_hf(tmp_path, monkeypatch, layout):
    """Spawned gloo workers. Under TP the q/k norm's mean spans the heads of both ranks (one
    all-reduce of the partial sums)."""
    for var, value in [("MOE_COLLECTIVE_TIMEOUT_S", "60"), ("MOE_STEP_TIMEOUT_S", "90"),
                       ("MOE_WORKER_START_TIMEOUT_S", "120")]:
        monkeypatch.setenv(var, value)
    llm_kwargs, kv_heads = PARALLEL[layout]
    path = make_minimax_m2_checkpoint(str(tmp_path / "ckpt"), seed=3, num_hidden_layers=2, num_key_value_heads=kv_heads)
    llm, prompts, outs = generate_greedy(path, PROMPT_LENGTHS, 6, **llm_kwargs)
    llm.llm_engine.shutdown()
    assert_outputs_match_hf(load_hf_model(path), prompts, outs, 6)


HUB_CONFIG = dict(HUB_FIELDS, architectures=[ARCH], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
                  intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
                  head_dim=128, num_local_experts=256, num_experts_per_tok=8, rope_theta=5000000, rotary_dim=64,
                  max_position_embeddings=196608, rms_norm_eps=1e-6, attn_type_list=[1] * 62,
                  quantization_config=HUB_QUANTIZATION, eos_token_id=200020, bos_token_id=200034)


def test_config_parsing():
    c = MiniMaxM2Config.from_hf(HUB_CONFIG, ARCH)
    assert (c.num_local_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 1536)
    assert (c.head_dim, c.rotary_dim, c.rope.theta, c.num_key_value_heads) == (128, 64, 5e6, 8)
    assert c.fp8 is not None and c.fp8.block == (128, 128) and c.fp8.skips("model.layers.0.mlp.gate")
    # transformers' precedence: rope_parameters' partial_rotary_factor over the legacy rotary_dim
    saved = dict(HUB_CONFIG, rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25))
    assert MiniMaxM2Config.from_hf(saved, ARCH).rotary_dim == 32
    no_partial = {k: v for k, v in HUB_CONFIG.items() if k != "rotary_dim"}
    assert MiniMaxM2Config.from_hf(no_partial, ARCH).rotary_dim == 128


@pytest.mark.parametrize("changes,match", [
    (dict(qk_norm_type="per_head"), "qk_norm_type='per_head' is not supported"),
    (dict(use_qk_norm=False), "use_qk_norm=False is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(use_routing_bias=False), "use_routing_bias=False is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(routed_scaling_factor=2.0), "routed_scaling_factor=2.0 is not supported"),
    (dict(shared_intermediate_size=1536), "shared expert"),
    (dict(attn_type_list=[0] + [1] * 61), "linear \\(lightning\\) attention"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope type 'yarn'"),
    (dict(rotary_dim=63), "must be even"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok=300 must be between 1 and num_local_experts=256"),
    (dict(quantization_config=dict(HUB_QUANTIZATION, fmt="e5m2")), "FP8 format 'e5m2'"),
])
def test_unsupported_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        MiniMaxM2Config.from_hf(dict(HUB_CONFIG, **changes), ARCH)


def _edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.block_sparse_moe.e_score_correction_bias"),
     "missing tensor\\(s\\) 'model.layers.1.block_sparse_moe.e_score_correction_bias'"),
    # a per-head q norm (Qwen3's) where the whole projection's is expected
    (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
     "'model.layers.0.self_attn.q_norm.weight' .* has shape \\[16\\], but the model expects \\[64\\]"),
], ids=["missing_bias", "per_head_q_norm"])
def test_bad_checkpoint_is_a_clear_error(tmp_path, edit, match):
    path = make_minimax_m2_checkpoint(str(tmp_path / "ckpt"), seed=4, num_hidden_layers=2)
    _edit_tensors(path, edit)
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", dtype="float32", max_model_len=32)
