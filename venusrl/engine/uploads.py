"""Host values onto the device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream
to drain, so a step that builds its handful of small tensors that way stalls the host once for
each. From pinned memory with `non_blocking=True` the copy is queued and the host goes on; the
caching host allocator keeps the pinned block until the copy has run. On a CPU both are a plain
tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ints(
    values: Sequence[int] | Sequence[Sequence[int]],
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """Integers (a list, or rows of equal length) as one tensor on `device`, one copy."""
    return to_device(torch.tensor(values, dtype=dtype), device)
