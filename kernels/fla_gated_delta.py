"""Prefill of the gated delta rule through flash-linear-attention's chunked kernel (fla-core), opt-in
(MOE_FLA_PREFILL=1, with fla-core installed), the field's library beside the project's own chunked
kernel (kernels/triton_gated_delta_chunked.py, the default): in a layer alone both run a long prefill
in about the same time (BENCHMARKS.md, Qwen3-Next). fla-core's launch grid follows the sequences'
lengths on the host, so no CUDA graph can hold it: with it on, a hybrid model's mixed steps run
eagerly, which on mixed-length traffic costs more than the kernel saves (measured there).

A step's sequences are split: those of one token (decodes) go through the recurrent kernel, which
reads and writes their states in place in the pool; the others through fla-core, their states
gathered from and scattered back to their slots (fresh sequences start from zeros). Same
contract as kernels.gated_delta.gated_delta_rule_varlen.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _chunk_kernel():
    if os.environ.get("MOE_FLA_PREFILL", "0") != "1":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:  # fla-core not installed (an optional dependency: the `fla` extra)
        return None
    return chunk_gated_delta_rule


def fla_prefill_available() -> bool:
    """Whether prefill steps use fla-core's chunked kernel (asked for, and installed)."""
    return _chunk_kernel() is not None


def gated_delta_rule_chunked_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, query_start_loc: list[int], query_start_loc_t: torch.Tensor,
                                 state_pool: torch.Tensor, state_slots_B: torch.Tensor,
                                 has_initial_state_B: torch.Tensor, scale: float,
                                 use_qk_l2norm: bool = True) -> torch.Tensor:
    """fla-core over every sequence: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay) and beta [T, Hv];
    the state pool [slots, Hv, Dk, Dv] float32. Returns o [T, Hv, Dv] in v's dtype."""
    kernel = _chunk_kernel()
    if kernel is None:
        raise RuntimeError("fla-core's chunked gated delta rule is not in use (MOE_FLA_PREFILL=1, pip install "
                           "fla-core)")
    initial = state_pool.index_select(0, state_slots_B)
    initial = torch.where(has_initial_state_B[:, None, None, None], initial, torch.zeros((), device=initial.device))
    cu = query_start_loc_t.to(torch.long)
    cu_cpu = torch.tensor(query_start_loc, dtype=torch.long)  # the host's copy: no sync to size the grid
    o, final = kernel(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
                      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu,
                      cu_seqlens_cpu=cu_cpu)
    state_pool.index_copy_(0, state_slots_B, final.to(state_pool.dtype))
    return o[0].to(v.dtype)


class PrefillSplit:
    """A step's rows and sequences split into decodes (one token) and prefills, on the device, made
    once per forward from the host layout (AttentionMetadata.derived holds it for every layer)."""

    def __init__(self, query_start_loc: list[int], slots_B: torch.Tensor, has_initial_B: torch.Tensor) -> None:
        dev = slots_B.device
        lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        decode = [i for i, n in enumerate(lens) if n == 1]
        prefill = [i for i, n in enumerate(lens) if n > 1]
        prefill_rows = [r for i in prefill for r in range(query_start_loc[i], query_start_loc[i + 1])]
        self.qsl_prefill = [0]
        for i in prefill:
            self.qsl_prefill.append(self.qsl_prefill[-1] + lens[i])

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).pin_memory().to(dev, non_blocking=True) \
                if dev.type == "cuda" else torch.tensor(values, dtype=torch.long, device=dev)

        self.num_decodes = len(decode)
        self.decode_rows = on_device([query_start_loc[i] for i in decode])
        self.qsl_decode = on_device(list(range(len(decode) + 1))).to(torch.int32)
        self.prefill_rows = on_device(prefill_rows)
        self.qsl_prefill_t = on_device(self.qsl_prefill)
        seqs_d, seqs_p = on_device(decode), on_device(prefill)
        self.slots_decode, self.slots_prefill = slots_B.index_select(0, seqs_d), slots_B.index_select(0, seqs_p)
        self.init_decode = has_initial_B.index_select(0, seqs_d)
        self.init_prefill = has_initial_B.index_select(0, seqs_p)


def gated_delta_rule_prefill_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, split: PrefillSplit, state_pool: torch.Tensor, recurrent,
                                   scale: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Decode rows through `recurrent` (the Triton recurrent kernel), prefill rows through fla-core."""
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if split.num_decodes:
        r = split.decode_rows
        o[r] = recurrent(q[r], k[r], v[r], g[r], beta[r], split.qsl_decode, state_pool, split.slots_decode,
                         split.init_decode, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if len(split.qsl_prefill) > 1:
        r = split.prefill_rows
        o[r] = gated_delta_rule_chunked_fla(q[r], k[r], v[r], g[r], beta[r], split.qsl_prefill, split.qsl_prefill_t,
                                            state_pool, split.slots_prefill, split.init_prefill, scale,
                                            use_qk_l2norm)
    return o
