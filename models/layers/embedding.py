"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of the
(padded) vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import batch_invariant
from models.layers.weights import Shard, ShardedLoader, attach_loader, new_param
from models.parallel.state import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce


class _VocabShardedLoader(ShardedLoader):
    """Like ShardedLoader, but the last rank's slice may run past the real vocabulary."""

    def load(self, param, tensor, shard_id, expert_id):
        s = self.shards[shard_id]
        n = max(0, min(s.size, s.full - s.ckpt_start))
        if n:
            param.data[:n].copy_(tensor[s.ckpt_start:s.ckpt_start + n])
        param.data[n:].zero_()
        return [(shard_id, expert_id)]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.vocab_size, self.tp_size = vocab_size, ps.tp_size
        self.per_rank = -(-vocab_size // ps.tp_size)
        self.start = ps.tp_rank * self.per_rank
        shards = {None: Shard(vocab_size, self.start, self.per_rank, 0)}
        self.weight = attach_loader(new_param(self.per_rank, hidden_size),
                                    _VocabShardedLoader((self.per_rank, hidden_size), 0, shards))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ weight.T, gathered over the TP group and trimmed to the vocabulary."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: [rows, vocabulary] to write the logits into (one rank only: a CUDA graph's static
        buffer, the same memory at every replay)."""
        if out is None:
            logits = batch_invariant.dense(hidden, self.weight)
            return tp_all_gather_last_dim(logits)[..., :self.vocab_size]
        if self.tp_size > 1 or out.shape != (hidden.shape[0], self.per_rank):
            raise ValueError(f"logits into a [{hidden.shape[0]}, {self.per_rank}] buffer on one rank, got "
                             f"{list(out.shape)} at tensor-parallel size {self.tp_size}")
        if batch_invariant.enabled():
            return out.copy_(batch_invariant.dense(hidden, self.weight))
        return torch.matmul(hidden, self.weight.t(), out=out)  # F.linear's product, into out
