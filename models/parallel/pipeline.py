"""Pipeline parallelism for any model family: which layers a stage builds, placeholders for the
rest, and the activations that travel between stages.

How a model adopts it (models/qwen3_moe.py is the worked example; models/deepseek_v3.py and
models/llama4.py do the same, Llama-4 with its `language_model.` prefix for nested checkpoints):

1. Build layers with `make_layers(num_layers, build_fn)`: it returns (start, end, ModuleList)
   where only layers [start, end) of this stage are real and the others are `PPMissingLayer`
   (no parameters, so nothing is allocated or loaded for them). Build the embedding only on
   the first stage and the final norm / lm_head only on the last (`PPMissingLayer()` elsewhere;
   see `first_stage` / `last_stage`).
2. `forward(input_ids, positions, meta, intermediate_tensors=None)`: on the first stage embed
   the tokens; on the others start from `intermediate_tensors` (an `IntermediateTensors`
   received from the previous stage). Run `layers[start:end]`. On every stage but the last
   return `IntermediateTensors({...})` (Qwen3 / DeepSeek / Llama-4: "hidden_states" and
   "residual"); on the last return the final hidden states [T, D] as before.
3. `make_empty_intermediate_tensors(num_tokens, dtype, device)`: buffers of the same names
   and shapes, for the receiving side (`make_empty_intermediate_tensors_factory` builds it).
4. `attention_layers()` returns only this stage's attention layers (its KV cache), and
   `ignore_checkpoint_name(name)` ends with `skip_other_stage_tensor(name, self, tied)` (True
   for `is_pp_missing_parameter(name, self)`) so the loader skips the tensors of other stages.
   With tied embeddings, the last stage's lm_head loads from the embedding tensor
   (`tied_lm_head_rules` among the name rules).

5. Set the class attribute `supports_pp = True` (the engine refuses pipeline_parallel_size > 1
   for a model class without it, before starting any process).

The model runner does the rest (moe/worker/model_runner.py: receive, forward, send; logits and
sampling on the last stage only). With one stage all of this reduces to the plain model.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from models.loader import NameRule
from models.parallel.state import get_parallel_state


class IntermediateTensors(dict):
    """Named activations [T, ...] passed from one pipeline stage to the next."""


class PPMissingLayer(nn.Identity):
    """Stands in for a module that lives on another pipeline stage: no parameters, no compute."""


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the consecutive layers stage `pp_rank` holds (num_layers % pp_size == 0,
    validated by the engine before any process starts)."""
    if num_layers % pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} does not divide num_hidden_layers={num_layers}")
    per = num_layers // pp_size
    return pp_rank * per, (pp_rank + 1) * per


def make_layers(num_layers: int, build_fn: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): real layers for this stage, `PPMissingLayer` elsewhere (the global
    indices, and so the parameter names, stay those of the checkpoint)."""
    ps = get_parallel_state()
    start, end = pp_layer_range(num_layers, ps.pp_rank, ps.pp_size)
    layers = nn.ModuleList(build_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def first_stage() -> bool:
    return get_parallel_state().is_first_pp_rank


def last_stage() -> bool:
    return get_parallel_state().is_last_pp_rank


def make_empty_intermediate_tensors_factory(names: list[str], hidden_size: int):
    def make(num_tokens: int, dtype: torch.dtype, device: torch.device | str) -> IntermediateTensors:
        return IntermediateTensors({n: torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
                                    for n in names})
    return make


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """True when the checkpoint tensor `name` belongs to a module of another stage."""
    module: nn.Module = model
    for part in name.split("."):
        if isinstance(module, PPMissingLayer):
            return True
        child = module._modules.get(part) if isinstance(module, nn.Module) else None
        if child is None:
            return False
        module = child
    return isinstance(module, PPMissingLayer)


def skip_other_stage_tensor(name: str, model: nn.Module, tie_word_embeddings: bool,
                            embed_name: str = "model.embed_tokens") -> bool:
    """True when checkpoint tensor `name` belongs to another pipeline stage, except the tied
    embedding on a last stage (it fills that stage's lm_head through `tied_lm_head_rules`)."""
    if tie_word_embeddings and name.startswith(embed_name + ".") and last_stage():
        return False
    return is_pp_missing_parameter(name, model)


def tied_lm_head_rules(tie_word_embeddings: bool, embed_name: str = "model.embed_tokens",
                       head_name: str = "lm_head"):
    """Loader name rules that fill a tied lm_head from the embedding tensor on a last stage that
    does not hold the embedding (pp_size > 1); empty otherwise."""
    ps = get_parallel_state()
    if tie_word_embeddings and ps.pp_size > 1 and ps.is_last_pp_rank:
        return [NameRule(head_name, embed_name)]
    return []
