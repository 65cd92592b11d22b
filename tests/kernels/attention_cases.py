"""Paged-attention test batches: sequences of (cached tokens, new tokens) with their blocks scattered
over the cache, the cached context already written, and the metadata the model runner would build."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata, write_kv_cache


@dataclass
class PagedBatch:
    q: torch.Tensor            # [T, H, d] this step's queries
    k_new: torch.Tensor        # [T, G, d] this step's keys and values (already in the cache)
    v_new: torch.Tensor
    cache: torch.Tensor        # [2, N, S, G, d]
    meta: AttentionMetadata
    scale: float
    contexts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence (q, k [L], v [L])


def paged_batch(seqs: list[tuple[int, int]], block_size: int, H: int = 4, G: int = 2, d: int = 8,
                seed: int = 0, stale_cache: bool = False) -> PagedBatch:
    """stale_cache: random data where nothing was written (else zeros)."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (2, num_blocks, block_size, G, d)
    cache = torch.randn(*shape, generator=gen) if stale_cache else torch.zeros(*shape)
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int64)
    qs, ks, vs, slots, contexts, qsl, seq_lens = [], [], [], [], [], [0], []
    for b, (c, n) in enumerate(seqs):
        L = c + n
        blocks = [perm.pop() for _ in range(nblk[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks)
        k, v = torch.randn(L, G, d, generator=gen), torch.randn(L, G, d, generator=gen)
        q = torch.randn(n, H, d, generator=gen)
        slot = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(L)])
        write_kv_cache(k[:c], v[:c], cache, slot[:c])  # context cached by earlier steps
        qs.append(q), ks.append(k[c:]), vs.append(v[c:]), slots.append(slot[c:]), contexts.append((q, k, v))
        qsl.append(qsl[-1] + n)
        seq_lens.append(L)
    q, k_new, v_new, slot_mapping = torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(slots)
    decode = [b for b, (_, n) in enumerate(seqs) if n == 1]
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables_BM=tables,
                             slot_mapping_T=slot_mapping, decode_seqs=decode,
                             prefill_seqs=[b for b in range(len(seqs)) if b not in decode])
    if decode:  # as the model runner prepares them
        width = -(-max(seq_lens[b] for b in decode) // block_size)
        meta.decode_token_idx = torch.tensor([qsl[b] for b in decode])
        meta.decode_seq_lens = torch.tensor([seq_lens[b] for b in decode])
        meta.decode_block_tables = tables[decode, :width].contiguous()
    write_kv_cache(k_new, v_new, cache, slot_mapping)
    return PagedBatch(q, k_new, v_new, cache, meta, d ** -0.5, contexts)


def dense_attention(q_nHd, k_LGd, v_LGd, scale, chunk=None, window=None, sinks_H=None):
    """float64 attention of n queries at the end of L keys, as transformers' eager attention: causal,
    within a chunk (chunked-local) or a window (sliding), with a sink logit per head joining the
    softmax (gpt-oss) -> [n, H, d]."""
    n, H, _ = q_nHd.shape
    L, G, _ = k_LGd.shape
    k = k_LGd.double().repeat_interleave(H // G, dim=1)
    v = v_LGd.double().repeat_interleave(H // G, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q_nHd.double(), k) * scale
    q_idx, kv_idx = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
    allowed = kv_idx <= q_idx
    if chunk is not None:
        allowed &= (kv_idx // chunk) == (q_idx // chunk)
    if window is not None:
        allowed &= kv_idx > q_idx - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks_H is not None:
        logits = torch.cat([logits, sinks_H.double().view(H, 1, 1).expand(H, n, 1)], dim=-1)
    probs = (logits - logits.max(-1, keepdim=True).values).softmax(-1)
    if sinks_H is not None:
        probs = probs[..., :-1]  # the sink column has no value
    return torch.einsum("hnl,lhd->nhd", probs, v)
