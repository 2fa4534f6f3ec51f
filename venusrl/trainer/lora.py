"""LoRA: the model's linear layers frozen, each targeted projection W trained as W + (alpha/r) B A
with A [r, in] and B [out, r] (Hu et al. 2021, arXiv:2106.09685; B starts at 0, so training
starts from the base policy). AdamW's state shrinks from 2 fp32 copies of every weight to 2 of
the adapters. The engine and the checkpoints get the merged weights (`CausalLM.hf_state_dict`
reads `Linear.merged_weight`), so what is served or published is a plain model; the adapters are
saved beside a checkpoint (`lora_adapters.pt`) for a resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from venusrl.model.architecture import CausalLM, DecoderLayer, Linear
from venusrl.trainer.config import LORA_TARGETS

# Not *.safetensors: a model directory's loader reads every such file as the model's weights.
ADAPTERS_FILE = "lora_adapters.pt"


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class LoRALinear(Linear):
    """One of the model's linear layers, its weight (and bias) frozen, with a low-rank update on
    each targeted segment of its output rows (q, k and v share one fused layer, gate and up
    another: `segments` says which rows are whose)."""

    def __init__(
        self,
        base: Linear,
        segments: dict[str, tuple[int, int]],
        rank: int,
        alpha: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.requires_grad_(False)
        self.segments = segments
        self.scale = alpha / rank
        w = base.weight
        bound = 1 / math.sqrt(base.in_features)  # nn.Linear's own init range, for A
        self.lora_A = nn.ParameterDict(
            {
                name: nn.Parameter(
                    (torch.rand(rank, base.in_features, generator=generator) * 2 - 1)
                    .mul_(bound)
                    .to(w.device, w.dtype)
                )
                for name in segments
            }
        )
        self.lora_B = nn.ParameterDict(
            {
                name: nn.Parameter(torch.zeros(hi - lo, rank, device=w.device, dtype=w.dtype))
                for name, (lo, hi) in segments.items()
            }
        )

    def pack(self) -> bool:
        self._packed = None  # forward never reads a packed base: it would miss the update
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        for name, (lo, hi) in self.segments.items():
            # x A^T B^T: two thin matmuls, never the [out, in] update (saved for backward)
            update = F.linear(F.linear(x, self.lora_A[name]), self.lora_B[name])
            out[..., lo:hi] += self.scale * update
        return out

    def weight_update(self, read: Callable[[torch.Tensor], torch.Tensor] = _as_is) -> torch.Tensor:
        """(alpha/r) B A on the targeted rows, 0 elsewhere: [out, in], no autograd. `read`
        gives a parameter's whole tensor (a sharded rank gathers it)."""
        with torch.no_grad():
            # Not `zeros_like(read(weight))`: on a sharded rank each read is a gather. A
            # DTensor's shape is the whole one.
            w = self.weight
            update = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
            for name, (lo, hi) in self.segments.items():
                update[lo:hi] = self.scale * (read(self.lora_B[name]) @ read(self.lora_A[name]))
        return update

    def merged_weight(self, read: Callable[[torch.Tensor], torch.Tensor] = _as_is) -> torch.Tensor:
        return read(self.weight.detach()) + self.weight_update(read)


def _segments(layer: DecoderLayer, targets: Sequence[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """For each of the layer's linear attributes, its targeted projections' output rows."""
    q = layer.num_heads * layer.head_dim
    kv = layer.num_kv_heads * layer.head_dim
    inter = layer.down_proj.in_features
    rows = {
        "qkv_proj": {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)},
        "o_proj": {"o_proj": (0, layer.o_proj.out_features)},
        "gate_up_proj": {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)},
        "down_proj": {"down_proj": (0, layer.down_proj.out_features)},
    }
    return {
        attr: {name: span for name, span in spans.items() if name in targets}
        for attr, spans in rows.items()
    }


def add_adapters(
    model: CausalLM, rank: int, alpha: float, targets: Sequence[str], seed: int = 0
) -> list[nn.Parameter]:
    """Freeze every weight of `model` and give each targeted projection of every layer a rank
    `rank` adapter; returns the adapters' parameters (all that is left to train)."""
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if rank < 1 or not targets or unknown:
        raise ValueError(
            f"LoRA needs a rank >= 1 (got {rank}) and targets among {LORA_TARGETS}"
            f" (got {list(targets)})"
        )
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for attr, segments in _segments(layer, targets).items():
            base = getattr(layer, attr)
            if segments and not isinstance(base, LoRALinear):
                setattr(layer, attr, LoRALinear(base, segments, rank, alpha, generator))
    for module in model.modules():  # attached before (a sharded rank's, before sharding): train
        if isinstance(module, LoRALinear):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)
    return adapter_parameters(model)


def adapter_parameters(model: CausalLM) -> list[nn.Parameter]:
    return [
        p
        for m in model.modules()
        if isinstance(m, LoRALinear)
        for p in m.parameters()
        if p.requires_grad
    ]


def _named_adapters(model: CausalLM) -> dict[str, nn.Parameter]:
    """Adapter tensors under Hugging Face-like names: `model.layers.3.self_attn.q_proj.lora_A`."""
    out: dict[str, nn.Parameter] = {}
    for i, layer in enumerate(model.layers):
        for module in layer.children():
            if isinstance(module, LoRALinear):
                for name in module.segments:
                    block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                    prefix = f"model.layers.{i}.{block}.{name}."
                    out[prefix + "lora_A"] = module.lora_A[name]
                    out[prefix + "lora_B"] = module.lora_B[name]
    return out


def save_adapters(model: CausalLM, out: Path) -> None:
    """The adapters as `out/lora_adapters.pt`; nothing when the model has none."""
    adapters = _named_adapters(model)
    if adapters:
        torch.save({k: v.detach().to("cpu") for k, v in adapters.items()}, out / ADAPTERS_FILE)


def load_adapters(model: CausalLM, checkpoint: Path) -> None:
    """Restore the adapters a checkpoint was saved with. Its `model.safetensors` holds merged
    weights, which `model` was loaded from: the base becomes merged - (alpha/r) B A, so that the
    model computes with the checkpoint's weights (to float rounding) and trains on from its
    adapters."""
    path, adapters = checkpoint / ADAPTERS_FILE, _named_adapters(model)
    if not path.exists():
        if adapters:
            raise ValueError(
                f"{checkpoint} has no {ADAPTERS_FILE}: it was written without LoRA"
                " (trainer.lora_rank must be 0 to resume it)"
            )
        return
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if set(saved) != set(adapters) or any(saved[k].shape != v.shape for k, v in adapters.items()):
        raise ValueError(
            f"{path}: its adapters do not match trainer.lora_rank and trainer.lora_targets"
            f" ({len(saved)} tensors saved, {len(adapters)} configured)"
        )
    with torch.no_grad():
        for k, v in adapters.items():
            v.copy_(saved[k])
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.weight.sub_(module.weight_update())
