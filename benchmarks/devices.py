"""`--device`, as the benchmarks that take one check it before they do any work."""

from __future__ import annotations

import torch


def device_problem(name: str) -> str | None:
    """What is wrong with `--device NAME` (a name torch does not know, or CUDA without a CUDA
    device), or None."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        return f"--device: {e}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device here"
    return None
