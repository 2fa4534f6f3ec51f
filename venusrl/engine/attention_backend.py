"""Which attention the engine's model runs (`engine.attention_backend`).

A backend is one function with `attention.paged_attention`'s contract: write the step's keys and
values into their slots, attend, return `[tokens, heads * dim]`. `torch` (attention.py) runs
anywhere and is the reference; `triton` (triton_attention.py) reads KV pages in place on CUDA.
"""

from __future__ import annotations

import importlib
import os
from typing import Literal, Protocol

import torch

from venusrl.engine.attention import HostReads, StepBatch, paged_attention

BackendName = Literal["auto", "torch", "triton"]


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: StepBatch,
        layer: int = 0,
        host: HostReads | None = None,
    ) -> torch.Tensor: ...


def attention_backend(name: BackendName, device: torch.device) -> AttentionBackend:
    """`auto` is triton on CUDA when triton imports, torch otherwise."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return paged_attention
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"engine.attention_backend=triton needs a CUDA device, got engine.device={device}"
            " (or TRITON_INTERPRET=1: Triton's interpreter, for tests)"
        )
    try:
        # Imported only here: importing triton costs ~1 s, and a CPU engine never needs it.
        module = importlib.import_module("venusrl.engine.triton_attention")
    except ImportError as e:
        if name == "auto":
            return paged_attention
        raise ValueError(
            f"engine.attention_backend=triton: triton does not import ({e}); "
            "install venusrl[gpu] or use attention_backend=torch"
        ) from e
    backend: AttentionBackend = module.triton_paged_attention
    return backend
