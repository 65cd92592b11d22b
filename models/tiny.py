"""The built-in tiny checkpoint `tiny-qwen3-moe`: a real Hugging Face-format folder (config.json,
model.safetensors, tokenizer.json) with seeded random weights, made on first use.

Its shape is the CPU benchmark model of BENCHMARKS.md §6: hidden 256, 4 layers, 8 heads (4 KV,
head_dim 32), 16 experts top-4, moe_intermediate 128, vocabulary 512. Its tokenizer has ChatML's
special tokens and tokenizer_config.json a ChatML chat template, so that `LLM.chat` and
/v1/chat/completions work on it; generation_config.json lists both <|endoftext|> and <|im_end|>
as end-of-sequence tokens (as Qwen's chat checkpoints do), so that a chat reply ends at its
<|im_end|>.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from models.loader import checkpoint_name_for
from models.registry import resolve_architecture

logger = logging.getLogger("moe.tiny")

TINY_MODELS = ("tiny-qwen3-moe",)

TINY_QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}

_CORPUS = """\
Mixture-of-experts models route every token to a few experts out of many. The router scores
each expert, keeps the top ones, and the token's output is the weighted sum of what they return.
Hello, world! Hello there. How are you today? The quick brown fox jumps over the lazy dog.
Inference engines batch requests continuously: new requests join, finished ones leave, and the
key-value cache lives in fixed-size blocks so that memory is not wasted on padding.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: ; : , . ! ? ( ) [ ] { } " ' - _ / \\ @ # $ % &
Unicode: café, naïve, 東京, 日本語, こんにちは, привет, 😀 🚀.
"""


# ChatML, as Qwen's checkpoints write it: <|im_start|>role\ncontent<|im_end|>\n per message, then the
# assistant's opener when add_generation_prompt.
# The last two ids of the vocabulary: the trained ids below them stay those of the tokenizer before
# (only its last two merges gave way), so the built-in model reads text as it did.
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


def cache_dir() -> str:
    return os.environ.get("MOE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "moe-runtime"))


def build_tokenizer(vocab_size: int, extra_special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on a small built-in corpus (no download needed):
    <|endoftext|> is id 0, extra_special_tokens the last ids of the vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(extra_special_tokens), special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(list(extra_special_tokens))
    return tok


def random_checkpoint_tensors(model_cls, config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors for every piece of every parameter of `model_cls(config)`,
    drawn from a seeded generator (norm weights near 1, the rest N(0, 0.05²))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(config)
    rules = model.weight_name_rules()
    tensors = {}
    for pname, param in model.named_parameters():
        for shard, expert in param.param_loader.pieces():
            name = checkpoint_name_for(pname, shard, expert, rules)
            shape = param.param_loader.ckpt_shape(shard, expert)
            if "norm" in pname:
                tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                tensors[name] = 0.05 * torch.randn(shape, generator=gen)
    return tensors


def ensure_tiny_model(name: str) -> str:
    """The folder of built-in model `name`, created on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(TINY_MODELS)}")
    path = os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        if not _has_chat_files(path):  # made by an earlier version: give it the chat tokenizer and EOS ids
            logger.info("Adding a chat template and <|im_end|> as EOS to the built-in model %s in %s", name, path)
            _write_tokenizer_files(path)
        return path
    logger.info("Creating the built-in model %s in %s", name, path)
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=f".{name}-")
    cfg = dict(TINY_QWEN3_MOE_CONFIG)
    model_cls = resolve_architecture(cfg)
    typed = model_cls.config_class.from_hf(cfg, cfg["architectures"][0])
    save_file(random_checkpoint_tensors(model_cls, typed), os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _write_tokenizer_files(tmp)
    try:
        os.replace(tmp, path)  # atomic: a concurrent first use sees a whole folder or none
    except OSError:  # another process created it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _has_chat_files(folder: str) -> bool:
    """Whether the folder has the chat template and <|im_end|> among the EOS ids (earlier versions
    wrote neither: eos_token_id 0 alone)."""
    eos = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    im_end = TINY_QWEN3_MOE_CONFIG["vocab_size"] - len(CHATML_TOKENS) + CHATML_TOKENS.index("<|im_end|>")
    return ("chat_template" in _read_json(os.path.join(folder, "tokenizer_config.json"))
            and isinstance(eos, list) and im_end in eos)


def _write_tokenizer_files(folder: str) -> None:
    """tokenizer.json (with ChatML's special tokens), tokenizer_config.json (the chat template), then
    generation_config.json (EOS: <|endoftext|> and <|im_end|>), each replaced atomically: a reader
    sees the old file or the new one, never a partial one."""
    tokenizer = build_tokenizer(TINY_QWEN3_MOE_CONFIG["vocab_size"], CHATML_TOKENS)
    config = {"eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    eos_ids = [TINY_QWEN3_MOE_CONFIG["eos_token_id"], tokenizer.token_to_id("<|im_end|>")]
    files = [("tokenizer.json", tokenizer.to_str()),
             ("tokenizer_config.json", json.dumps(config, indent=2)),
             ("generation_config.json", json.dumps({"eos_token_id": eos_ids}, indent=2))]
    for name, text in files:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
