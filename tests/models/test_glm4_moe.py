"""GLM-4.5 MoE token for token with Hugging Face transformers, through the whole engine (fp32, CPU):
q/k norm on and off, partial RoPE, grouped sigmoid routing with a correction bias, a shared expert,
a dense first layer, multi-token-prediction tensors in the checkpoint (ignored: the loader would
reject them as unexpected), chunked prefill, FP8 block checkpoints, TP=2 and TP=2 x EP=2 over gloo,
damaged checkpoints and config parsing."""
from __future__ import annotations

import multiprocessing
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.glm4_moe import Glm4MoeConfig
from moe import LLM
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_glm4_moe import GLM4_MOE_TINY, make_glm4_moe_checkpoint

# Spawned gloo workers inherit these: a bug fails instead of hanging (as tests/parallel/conftest.py).
os.environ.setdefault("MOE_COLLECTIVE_TIMEOUT_S", "60")
os.environ.setdefault("MOE_STEP_TIMEOUT_S", "90")
os.environ.setdefault("MOE_WORKER_START_TIMEOUT_S", "120")

PROMPT_LENGTHS = [1, 5, 17, 33, 64]  # around and across the 16-token block size

# No q/k norm or qkv bias, a quarter of each head rotating, one group (no group limit), no
# renormalisation, two shared experts, tied embeddings, transformers' fused 3-D expert tensors.
PLAIN = dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25, n_group=1, topk_group=1,
             norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.5, tie_word_embeddings=True)


def assert_matches_hf(model_dir: str, hf_dir: str | None = None, max_tokens: int = 10, **llm_kwargs):
    """`hf_dir`: the checkpoint transformers loads (default: the same)."""
    llm, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(hf_dir or model_dir), prompts, outs, max_tokens)
    return llm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """q/k norm, qkv biases, 2 groups keep 1, MTP tensors, two shards."""
    return make_glm4_moe_checkpoint(str(tmp_path_factory.mktemp("glm4_moe") / "ckpt"), seed=0, shards=2)


def test_matches_hf(ckpt):
    assert_matches_hf(ckpt)


def test_plain_variant_fused_experts_matches_hf(tmp_path):
    path = make_glm4_moe_checkpoint(str(tmp_path / "plain"), seed=1, layout="fused", **PLAIN)
    assert_matches_hf(path)


def test_small_blocks_and_budget_match_hf(ckpt):
    """Chunked prefill over steps and many 4-token blocks read the same context."""
    assert_matches_hf(ckpt, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep2"])
def test_parallel_layouts_match_hf(ckpt, layout):
    """Heads, dense and shared MLPs split over 2 ranks (spawned gloo workers); the routed experts
    TP-sliced along F, or 4 whole experts a rank with the tokens dispatched."""
    llm, prompts, outs = generate_greedy(ckpt, PROMPT_LENGTHS, 6, **layout)
    try:
        assert len(llm.llm_engine.executor.worker_pids) == 2
        assert_outputs_match_hf(load_hf_model(ckpt), prompts, outs, 6)
    finally:
        llm.llm_engine.shutdown()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moe-worker")]


def test_fp8_block_checkpoint_matches_dequantised_twin(tmp_path):
    """FP8 e4m3 projections + 128x128 block scales (partial edge blocks: D = 64) load to exactly the
    dequantised twin's weights and generate what transformers does with the twin; routed experts
    kept FP8 (quantization="fp8", dequantised per call on the CPU) give the same tokens too."""
    fp8_dir, twin_dir = str(tmp_path / "fp8"), str(tmp_path / "twin")
    make_glm4_moe_checkpoint(fp8_dir, seed=2, fp8_twin_path=twin_dir, moe_intermediate_size=128)
    llm = assert_matches_hf(fp8_dir, hf_dir=twin_dir, max_tokens=6)
    twin_llm, _, twin_outs = generate_greedy(twin_dir, PROMPT_LENGTHS, 6)
    ours = dict(llm.llm_engine.executor.model.named_parameters())
    theirs = dict(twin_llm.llm_engine.executor.model.named_parameters())
    scales = [n for n in ours if n.endswith("_scale_inv")]
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in scales
    assert "model.layers.1.mlp.experts.w13_weight_scale_inv" in scales
    assert not any(".gate." in n or "norm" in n or "embed" in n or "lm_head" in n for n in scales)
    assert set(ours) - set(scales) == set(theirs)
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name
    kept, _, kept_outs = generate_greedy(fp8_dir, PROMPT_LENGTHS, 6, quantization="fp8")
    experts = kept.llm_engine.executor.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in kept_outs] == [o.outputs[0].token_ids for o in twin_outs]


# ---- damaged checkpoints ------------------------------------------------------------------------

@pytest.fixture
def one_file_ckpt(tmp_path, ckpt):
    """A copy of the module's checkpoint in one safetensors file, for editing."""
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    tensors = {}
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(dst, f)))
            os.remove(os.path.join(dst, f))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _load(path: str):
    return LLM(path, device="cpu", dtype="float32", max_model_len=32)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate.e_score_correction_bias",
                                  "model.layers.2.self_attn.k_proj.bias",
                                  "model.layers.1.self_attn.q_norm.weight",
                                  "model.layers.2.mlp.shared_experts.up_proj.weight"])
def test_missing_tensor_raises_naming_it(one_file_ckpt, name):
    _edit_tensors(one_file_ckpt, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensor\(s\) '{name}'"):
        _load(one_file_ckpt)


@pytest.mark.parametrize("name,shape", [("model.layers.1.mlp.gate.e_score_correction_bias", (7,)),
                                        ("model.layers.0.self_attn.q_norm.weight", (16,)),
                                        ("model.layers.1.mlp.experts.3.up_proj.weight", (32, 48))])
def test_wrong_shape_raises_naming_it(one_file_ckpt, name, shape):
    def reshape(t):
        t[name] = torch.zeros(shape)
    _edit_tensors(one_file_ckpt, reshape)
    want = r"\[" + ", ".join(map(str, shape)) + r"\]"
    with pytest.raises(ValueError, match=rf"tensor '{name}'.*has shape {want}, but the model expects"):
        _load(one_file_ckpt)


# ---- config parsing -----------------------------------------------------------------------------

HUB = dict(GLM4_MOE_TINY, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=4,
           first_k_dense_replace=2, num_nextn_predict_layers=1, rope_scaling=None)


def _parse(**changes) -> Glm4MoeConfig:
    return Glm4MoeConfig.from_hf({**HUB, **changes}, "Glm4MoeForCausalLM")


def test_config_parsing():
    hub = _parse()  # the hub's config.json: partial_rotary_factor and rope_theta at the top level
    saved = _parse(partial_rotary_factor=None, rope_theta=None,  # as transformers 5 saves it
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    for c in (hub, saved):
        assert (c.head_dim, c.rotary_dim, c.rope.theta, c.rope.scaling_type) == (32, 16, 10000.0, "default")
        assert (c.n_routed_experts, c.n_group, c.topk_group, c.n_shared_experts) == (8, 2, 1, 1)
        assert c.use_qk_norm and c.attention_bias and c.norm_topk_prob and c.routed_scaling_factor == 2.5
        assert [c.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
        assert c.fp8 is None
    # Absent fields take transformers' defaults: half the head rotates, one dense layer, one shared expert.
    bare = {k: v for k, v in HUB.items() if k not in ("partial_rotary_factor", "first_k_dense_replace",
                                                      "n_shared_experts", "use_qk_norm", "norm_topk_prob")}
    c = Glm4MoeConfig.from_hf(bare, "Glm4MoeForCausalLM")
    assert (c.rotary_dim, c.first_k_dense_replace, c.n_shared_experts, c.use_qk_norm, c.norm_topk_prob) == \
        (16, 1, 1, False, True)
    assert _parse(partial_rotary_factor=1.0).rotary_dim == 32
    fp8 = _parse(quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128])).fp8
    assert fp8 is not None and fp8.block == (128, 128)


@pytest.mark.parametrize("changes,match", [
    (dict(partial_rotary_factor=0.3), "partial_rotary_factor=0.3 gives 9 rotary dims"),
    (dict(n_group=3), "n_group=3 does not divide n_routed_experts=8"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts of the topk_group=1 groups"),
    (dict(quantization_config=dict(quant_method="fp8")), "weight_block_size"),
])
def test_bad_config_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        _parse(**changes)
