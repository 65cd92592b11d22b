"""Tiny random DeepSeek-V3 checkpoints built with transformers (fp32), plain or FP8 block-quantised."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from kernels.attention import AttentionMetadata

from tests.factories import perturb_biases, perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors

DSV3_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
    topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    eos_token_id=0, bos_token_id=1,
)

# YaRN acting within a short prompt: original context 32, mscale != mscale_all_dim so both the
# cos/sin factor and the softmax-scale correction differ from 1.
YARN = dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1)

# Dimensions that are not multiples of the 128 x 128 FP8 blocks.
DSV3_FP8 = dict(
    DSV3_TINY, hidden_size=160, intermediate_size=200, moe_intermediate_size=72, num_hidden_layers=2,
    num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    kv_lora_rank=136, q_lora_rank=144, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
)


def is_fp8_weight(name: str) -> bool:
    """The tensors the DeepSeek-V3 hub stores in FP8: every projection (not the router gate,
    embeddings, lm_head or norms)."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct per-block e4m3 quantisation: (fp8 weight, fp32 scale_inv [ceil(o/b), ceil(i/b)])."""
    out, inp = w.shape
    nb_o, nb_i = -(-out // block), -(-inp // block)
    scale = torch.empty(nb_o, nb_i)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(nb_o):
        for j in range(nb_i):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def quantize_with_twin(tensors: dict[str, torch.Tensor], is_fp8=is_fp8_weight) -> dict[str, torch.Tensor]:
    """Quantise the weights of `tensors` that the hub stores in FP8 (`is_fp8` of their names) in place
    (e4m3 128x128 blocks, `*_scale_inv` beside each); returns the dequantised fp32 twin (what
    transformers loads to compare against)."""
    twin = dict(tensors)
    for name in [n for n in tensors if is_fp8(n)]:
        q, s = quantize_block(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q, s
        twin[name] = dequantize_block(q, s)
    return twin


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
    return out


def _mtp_tensors(cfg, tensors: dict) -> dict:
    """Fake multi-token-prediction layer tensors (layer index = num_hidden_layers), as the hub has."""
    n, D = cfg.num_hidden_layers, cfg.hidden_size
    return {f"model.layers.{n}.eh_proj.weight": torch.randn(D, 2 * D),
            f"model.layers.{n}.enorm.weight": torch.ones(D),
            f"model.layers.{n}.self_attn.o_proj.weight": torch.randn(D, cfg.num_attention_heads * cfg.v_head_dim),
            f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(cfg.moe_intermediate_size, D)}


def make_deepseek_v3_checkpoint(path: str, seed: int = 0, shards: int = 1, mtp: bool = False,
                                layout: str = "per_expert", fp8_twin_path: str | None = None,
                                with_tokenizer: bool = True, **overrides) -> str:
    """Save a random transformers DeepSeek-V3 to `path` (fp32, hub per-expert layout).

    RMSNorm weights are perturbed from 1 and every router gets a non-zero correction bias.
    layout: "per_expert" (hub names experts.{e}.gate_proj...) or "fused" (transformers' in-memory
    3-D experts.gate_up_proj [E, 2F, D] / experts.down_proj [E, D, F]).
    mtp: add fake layer-`num_hidden_layers` tensors (must be ignored on load).
    fp8_twin_path: instead save at `path` an FP8 e4m3 128x128 block-quantised checkpoint
    (`*.weight_scale_inv` beside each projection weight, `quantization_config` in config.json),
    and at `fp8_twin_path` its dequantised fp32 twin (loadable by transformers).
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**DSV3_TINY, **overrides})
    model = DeepseekV3ForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    perturb_biases(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("e_score_correction_bias") for k in tensors)
    if fp8_twin_path is not None:
        twin = quantize_with_twin(tensors)
        os.makedirs(fp8_twin_path, exist_ok=True)
        for f in os.listdir(path):
            if f.endswith(".json"):
                with open(os.path.join(path, f)) as src, open(os.path.join(fp8_twin_path, f), "w") as dst:
                    dst.write(src.read())
        write_safetensors(fp8_twin_path, twin)
        if with_tokenizer:
            save_tokenizer(fp8_twin_path, config.vocab_size)
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            raw = json.load(f)
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        with open(cfg_path, "w") as f:
            json.dump(raw, f, indent=2)
    if mtp:
        tensors.update(_mtp_tensors(config, tensors))
    write_safetensors(path, tensors, shards)
    if with_tokenizer:
        save_tokenizer(path, config.vocab_size)
    return path


def mla_step_metadata(new_tokens: list[int], cached: list[int], block_size: int, num_blocks: int,
                      device="cpu", pad_to: int | None = None):
    """(AttentionMetadata, positions) as the model runner builds them for one MLA step (each
    sequence with its own scattered blocks), with the device-side fields; pad_to: pad a decode-only batch with rows of
    seq_len 0 and slot -1, as a CUDA-graph step does."""
    B = len(new_tokens)
    seq_lens = [c + n for c, n in zip(cached, new_tokens)]
    per = max(-(-L // block_size) for L in seq_lens)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5))[:B * per]
    tables = perm.view(B, per)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).tolist()
    positions, slots = [], []
    for b in range(B):
        for p in range(cached[b], seq_lens[b]):
            positions.append(p)
            slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
    decode = [b for b in range(B) if new_tokens[b] == 1]
    decode_only = len(decode) == B
    if pad_to is not None:
        assert decode_only
        extra = pad_to - B
        tables = torch.cat((tables, torch.zeros(extra, per, dtype=tables.dtype)))
        seq_lens, slots, positions = seq_lens + [0] * extra, slots + [-1] * extra, positions + [0] * extra
        qsl = list(range(pad_to + 1))
    meta = AttentionMetadata(qsl, seq_lens, tables.to(device), torch.tensor(slots, device=device), decode,
                             [b for b in range(B) if new_tokens[b] != 1])
    if decode:
        nblk = -(-max(seq_lens[b] for b in decode) // block_size)
        meta.decode_token_idx = torch.tensor([qsl[b] for b in decode], device=device)
        meta.decode_seq_lens = torch.tensor([seq_lens[b] for b in decode], device=device)
        meta.decode_block_tables = tables[decode, :nblk].contiguous().to(device)
    meta.query_start_loc_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    meta.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    meta.max_query_len = max(new_tokens)
    meta.decode_only = decode_only
    return meta, torch.tensor(positions, device=device)
