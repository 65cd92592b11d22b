"""The one MoE block every model uses: router -> (dispatch) -> routed experts -> (combine),
plus optional shared experts.

Experts are sharded one of two ways: expert-parallel (each EP rank holds E/ep whole experts;
the dispatcher's expert map marks the others -1) or, without EP, tensor-parallel along the
intermediate dim (every rank holds every expert's F/tp slice and the outputs are summed over the
TP group). Which one, and with which dispatcher and expert backend, is a `MoEParallelConfig`
the block receives at construction (built once per model from the process's parallel state).

Expert-parallel forward (EP group = the DP x TP ranks of a pipeline stage): the TP ranks of a
replica hold the same tokens, so each takes its 1/tp share of the rows (sequence split), then
dispatch -> local experts -> combine over the EP group, and an all-gather over TP restores the
full [T, D]. Every rank of the EP group calls dispatch and combine in every MoE layer, also with
zero rows (a DP replica without work runs a dummy batch, see moe/worker/model_runner.py).

FP8 experts (`fp8_block` given): the weights stay float8_e4m3fn with their block scales
(`*_weight_scale_inv`, the checkpoint's own) and the kernel dequantises on the fly. A checkpoint
stores gate and up as separate [F, D] tensors with their own scale grids; stacked into w13 they
only keep one scale per block if F (per TP rank) is a multiple of the block rows, and a TP slice
along F must start and end on block boundaries: otherwise the layer falls back to weights
dequantised at load (models/fp8.py).

Legend: T tokens, D hidden, E experts, F expert intermediate size, K top-k; (bn, bk) the FP8
scale block (rows of the output dim x columns of the input dim).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import kernels
from all2all import Dispatcher, LowLatencyDispatcher, make_dispatcher
from kernels.expert_count import map_to_physical_and_count
from models.layers.expert_replicas import ExpertReplicas, initial_phys_to_log, move_expert_weights
from models.layers.weights import ParamLoader, attach_loader, new_param
from models.parallel.state import ParallelState, get_parallel_state, tp_all_gather_rows, tp_all_reduce, tp_row_chunk
from routing import RouterOutput
from routing.placement import local_expert_ids

logger = logging.getLogger("models.layers.moe")
_FALLBACKS_LOGGED: set[tuple[int, int, tuple[int, int]]] = set()


@dataclass
class DispatchStep:
    """What a fixed-capacity dispatcher (all2all_backend "low_latency") needs from the runner:
    its capacity (rows per destination: the decode batch, max_num_seqs) and, each step, the most
    tokens any data-parallel replica runs (identical on every rank, so every rank takes the same
    path: low-latency when the TP slices fit the capacity, else the all-to-all fallback)."""
    capacity: int = 256
    max_tokens: int | None = None


def attach_dispatch_step(model: nn.Module, step: DispatchStep) -> None:
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.dispatch_step = step


@dataclass(frozen=True)
class MoEParallelConfig:
    """The parallel layout of the MoE blocks of one model, fixed at construction.

    use_ep: experts split over the EP group (ep_size whole-expert shards, tokens dispatched);
    otherwise every rank holds each expert's F/tp_size slice and the TP group sums the outputs.
    kernel_backend: the expert GEMM backend (kernels.fused_experts' `backend`; None = auto).
    eplb_redundant_experts: None = no EPLB; else EPLB's physical experts with this many
    redundant slots (expert parallelism only; see models/layers/expert_replicas.py).
    ep_group: the EP process group (None at ep_size 1); not part of equality.
    """
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    use_ep: bool = False
    all2all_backend: str = "auto"
    expert_placement_strategy: str = "linear"
    kernel_backend: str | None = None
    eplb_redundant_experts: int | None = None
    ep_group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_parallel_state(cls, kernel_backend: str | None = None, state: ParallelState | None = None,
                            eplb_redundant_experts: int | None = None) -> MoEParallelConfig:
        """The layout of this process (models.parallel.state's state unless `state` is given)."""
        ps = state if state is not None else get_parallel_state()
        use_ep = ps.enable_expert_parallel and ps.ep_size > 1
        return cls(tp_size=ps.tp_size, tp_rank=ps.tp_rank, ep_size=ps.ep_size, ep_rank=ps.ep_rank, use_ep=use_ep,
                   all2all_backend=ps.all2all_backend, expert_placement_strategy=ps.expert_placement_strategy,
                   kernel_backend=kernel_backend, eplb_redundant_experts=eplb_redundant_experts if use_ep else None,
                   ep_group=ps.ep_group if use_ep else None)


@dataclass(frozen=True)
class ExpertActivation:
    """What each routed expert computes between its two GEMMs. name "silu": SiLU(gate) * up;
    "swigluoai" (gpt-oss): gate clamped above at swiglu_limit, up clamped to +-swiglu_limit, then
    gate * sigmoid(swiglu_alpha * gate) * (up + 1). bias: the GEMMs add per-expert biases
    (w13_bias [E, 2F] gate then up, w2_bias [E, D], the latter before the routed weight)."""
    name: str = "silu"
    bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def changes_kernel(self) -> bool:
        return self.name != "silu" or self.bias


class ExpertWeightLoader(ParamLoader):
    """Loads expert weights from per-expert tensors (`w1` gate, `w3` up, `w2` down, each
    [F, D] or [D, F]) or from fused 3-D tensors (`w13` = [E, 2F, D] gate rows then up rows,
    `w2` with expert None = [E, D, F])."""

    def __init__(self, kind: str, num_experts: int, hidden: int, inter: int,
                 local_ids: list[int], tp_rank: int, inter_local: int) -> None:
        self.kind, self.E, self.D, self.F = kind, num_experts, hidden, inter
        # local_ids: the logical expert of each local slot; under EPLB one expert may fill
        # several slots (replicas), each loaded with the same tensor.
        self.local_ids, self.local_of = local_ids, {}
        for slot, g in enumerate(local_ids):
            self.local_of.setdefault(g, []).append(slot)
        self.f0, self.Fl = tp_rank * inter_local, inter_local

    def wants(self, shard_id, expert_id):
        # A per-expert tensor of another expert-parallel rank's expert is not even read.
        return expert_id is None or expert_id in self.local_of

    def pieces(self):
        shards = ("w1", "w3") if self.kind == "w13" else ("w2",)
        return [(s, e) for e in self.local_of for s in shards]

    def ckpt_shape(self, shard_id, expert_id):
        if expert_id is None:  # fused 3-D tensor of all experts
            return (self.E, 2 * self.F, self.D) if shard_id == "w13" else (self.E, self.D, self.F)
        return (self.D, self.F) if shard_id == "w2" else (self.F, self.D)

    def _copy_one(self, param, local: int, shard_id: str, t: torch.Tensor) -> None:
        f0, Fl = self.f0, self.Fl
        if shard_id == "w2":
            param.data[local].copy_(t[:, f0:f0 + Fl])
        else:
            dst = 0 if shard_id == "w1" else Fl
            param.data[local, dst:dst + Fl].copy_(t[f0:f0 + Fl])

    def load(self, param, tensor, shard_id, expert_id):
        if expert_id is not None:
            slots = self.local_of.get(expert_id)
            if slots is None:
                return []  # held by another expert-parallel rank
            for local in slots:
                self._copy_one(param, local, shard_id, tensor)
            return [(shard_id, expert_id)]
        filled = []
        for g, slots in self.local_of.items():
            for local in slots:
                if shard_id == "w13":
                    self._copy_one(param, local, "w1", tensor[g, :self.F])
                    self._copy_one(param, local, "w3", tensor[g, self.F:])
                else:
                    self._copy_one(param, local, "w2", tensor[g])
            filled += [("w1", g), ("w3", g)] if shard_id == "w13" else [("w2", g)]
        return filled


class ExpertBiasLoader(ParamLoader):
    """Expert biases from fused 2-D tensors: `w13` [E, 2F] gate then up (this rank's F slice of
    each), `w2` [E, D] (whole: under TP one rank adds it, see FusedMoE._experts)."""

    def __init__(self, weights: ExpertWeightLoader) -> None:
        self.w = weights

    def pieces(self):
        return [(self.w.kind, None)]

    def ckpt_shape(self, shard_id, expert_id):
        return (self.w.E, 2 * self.w.F) if self.w.kind == "w13" else (self.w.E, self.w.D)

    def load(self, param, tensor, shard_id, expert_id):
        f0, Fl, F = self.w.f0, self.w.Fl, self.w.F
        for g, slots in self.w.local_of.items():
            for local in slots:
                if self.w.kind == "w13":
                    param.data[local, :Fl].copy_(tensor[g, f0:f0 + Fl])
                    param.data[local, Fl:].copy_(tensor[g, F + f0:F + f0 + Fl])
                else:
                    param.data[local].copy_(tensor[g])
        return [(self.w.kind, None)]


class ExpertScaleLoader(ParamLoader):
    """The block scales of FP8 experts, from per-expert `weight_scale_inv` tensors: gate (`w1`)
    and up (`w3`) [ceil(F/bn), ceil(D/bk)] stacked into w13's grid [E, 2F_local/bn, ceil(D/bk)],
    down (`w2`) [ceil(D/bn), ceil(F/bk)] into [E, ceil(D/bn), ceil(F_local/bk)]. The TP slice of F
    is block-aligned (FusedMoE checks), so it maps to whole scale rows / columns."""

    def __init__(self, weights: ExpertWeightLoader, block: tuple[int, int]) -> None:
        self.w, self.block = weights, block

    def pieces(self):
        return self.w.pieces()

    def wants(self, shard_id, expert_id):
        return self.w.wants(shard_id, expert_id)

    def ckpt_shape(self, shard_id, expert_id):
        *lead, out, inp = self.w.ckpt_shape(shard_id, expert_id)
        return (*lead, math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))

    def load(self, param, tensor, shard_id, expert_id):
        if expert_id is None:  # the hub has no fused 3-D FP8 expert tensors
            raise ValueError(f"FP8 expert scales must come per expert, got a fused {shard_id!r} tensor")
        slots = self.w.local_of.get(expert_id)
        if slots is None:
            return []  # held by another expert-parallel rank
        bn, bk = self.block
        for local in slots:
            if shard_id == "w2":
                c0 = self.w.f0 // bk
                param.data[local].copy_(tensor[:, c0:c0 + param.shape[2]])
            else:
                rows = self.w.Fl // bn  # gate's scale rows, then up's
                r0, dst = self.w.f0 // bn, 0 if shard_id == "w1" else self.w.Fl // bn
                param.data[local, dst:dst + rows].copy_(tensor[r0:r0 + rows])
        return [(shard_id, expert_id)]


def fp8_experts_aligned(inter_local: int, inter: int, block: tuple[int, int]) -> bool:
    """Can FP8 experts keep the checkpoint's block scales? Gate and up stack into whole blocks
    only when F_local is a multiple of bn; a TP slice of down's columns needs F_local % bk == 0."""
    bn, bk = block
    return inter_local % bn == 0 and (inter_local == inter or inter_local % bk == 0)


class FusedMoE(nn.Module):
    """The routed experts of one layer: w13_weight [E_local, 2F_local, D], w2_weight [E_local, D, F_local].

    `parallel`: the layout (see MoEParallelConfig); None = this process's parallel state with the
    automatic expert backend (a model passes the one config it built for all its layers).

    `top_k` (optional) feeds all2all_backend="auto"; without it the rule uses the routing's K
    at the first forward (every rank sees the same K, so every rank picks the same backend).

    `fp8_block` (bn, bk): ask for FP8 experts. If the shapes allow it (`fp8_experts_aligned`),
    `self.fp8_block` keeps it and the weights are float8_e4m3fn with fp32 scales
    w13_weight_scale_inv [E_local, 2F_local/bn, ceil(D/bk)] and w2_weight_scale_inv
    [E_local, ceil(D/bn), ceil(F_local/bk)]; otherwise `self.fp8_block` is None (a log line says
    why) and the model dequantises these weights at load like its other FP8 weights.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: MoEParallelConfig | None = None, top_k: int | None = None,
                 fp8_block: tuple[int, int] | None = None, activation: ExpertActivation | None = None,
                 mxfp4: bool = False) -> None:
        super().__init__()
        self.activation = activation or ExpertActivation()
        if self.activation.changes_kernel and fp8_block is not None:
            raise ValueError(f"FP8 experts with the {self.activation.name!r} activation or biases are not supported")
        self.mxfp4 = mxfp4
        pc = parallel if parallel is not None else MoEParallelConfig.from_parallel_state()
        self.parallel = pc
        self.num_experts = num_experts
        self.kernel_backend = pc.kernel_backend
        self.top_k = top_k
        self.dispatcher: Dispatcher | None = None
        self.use_ep = pc.use_ep
        self.eplb: ExpertReplicas | None = None
        self.num_physical_experts = num_experts
        self.load_counters, self.load_row, self._counts = None, 0, False
        self.dispatch_step: DispatchStep | None = None  # set by the runner (attach_dispatch_step)
        if self.use_ep and pc.eplb_redundant_experts is not None:
            P = num_experts + pc.eplb_redundant_experts
            if P % pc.ep_size:
                raise ValueError(f"EPLB: num_experts ({num_experts}) + num_redundant_experts "
                                 f"({pc.eplb_redundant_experts}) = {P} physical experts do not divide evenly over "
                                 f"the {pc.ep_size} expert-parallel ranks")
            self.num_physical_experts, S = P, P // pc.ep_size
            phys_to_log = initial_phys_to_log(num_experts, P)
            self.eplb = ExpertReplicas(phys_to_log, num_experts, torch.get_default_device())
            local_ids = phys_to_log[pc.ep_rank * S:(pc.ep_rank + 1) * S]
            f_local, tp_rank, self.reduce_over_tp = intermediate_size, 0, False
        elif self.use_ep:
            local_ids = local_expert_ids(num_experts, pc.ep_size, pc.ep_rank, pc.expert_placement_strategy)
            f_local, tp_rank, self.reduce_over_tp = intermediate_size, 0, False
        else:
            local_ids = list(range(num_experts))
            if intermediate_size % pc.tp_size:
                raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                                 f"tensor_parallel_size={pc.tp_size}")
            f_local, tp_rank, self.reduce_over_tp = intermediate_size // pc.tp_size, pc.tp_rank, pc.tp_size > 1
        E = len(local_ids)
        if fp8_block is not None:
            fp8_block = tuple(fp8_block)
            if not fp8_experts_aligned(f_local, intermediate_size, fp8_block):
                _log_fallback(f_local, intermediate_size, fp8_block)
                fp8_block = None
        self.fp8_block = fp8_block
        wdtype = None if fp8_block is None else torch.float8_e4m3fn
        args = (num_experts, hidden_size, intermediate_size, local_ids, tp_rank, f_local)
        w13_loader, w2_loader = ExpertWeightLoader("w13", *args), ExpertWeightLoader("w2", *args)
        if mxfp4:  # packed E2M1 codes and E8M0 scales; the model attaches loaders for its hub layout
            if hidden_size % 32 or f_local % 32:
                raise ValueError(f"MXFP4 experts need hidden size ({hidden_size}) and the intermediate size per "
                                 f"rank ({f_local}) to be multiples of 32")
            self.w13_weight = attach_loader(new_param(E, 2 * f_local, hidden_size // 2, dtype=torch.uint8), w13_loader)
            self.w2_weight = attach_loader(new_param(E, hidden_size, f_local // 2, dtype=torch.uint8), w2_loader)
            self.w13_weight_scale = new_param(E, 2 * f_local, hidden_size // 32, dtype=torch.uint8)
            self.w2_weight_scale = new_param(E, hidden_size, f_local // 32, dtype=torch.uint8)
            # load_format="dummy": random codes at about the unquantised dummies' magnitude (2^-12 * e2m1)
            self.w13_weight.dummy_range = self.w2_weight.dummy_range = (0, 255)
            self.w13_weight_scale.dummy_range = self.w2_weight_scale.dummy_range = (114, 116)
        else:
            self.w13_weight = attach_loader(new_param(E, 2 * f_local, hidden_size, dtype=wdtype), w13_loader)
            self.w2_weight = attach_loader(new_param(E, hidden_size, f_local, dtype=wdtype), w2_loader)
        if self.activation.bias:  # gate then up rows of this rank's F slice; down's bias whole
            self.w13_bias = attach_loader(new_param(E, 2 * f_local), ExpertBiasLoader(w13_loader))
            self.w2_bias = attach_loader(new_param(E, hidden_size), ExpertBiasLoader(w2_loader))
        if fp8_block is not None:
            bn, bk = fp8_block
            s13 = new_param(E, 2 * f_local // bn, math.ceil(hidden_size / bk), dtype=torch.float32)
            s2 = new_param(E, math.ceil(hidden_size / bn), math.ceil(f_local / bk), dtype=torch.float32)
            self.w13_weight_scale_inv = attach_loader(s13, ExpertScaleLoader(w13_loader, fp8_block))
            self.w2_weight_scale_inv = attach_loader(s2, ExpertScaleLoader(w2_loader, fp8_block))

    def _experts(self, x_TD, topk_weights_TK, topk_ids_TK, expert_map_E, defer_sum: bool = False):
        if self.fp8_block is None and not self.activation.changes_kernel and not self.mxfp4:
            # (a dequantising model may hang its own *_scale_inv here)
            return kernels.fused_experts(x_TD, self.w13_weight, self.w2_weight, topk_weights_TK, topk_ids_TK,
                                         expert_map=expert_map_E, backend=self.kernel_backend, defer_sum=defer_sum)
        if self.fp8_block is None:
            act = self.activation
            scales = dict(w13_scale=self.w13_weight_scale, w2_scale=self.w2_weight_scale) if self.mxfp4 else {}
            # TP-sharded experts sum partial outputs over the ranks: one of them adds down's bias.
            w2_bias = self.w2_bias if act.bias and (not self.reduce_over_tp or self.parallel.tp_rank == 0) else None
            return kernels.fused_experts(x_TD, self.w13_weight, self.w2_weight, topk_weights_TK, topk_ids_TK,
                                         expert_map=expert_map_E, backend=self.kernel_backend, defer_sum=defer_sum,
                                         w13_bias=self.w13_bias if act.bias else None, w2_bias=w2_bias,
                                         activation=act.name, swiglu_alpha=act.swiglu_alpha,
                                         swiglu_limit=act.swiglu_limit, **scales)
        return kernels.fused_experts(x_TD, self.w13_weight, self.w2_weight, topk_weights_TK, topk_ids_TK,
                                     expert_map=expert_map_E, backend=self.kernel_backend,
                                     w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv,
                                     block_shape=self.fp8_block, defer_sum=defer_sum)

    def _get_dispatcher(self, top_k: int) -> Dispatcher:
        if self.dispatcher is None:
            pc = self.parallel
            # Under EPLB the dispatcher moves tokens to physical slots, placed linearly.
            placement = "linear" if self.eplb is not None else pc.expert_placement_strategy
            capacity = self.dispatch_step.capacity if self.dispatch_step is not None else None
            self.dispatcher = make_dispatcher(pc.all2all_backend, pc.ep_group, self.num_physical_experts,
                                              placement, top_k=self.top_k or top_k, capacity=capacity)
        return self.dispatcher

    # ---- expert load and EPLB ---------------------------------------------------------------
    def attach_load_counters(self, counters, row: int, enabled: bool) -> None:
        """Count this layer's routing into row `row` of an ExpertLoadCounters (moe/expert_load/counters.py).
        `enabled` False: this rank leaves the counting to another (TP rank 0 without EP); under
        EPLB the replica map still runs."""
        self.load_counters, self.load_row, self._counts = counters, row, enabled

    def _route_ids(self, ids_TK: torch.Tensor, row_offset: int, rows_per_token: int) -> torch.Tensor:
        """Count the layer's routed slots and, under EPLB, return their physical experts."""
        c = self.load_counters
        if self.eplb is not None:
            if c is None:  # a layer used on its own: map without keeping counts
                scratch = torch.zeros(self.num_physical_experts, dtype=torch.int64, device=ids_TK.device)
                num_valid = torch.full((1,), ids_TK.shape[0] + row_offset, dtype=torch.int64, device=ids_TK.device)
                return map_ids(ids_TK, self.eplb, scratch, num_valid, row_offset)
            return c.map_and_record(self.load_row, ids_TK, self.eplb.log_to_phys_ER, self.eplb.replica_count_E,
                                    row_offset, rows_per_token)
        if self._counts:
            c.record(self.load_row, ids_TK, row_offset, rows_per_token)
        return ids_TK

    def expert_params(self) -> list[torch.Tensor]:
        """Every per-slot tensor of the routed experts (weights, and FP8 scales when kept)."""
        names = ["w13_weight", "w2_weight"] + (["w13_weight_scale_inv", "w2_weight_scale_inv"]
                                               if self.fp8_block is not None else []) \
            + (["w13_bias", "w2_bias"] if self.activation.bias else []) \
            + (["w13_weight_scale", "w2_weight_scale"] if self.mxfp4 else [])
        return [getattr(self, n).data for n in names]

    def fill_dummy_replicas(self, seed: int, low: float, high: float) -> None:
        """Dummy weights under EPLB: every slot of one logical expert gets the same random values
        (seeded by the expert id), on whichever rank it lives, so replicas agree."""
        S = len(self.eplb.phys_to_log) // self.parallel.ep_size
        lo = self.parallel.ep_rank * S
        for slot, e in enumerate(self.eplb.phys_to_log[lo:lo + S]):
            for p in self.expert_params():
                if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
                    gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + e)
                    p[slot].uniform_(low, high, generator=gen)

    def apply_placement(self, phys_to_log: list[int]) -> int:
        """EPLB: install a new placement, moving expert weights between the expert-parallel ranks
        (a collective over the EP group: every rank calls it at the same step boundary with the
        same placement). Returns the slots this rank received."""
        if self.eplb is None:
            raise RuntimeError("apply_placement needs EPLB (enable_eplb with expert parallelism)")
        pc = self.parallel
        S = self.num_physical_experts // pc.ep_size
        moved = move_expert_weights(self.expert_params(), self.eplb.phys_to_log, list(phys_to_log), pc.ep_rank, S,
                                    pc.ep_group)
        self.eplb.set(list(phys_to_log))
        return moved

    def routed_ids_out(self, T: int, K: int) -> torch.Tensor | None:
        """[T, K] int32 for the router to write this layer's ids into, counted after the forward
        (moe/expert_load/counters.py); only where every row counts as routed (no expert parallelism, so
        no row split or EPLB). None: the layer counts its own routing."""
        if self._counts and not self.use_ep:
            return self.load_counters.ids_out(self.load_row, T, K)
        return None

    def forward(self, x_TD: torch.Tensor, routing: RouterOutput, rows_per_token: int = 1,
                counted: bool = False, defer_sum: bool = False):
        """rows_per_token: how many rows of x_TD make one token of the step (Llama-4's
        scaled-input path sends one row per (token, expert) pair); only the load counting uses it.
        counted: the routing's ids are counted after the forward (routed_ids_out).
        defer_sum: the result may be a TopKSum (kernels.fused_experts) where nothing follows the
        sum here (no TP all-reduce, no expert parallelism)."""
        if self.use_ep:
            return self._forward_ep(x_TD, routing, rows_per_token)
        if not counted:
            self._route_ids(routing.topk_ids_TK, 0, rows_per_token)
        y_TD = self._experts(x_TD, routing.topk_weights_TK, routing.topk_ids_TK, None,
                             defer_sum=defer_sum and not self.reduce_over_tp)
        return tp_all_reduce(y_TD) if self.reduce_over_tp else y_TD

    def _forward_ep(self, x_TD: torch.Tensor, routing: RouterOutput, rows_per_token: int = 1) -> torch.Tensor:
        T = x_TD.shape[0]
        lo, hi, _ = tp_row_chunk(T)  # the TP ranks split the (replicated) rows
        disp = self._get_dispatcher(routing.topk_ids_TK.shape[1])
        ids_TK = self._route_ids(routing.topk_ids_TK[lo:hi], lo, rows_per_token)
        if isinstance(disp, LowLatencyDispatcher):
            # the most rows any EP rank dispatches: its replica's step tokens (x K rows per token on
            # Llama-4's scaled-input path), split over its TP ranks
            step = self.dispatch_step
            most = -(-step.max_tokens * rows_per_token // self.parallel.tp_size) if step and step.max_tokens else None
            recv = disp.dispatch(x_TD[lo:hi], routing.topk_weights_TK[lo:hi], ids_TK, max_tokens_across_ranks=most)
        else:
            recv = disp.dispatch(x_TD[lo:hi], routing.topk_weights_TK[lo:hi], ids_TK)
        y_RD = self._experts(recv.x_RD, recv.topk_weights_RK, recv.topk_ids_RK,
                             disp.expert_map_on(x_TD.device))
        y_ND = disp.combine(y_RD, recv)
        return tp_all_gather_rows(y_ND, T)


def map_ids(ids_TK: torch.Tensor, replicas: ExpertReplicas, scratch_P: torch.Tensor, num_valid: torch.Tensor,
            row_offset: int) -> torch.Tensor:
    """Physical ids of logical ones without kept counts (scratch_P absorbs both countings)."""
    return map_to_physical_and_count(ids_TK, replicas.log_to_phys_ER, replicas.replica_count_E,
                                     scratch_P[:replicas.num_logical], scratch_P, num_valid, row_offset)


def _log_fallback(f_local: int, inter: int, block: tuple[int, int]) -> None:
    key = (f_local, inter, block)
    if key not in _FALLBACKS_LOGGED:  # once per shape, not once per layer
        _FALLBACKS_LOGGED.add(key)
        logger.info("FP8 experts: intermediate size %d (%d per rank) does not split into whole %dx%d "
                    "scale blocks; routed experts are dequantised at load instead", inter, f_local, *block)


class MoEBlock(nn.Module):
    """gate (router logits) -> router function -> experts, plus shared experts when given.

    `router_fn(logits_TE) -> RouterOutput` holds the family's routing rule (softmax top-k,
    sigmoid group-limited, ...). Attribute names match the Hugging Face layout (`gate`,
    `experts`, `shared_experts`) so weight names map one to one.

    `apply_router_weight_on_input` (Llama-4): each chosen expert e of a token computes
    expert_e(w_e * x) and the K results are summed with weight 1, instead of sum_e w_e * expert_e(x).
    The scaling happens here, before the experts (and so before any expert-parallel dispatch):
    each (token, chosen expert) pair becomes one row w_e * x routed to e alone with weight 1
    (top-1: the T rows themselves, no copy of the routing), and a token's K rows are summed
    after the combine.
    """

    def __init__(self, gate: nn.Module, router_fn: Callable[[torch.Tensor], RouterOutput],
                 experts: FusedMoE, shared_experts: nn.Module | None = None,
                 apply_router_weight_on_input: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.router_fn = router_fn
        self.experts = experts
        self.shared_experts = shared_experts
        self.apply_router_weight_on_input = apply_router_weight_on_input
        fn = getattr(router_fn, "func", router_fn)  # through functools.partial
        self.top_k = getattr(router_fn, "keywords", {}).get("top_k")
        self._router_writes_ids = bool(getattr(fn, "writes_ids_into", False)) and self.top_k is not None \
            and not apply_router_weight_on_input
        # Set by a decoder layer whose next op is an RMSNorm with the residual add
        # (models/layers/decoder.py): the output may then be a TopKSum for that norm to sum.
        self.defer_topk_sum = False
        # enable_return_routed_experts: the step buffer this block writes its routed ids into
        # (moe/worker/routed_experts.py), and its row there.
        self.routed_capture = None
        self.routed_row = 0

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x_TD)
        # A router that can write its ids into the expert-load step buffer (softmax_topk) does so:
        # the counting is then one launch for all layers after the forward, not one per layer.
        out_ids = self.experts.routed_ids_out(x_TD.shape[0], self.top_k) if self._router_writes_ids else None
        routing = self.router_fn(logits) if out_ids is None else self.router_fn(logits, out_ids=out_ids)
        if self.routed_capture is not None:  # the logical ids, before any EPLB replica mapping
            self.routed_capture.write(self.routed_row, routing.topk_ids_TK)
        if self.apply_router_weight_on_input:
            y_TD = self._experts_on_scaled_input(x_TD, routing)
        else:
            y_TD = self.experts(x_TD, routing, counted=out_ids is not None,
                                defer_sum=self.defer_topk_sum and self.shared_experts is None)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD

    def _experts_on_scaled_input(self, x_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        w_TK, ids_TK = routing.topk_weights_TK, routing.topk_ids_TK
        (T, K), D = ids_TK.shape, x_TD.shape[1]
        if K == 1:
            x_ND, ids_NK = x_TD * w_TK.to(x_TD.dtype), ids_TK
        else:  # N = T * K rows, token-major: row t * K + k is token t scaled for its k-th expert
            x_ND = (x_TD[:, None, :] * w_TK.to(x_TD.dtype)[..., None]).reshape(T * K, D)
            ids_NK = ids_TK.reshape(T * K, 1)
        ones_NK = torch.ones(ids_NK.shape, dtype=torch.float32, device=x_TD.device)
        y_ND = self.experts(x_ND, RouterOutput(ones_NK, ids_NK), rows_per_token=K)
        return y_ND if K == 1 else y_ND.view(T, K, D).sum(dim=1)
