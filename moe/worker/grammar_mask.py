"""A step's structured-output masks on their way to the sampler: the SchedulerOutput's host bitmask
(one row per constrained request, filled by the engine core's StructuredOutputManager) matched to
the step's sampling rows and copied to the device without a stream sync."""
from __future__ import annotations

import numpy as np
import torch

from kernels.host_to_device import host_to_device
from scheduler import SchedulerOutput


def grammar_mask_inputs(so: SchedulerOutput, sample_req_ids: list[str], device: torch.device
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows int64 [R]: each mask row's index among the sampling rows, bitmask int32 [R, W]) on the
    device, or (None, None) when no sampling row is constrained. Mask rows of requests that do not
    sample here are dropped (the core masks only those that do, so normally none)."""
    index = {rid: j for j, rid in enumerate(sample_req_ids)}
    ids = so.structured_output_request_ids
    keep = [i for i, rid in enumerate(ids) if rid in index]
    if not keep:
        return None, None
    bitmask = so.grammar_bitmask if len(keep) == len(ids) else so.grammar_bitmask[keep]
    rows = np.fromiter((index[ids[i]] for i in keep), dtype=np.int64, count=len(keep))
    return host_to_device(rows, device), host_to_device(np.ascontiguousarray(bitmask, dtype=np.int32), device)
