"""The "last program finishes" pattern: one launch does a grid-wide step and then a small step
that needs all of its results, instead of a second launch.

Every program stores its results, passes a barrier (so each of its threads' stores comes first),
then counts itself in with an acq_rel atomic on a counter. The program that counts last has seen
every other program's release, reads their results past L1 (".cg") and does the small step; it
then sets the counter back to 0, so the next launch, or the next replay of a captured graph,
starts from zero. It pays only where that small step is short: the program that counts last runs
it alone, after an atomic, while the next kernel (launched early with PDL) waits.

User: the split-KV decode attention (the merge of a few splits).
"""
from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def zeroed_counters(owner: str, n: int, device: torch.device) -> torch.Tensor:
    """At least n int32 counters at 0, kept per kernel family (`owner`) and device, so no two kinds
    of kernel ever share one (the kernels leave them at 0). A captured graph keeps the address it
    was captured with, so a larger set is added beside the old ones, never in their place. Made
    while a graph is captured, their zeros would exist only once it replays: such a set is not
    kept (a graph's warm-up forward makes them first)."""
    kept = _COUNTERS.setdefault((owner, device), [])
    for counters in kept:
        if counters.numel() >= n:
            return counters
    counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        kept.append(counters)
    return counters
