"""The skeleton every family shares: a pre-norm decoder layer and the pipeline-aware stack
(embedding on the first stage, this stage's layers, final norm on the last; models/parallel/pipeline.py).

The residual travels beside the hidden states so that each add fuses into the next RMSNorm.
"""
from __future__ import annotations

import os
from typing import Callable

from torch import nn

from kernels.triton_fused.moe_sum import TopKSum
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.norm import RMSNorm
from models.parallel.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    first_stage,
    last_stage,
    make_empty_intermediate_tensors_factory,
    make_layers,
    skip_other_stage_tensor,
)

# MOE_DEFER_TOPK_SUM=0: every MoE layer sums its top-k outputs itself (A/B runs).
DEFER_TOPK_SUM = os.environ.get("MOE_DEFER_TOPK_SUM", "1") != "0"


class PreNormDecoderLayer(nn.Module):
    """x -> x + self_attn(norm(x)) -> x + feed-forward(norm(x)).

    Subclasses set `self_attn`, `input_layernorm`, `post_attention_layernorm` and the
    feed-forward under its checkpoint name, which `ffn_name` gives ("mlp" unless overridden).
    """

    ffn_name = "mlp"

    def defer_ffn_sum(self) -> None:
        """Let an MoE feed-forward return its top-k outputs unsummed (a TopKSum): what follows it
        is the next layer's input norm or the stack's final norm, both with the residual add,
        which then sum them in their own launch."""
        ffn = getattr(self, self.ffn_name, None)
        if hasattr(ffn, "defer_topk_sum"):
            ffn.defer_topk_sum = True

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.ffn_name)(x), residual


class DecoderStack(nn.Module):
    """embed_tokens -> layers -> norm, holding only this pipeline stage's part."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, rms_norm_eps: float,
                 make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size) if first_stage() else PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(num_layers, make_layer)
        if DEFER_TOPK_SUM:
            for layer in self.stage_layers():
                if isinstance(layer, PreNormDecoderLayer):
                    layer.defer_ffn_sum()
        self.norm = RMSNorm(hidden_size, rms_norm_eps) if last_stage() else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], hidden_size)

    def stage_layers(self) -> list[nn.Module]:
        return list(self.layers[self.start_layer:self.end_layer])

    def forward(self, input_ids, positions, meta, intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds=None):
        """Final hidden states [T, D] on the last stage, else IntermediateTensors for the next.
        inputs_embeds [T, D]: the first stage's input instead of the ids' embeddings (images)."""
        if intermediate_tensors is None:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            x, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.stage_layers():
            x, residual = layer(positions, x, residual, meta)
        if not last_stage():
            if isinstance(x, TopKSum):  # sent to the next stage: a tensor
                x = x.materialize()
            return IntermediateTensors({"hidden_states": x, "residual": residual})
        x, _ = self.norm(x, residual)
        return x


def make_lm_head(vocab_size: int, hidden_size: int, tie_word_embeddings: bool, stack: DecoderStack) -> nn.Module:
    """The LM head on the last pipeline stage (a placeholder elsewhere), sharing the embedding's
    weight when the checkpoint ties them and one stage holds both."""
    lm_head = ParallelLMHead(vocab_size, hidden_size) if last_stage() else PPMissingLayer()
    if tie_word_embeddings and first_stage() and last_stage():
        lm_head.weight = stack.embed_tokens.weight
    return lm_head


class DecoderForCausalLM(nn.Module):
    """`model` (a DecoderStack) and `lm_head`, named as in Hugging Face checkpoints."""

    supports_pp = True  # builds only its pipeline stage (models/parallel/pipeline.py)

    def __init__(self, cfg, model: DecoderStack) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, model)
        self.make_empty_intermediate_tensors = model.make_empty_intermediate_tensors

    def forward(self, input_ids, positions, meta, intermediate_tensors: IntermediateTensors | None = None):
        """input_ids, positions [T] -> final hidden states [T, D] (last pipeline stage), or this
        stage's IntermediateTensors for the next one."""
        return self.model(input_ids, positions, meta, intermediate_tensors)

    def compute_logits(self, hidden, out=None):
        return self.lm_head.compute_logits(hidden, out)

    def attention_layers(self) -> list[nn.Module]:
        """This pipeline stage's attention layers (`self_attn.attn` of each decoder layer)."""
        return [layer.self_attn.attn for layer in self.model.stage_layers()]

    def recurrent_layers(self) -> list[nn.Module]:
        """This pipeline stage's recurrent (linear-attention) layers, whose per-request state the model
        runner keeps in slot pools: each has state_shapes(num_slots) -> {attribute: (shape, dtype)} and
        gets those attributes set to zeroed tensors. None in a model of attention layers only."""
        return []

    def ignore_checkpoint_name(self, name: str) -> bool:
        """RoPE tables, a tied model's lm_head and other pipeline stages' tensors are not loaded."""
        tied = self.config.tie_word_embeddings
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            return True
        return skip_other_stage_tensor(name, self, tied)
