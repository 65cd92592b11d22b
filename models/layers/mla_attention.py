"""Multi-head latent attention (DeepSeek-V2/V3) with a paged latent cache.

Per token the cache holds only [kv_a_layernorm(latent) | rope(k_pe)] (kv_lora_rank +
qk_rope_head_dim numbers, shared by all heads). Prefill attends in the expanded form (per-head
K/V from kv_b_proj), decode in the absorbed form (queries projected into latent space with
kv_b_proj's K rows, output latent projected with its V rows); both forms give the same result
(`mode` forces one of them, for tests).

Two paths with the same result: the torch reference (kernels/mla_attention.py) on the CPU or
with a forced `mode`, and on CUDA (mode "auto") the Triton kernels (kernels/triton_attention):
decode rows absorbed through the split-KV `mla_decode_triton`; prefill rows expanded with one
context gather, one kv_b_proj linear and one `varlen_attention_triton` call for all of them,
eagerly (host lengths). A mixed step's CUDA graph runs every row absorbed instead (each token a row
of its causal length, the layout read from device tensors alone): the runner replays it for steps
of little prefill attention (`mixed_graph_fits`), since the absorbed form costs ~3x the FLOPs of
the expanded one a (query, key) pair of a long chunk (the expanded form makes each context row's
per-head keys once; the absorbed one dots every query with the 576-wide latent row).

Heads are split across TP ranks (q_b_proj / q_proj and kv_b_proj column-parallel, o_proj
row-parallel); the down projections and the cache row are replicated.

An FP8 cache (kv_cache_dtype "fp8" / "fp8_e5m2") holds the whole row with one per-tensor scale,
`k_scale` (vLLM's choice for MLA; v_scale is kept but unused): a host float, 1.0 unless the
checkpoint has one (models/loader.py). Caches of the model dtype ignore it.

Legend: T tokens, H local heads, R kv_lora_rank, P qk_rope_head_dim, C = R + P,
Dn qk_nope_head_dim, Dv v_head_dim, Q q_lora_rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionMetadata, dequantize_kv
from kernels.host_to_device import host_to_device
from kernels.mla_attention import mla_absorbed_torch, mla_expanded_prefill_torch, write_latent_cache
from models.config import RopeConfig
from models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.layers.rotary_yarn import yarn_softmax_scale

# A mixed step replays a CUDA graph (every query row absorbed) when it has at most ABSORBED_MAX_TOKENS
# tokens (the largest mixed graph; MOE_MLA_ABSORBED_TOKENS, 0: none) and its prefill chunks at most
# ABSORBED_MAX_HEAD_PAIRS (query, key) pairs times this rank's heads (MOE_MLA_ABSORBED_HEAD_PAIRS);
# other mixed steps run eagerly, their prefill rows expanded.
ABSORBED_MAX_TOKENS = int(os.environ.get("MOE_MLA_ABSORBED_TOKENS", "2048"))
ABSORBED_MAX_HEAD_PAIRS = int(float(os.environ.get("MOE_MLA_ABSORBED_HEAD_PAIRS", "16e6")))
# In those graphs the chunks' tokens packed into programs of MOE_MLA_CHUNK_ROWS tokens x heads
# (kernels/triton_attention/mla_chunks.py; 0: a program per token, as decode rows).
CHUNK_ROWS = int(os.environ.get("MOE_MLA_CHUNK_ROWS", "64"))

# transformers builds q_a_layernorm / kv_a_layernorm with the default epsilon, whatever rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6


@dataclass
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool = True
    attention_bias: bool = False


class MLAAttention(nn.Module):
    """x [T, D] -> o_proj(attention) [T, D]. `kv_cache` [N, S, C] is bound by the model runner."""

    def __init__(self, cfg: MLAConfig, mode: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.mode = mode  # "auto" (prefill expanded, decode absorbed), "expanded", "absorbed"
        Dn, P, Dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_head_dim = Dn + P
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.num_heads * self.qk_head_dim])
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [cfg.num_heads * self.qk_head_dim])
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, R + P, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(R, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(R, [cfg.num_heads * (Dn + Dv)])
        self.o_proj = RowParallelLinear(cfg.num_heads * Dv, cfg.hidden_size, bias=cfg.attention_bias)
        self.num_local_heads = self.kv_b_proj.weight.shape[0] // (Dn + Dv)
        # Interleaved (rotate pairs) unless the checkpoint says otherwise; q and k get the same
        # layout, so the scores do not depend on how the rotated pairs are laid out.
        self.rotary_emb = get_rope(P, cfg.max_position_embeddings, cfg.rope, is_neox_style=not cfg.rope_interleave)
        self.scale = yarn_softmax_scale(self.qk_head_dim, cfg.rope)
        self.kv_cache: torch.Tensor | None = None  # [N, S, C], bound by the runner
        # An FP8 cache's per-tensor scale of the whole row (stored = fp8(row / k_scale)); v_scale is
        # what a checkpoint may also give, unused (one scale for MLA's cache, as vLLM).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim)

    @property
    def max_mixed_graph_tokens(self) -> int:
        """The largest mixed step a graph captures (mode "auto"'s GPU path runs it absorbed)."""
        return ABSORBED_MAX_TOKENS if self.mode == "auto" else 0

    def mixed_graph_fits(self, num_tokens_B: np.ndarray, seq_lens_B: np.ndarray) -> bool:
        """Whether a mixed step (new tokens and context per sequence, host arrays) may replay a graph:
        its prefill chunks' (query, key) pairs times the heads within ABSORBED_MAX_HEAD_PAIRS."""
        chunks = num_tokens_B > 1
        pairs = int(np.dot(num_tokens_B[chunks], seq_lens_B[chunks]))
        return pairs * self.num_local_heads <= ABSORBED_MAX_HEAD_PAIRS

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _kv_b_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, R] and W_UV [H, Dv, R]: views of kv_b_proj's weight (no copy, so an
        FP8-dequantised or reloaded weight is always what is used)."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.num_local_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c, T, H = self.cfg, x.shape[0], self.num_local_heads
        Dn, P, Dv, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        q = self._queries(x).view(T, H, Dn + P)
        q_nope, q_pe = q.split([Dn, P], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([R, P], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None, :])
        latent_TC = torch.cat((latent, k_pe[:, 0]), dim=-1)
        if self.kv_cache is None:
            raise RuntimeError("attention ran before the model runner bound a KV cache")
        if self.mode == "auto" and use_triton_path(x):
            from kernels.triton_attention.mla_decode import write_latent_cache_triton
            write_latent_cache_triton(latent_TC, self.kv_cache, meta.slot_mapping_T, self.k_scale)
            return self.o_proj(self._attend_triton(q_nope, q_pe, meta).reshape(T, H * Dv))
        write_latent_cache(latent_TC, self.kv_cache, meta.slot_mapping_T, self.k_scale)

        if self.mode == "expanded":
            expanded, absorbed_prefill, absorbed_decode = meta.prefill_seqs + meta.decode_seqs, [], False
        elif self.mode == "absorbed":
            expanded, absorbed_prefill, absorbed_decode = [], meta.prefill_seqs, True
        else:
            expanded, absorbed_prefill, absorbed_decode = meta.prefill_seqs, [], True
        out_THDv = q.new_empty(T, H, Dv)
        if expanded:
            mla_expanded_prefill_torch(torch.cat((q_nope, q_pe), dim=-1), latent_TC, self.kv_cache,
                                       self.kv_b_proj.weight, meta, expanded, Dn, Dv, self.scale, out_THDv,
                                       self.k_scale)
        if absorbed_prefill or (absorbed_decode and meta.decode_seqs):
            w_uk, w_uv = self._kv_b_parts()
            rows = _rows(meta, absorbed_prefill, absorbed_decode, x.device)
            q_lat = torch.einsum("thd,hdr->thr", q_nope[rows], w_uk)
            q_abs = q.new_zeros(T, H, R + P)
            q_abs[rows] = torch.cat((q_lat, q_pe[rows]), dim=-1)
            out_THR = q.new_zeros(T, H, R)
            mla_absorbed_torch(q_abs, latent_TC, self.kv_cache, meta, absorbed_prefill, absorbed_decode,
                               self.scale, out_THR, self.k_scale)
            out_THDv[rows] = torch.einsum("thr,hvr->thv", out_THR[rows], w_uv)
        return self.o_proj(out_THDv.reshape(T, H * Dv))

    # ---- GPU path (Triton) --------------------------------------------------------------------
    def _attend_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output [T, H, Dv]; the new latent rows are already in the cache."""
        if meta.decode_only and meta.seq_lens_t is not None:
            # Every row is a decode row, row b = sequence b (padded rows: seq_len 0 -> zeros);
            # device tensors only, so this runs inside a CUDA graph.
            return self._decode_triton(q_nope, q_pe, meta.seq_lens_t, meta.block_tables_BM)
        T, H, Dv = q_nope.shape[0], q_nope.shape[1], self.cfg.v_head_dim
        if not meta.host_lists:
            return self._mixed_graph_triton(q_nope, q_pe, meta)
        out_THDv = q_nope.new_empty(T, H, Dv)
        if meta.prefill_seqs:
            self._prefill_triton(q_nope, q_pe, meta, out_THDv)
        if meta.decode_seqs:
            idx = meta.decode_token_idx
            out_THDv[idx] = self._decode_triton(q_nope[idx], q_pe[idx], meta.decode_seq_lens,
                                                meta.decode_block_tables)
        return out_THDv

    def _decode_triton(self, q_nope_BHD: torch.Tensor, q_pe_BHP: torch.Tensor, seq_lens_B: torch.Tensor,
                       block_tables_BM: torch.Tensor) -> torch.Tensor:
        """Absorbed form: q_nope @ W_UK, latent attention over the cache rows, then @ W_UV^T."""
        from kernels.triton_attention.mla_decode import mla_decode_triton
        out_BHR = mla_decode_triton(self._absorbed_queries(q_nope_BHD, q_pe_BHP), self.kv_cache, block_tables_BM,
                                    seq_lens_B, self.scale, self.cfg.kv_lora_rank, kv_scale=self.k_scale)
        return self._absorbed_outputs(out_BHR)

    def _mixed_graph_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A mixed step as its CUDA graph runs it, from device tensors only: every token absorbed, the
        decode rows through the split-KV kernel (a row reading its sequence's block-table row), then
        the chunks' tokens packed (CHUNK_ROWS; 0: they too a row each, of their causal length).
        The first MLA layer of the forward derives the rows for the rest."""
        from kernels.triton_attention.mla_chunks import mla_chunks_triton
        from kernels.triton_attention.mla_decode import mla_decode_triton, mla_token_rows
        rows = meta.derived.get("mla_rows")
        if rows is None:
            rows = meta.derived["mla_rows"] = mla_token_rows(meta.query_start_loc_t, meta.seq_lens_t, q_nope.shape[0],
                                                             chunks_apart=CHUNK_ROWS > 0)
        q_THC = self._absorbed_queries(q_nope, q_pe)
        out_THR = mla_decode_triton(q_THC, self.kv_cache, meta.block_tables_BM, rows[1], self.scale,
                                    self.cfg.kv_lora_rank, kv_scale=self.k_scale, table_rows_B=rows[0])
        if CHUNK_ROWS > 0:
            mla_chunks_triton(q_THC, self.kv_cache, meta.block_tables_BM, meta.query_start_loc_t, meta.seq_lens_t,
                              self.scale, self.cfg.kv_lora_rank, out_THR, kv_scale=self.k_scale, rows=CHUNK_ROWS)
        return self._absorbed_outputs(out_THR)

    def _absorbed_queries(self, q_nope_BHD: torch.Tensor, q_pe_BHP: torch.Tensor) -> torch.Tensor:
        """[q_nope @ W_UK | q_pe]: [B, H, R + P]."""
        w_uk = self._kv_b_parts()[0]  # [H, Dn, R]
        q_lat_HBR = torch.bmm(q_nope_BHD.transpose(0, 1), w_uk)
        return torch.cat((q_lat_HBR.transpose(0, 1), q_pe_BHP), dim=-1)

    def _absorbed_outputs(self, out_BHR: torch.Tensor) -> torch.Tensor:
        """Latent outputs projected with W_UV: [B, H, Dv]."""
        w_uv = self._kv_b_parts()[1]  # [H, Dv, R]
        return torch.bmm(out_BHR.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata,
                        out_THDv: torch.Tensor) -> None:
        """Expanded form for all prefill sequences at once (eager only: host lists are read).

        The context rows of every prefill sequence (cached and new, all in the cache by now)
        are gathered with one index, expanded to per-head K/V with one kv_b_proj linear, and
        attended with one varlen call; the outputs go to the sequences' rows of out_THDv. The
        gather indices are uploaded once per forward (pinned, no stream sync) and shared by the
        layers."""
        from kernels.triton_attention.varlen import varlen_attention_triton
        c = self.cfg
        Dn, Dv, R = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        H = q_nope.shape[1]
        gather = meta.derived.get("mla_prefill")
        if gather is None:  # the first MLA layer of this forward: every other layer reuses it
            gather = meta.derived["mla_prefill"] = _PrefillGather.of(meta, self.kv_cache.shape[1], q_nope.device)
        ctx_LC = dequantize_kv(self.kv_cache.flatten(0, 1)[gather.slots_L], q_nope.dtype, self.k_scale)
        L = ctx_LC.shape[0]
        k_nope, v_LHDv = F.linear(ctx_LC[:, :R], self.kv_b_proj.weight).view(L, H, Dn + Dv).split([Dn, Dv], dim=-1)
        k_LHE = torch.cat((k_nope, ctx_LC[:, None, R:].expand(L, H, ctx_LC.shape[1] - R)), dim=-1)
        rows = gather.rows_T
        q_THE = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        out_THDv[rows] = varlen_attention_triton(q_THE, k_LHE, v_LHDv, gather.cu_q, gather.cu_k, gather.max_q,
                                                 self.scale)


@dataclass
class _PrefillGather:
    """Where the prefill sequences' queries and context rows are, on the device: their token rows
    in the batch [Tp], the cache slot of every context position [L], and varlen offsets."""
    rows_T: torch.Tensor
    slots_L: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int

    @staticmethod
    def of(meta: AttentionMetadata, block_size: int, device: torch.device) -> "_PrefillGather":
        seqs = np.asarray(meta.prefill_seqs, dtype=np.int64)
        qsl = np.asarray(meta.query_start_loc, dtype=np.int64)
        n = qsl[seqs + 1] - qsl[seqs]
        ctx_len = np.asarray(meta.seq_lens, dtype=np.int64)[seqs]
        # context position p of sequence b lives at slot table[b, p // S] * S + p % S
        pos = host_to_device(_ragged_aranges(np.zeros_like(ctx_len), ctx_len), device)
        seq_of = host_to_device(np.repeat(seqs, ctx_len), device)
        slots = meta.block_tables_BM[seq_of, pos // block_size].long() * block_size + pos % block_size
        # rows padded to 16 entries: both start 64-byte aligned whatever the batch (Triton compiles
        # a variant per pointer alignment)
        cu = np.zeros((2, -(-(len(seqs) + 1) // 16) * 16), dtype=np.int32)
        cu[0, 1:len(seqs) + 1], cu[1, 1:len(seqs) + 1] = np.cumsum(n), np.cumsum(ctx_len)
        cu_t = host_to_device(cu, device)
        return _PrefillGather(host_to_device(_ragged_aranges(qsl[seqs], n), device), slots,
                              cu_t[0, :len(seqs) + 1], cu_t[1, :len(seqs) + 1], int(n.max()))


def use_triton_path(x: torch.Tensor) -> bool:
    """Whether the layer runs the Triton kernels (mode "auto" only): CUDA tensors and Triton
    importable. Tests monkeypatch this to run the GPU path on the CPU under TRITON_INTERPRET=1."""
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _ragged_aranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lengths[i]) over i, int64."""
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - offsets + np.repeat(starts, lengths)


def _rows(meta: AttentionMetadata, prefill_seqs: list[int], with_decode: bool, device) -> torch.Tensor:
    """Token rows of the given prefill sequences, plus the decode tokens when asked."""
    idx = [torch.arange(meta.query_start_loc[b], meta.query_start_loc[b + 1]) for b in prefill_seqs]
    if with_decode and meta.decode_seqs:
        idx.append(torch.tensor([meta.query_start_loc[b] for b in meta.decode_seqs]))
    return host_to_device(torch.cat(idx), device) if idx else torch.empty(0, dtype=torch.long, device=device)
