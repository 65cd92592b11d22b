"""Factories for tests: tiny random checkpoints built with Hugging Face transformers."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

QWEN3_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=0,
)


def perturb_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """RMSNorm weights away from 1, so a norm applied wrongly (or not at all) shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def perturb_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Linear biases and routers' correction biases away from 0 (transformers zeroes them), so a
    dropped one shows."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def take_saved_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors save_pretrained wrote to `path` (the hub's names), its safetensors files and index
    removed, so that the caller writes the layout it wants (write_safetensors)."""
    tensors = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    return tensors


def save_tokenizer(path: str, vocab_size: int) -> None:
    from models.tiny import build_tokenizer

    build_tokenizer(vocab_size).save(os.path.join(path, "tokenizer.json"))


def make_qwen3_moe_checkpoint(path: str, layout: str = "per_expert", shards: int = 1, seed: int = 0,
                              with_tokenizer: bool = True, **overrides) -> str:
    """Save a random transformers Qwen3-MoE to `path`.

    layout: "per_expert" (hub names experts.{e}.gate_proj...) or "fused" (3-D experts.gate_up_proj
    [E, 2F, D] and experts.down_proj [E, D, F], as transformers holds them in memory).
    shards > 1 splits the tensors over several files with a model.safetensors.index.json.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**QWEN3_TINY, **overrides})
    model = Qwen3MoeForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)  # writes config.json and the per-expert hub layout
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    write_safetensors(path, tensors, shards)
    if with_tokenizer:
        save_tokenizer(path, config.vocab_size)
    return path


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def load_hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_teacher_forced_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits [len(output_ids), V] at each position that predicted
    an output token, with the prompt and our outputs fed in (teacher forcing)."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    n = len(prompt_ids)
    return logits[n - 1:n - 1 + len(output_ids)].log_softmax(-1)


def generate_greedy(model_dir: str, prompt_lengths: list[int], max_tokens: int, seed: int = 1, **llm_kwargs):
    """Batched greedy generate with logprobs=1 on random prompts of the given lengths (fp32,
    CPU). Returns (llm, prompts, outputs)."""
    import random

    from moe import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", **llm_kwargs)
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in prompt_lengths]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    return llm, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_outputs_match_hf(hf_model, prompts: list[list[int]], outs, max_tokens: int) -> None:
    """At every step our token is transformers' argmax under teacher forcing (so transformers'
    greedy run is the same) and our logprob of it matches transformers' within 1e-4."""
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert len(comp.token_ids) == max_tokens and comp.finish_reason == "length"
        ref = hf_teacher_forced_logprobs(hf_model, prompt, comp.token_ids)
        assert comp.token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens"
        ours = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)])
        theirs = ref.gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert all(comp.logprobs[i][t].rank == 1 for i, t in enumerate(comp.token_ids))
