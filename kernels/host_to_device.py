"""Host values onto the device without a stream sync."""
from __future__ import annotations

import torch


def host_to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """values (a list or numpy array) as a tensor on `device`. On CUDA through pinned memory and
    asynchronously: torch's copy from pageable memory synchronizes the stream, which would make
    the host wait for every step in flight (async scheduling)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
