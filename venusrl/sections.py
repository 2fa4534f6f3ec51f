"""What every config section shares: extra keys are errors, assignments are validated.

Each role defines its own section (`engine/config.py`, `trainer/config.py`, ...) on this base;
`venusrl.config` only composes them and reads files and overrides. A leaf: imports nothing of
the package.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # A typo must never fall back to a default silently (DESIGN.md contract 6).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def torch_device(value: str) -> str:
    """A device string torch can parse ("cpu", "cuda", "cuda:1"); whether the device exists is
    known only where the run starts."""
    import torch  # only when a device is checked: reading a config needs no torch

    try:
        torch.device(value)
    except RuntimeError:
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N, ...)") from None
    return value
