"""How long GPU work takes: the formulas and constants of WORKLOADS.md, each a named parameter.

One rollout engine is one model on `tp` GPUs. Decode is memory-bound (every step reads the
weights and the resident KV of the batch), prefill compute-bound (GEMMs over the new tokens plus
attention over the prefix), host<->device KV copies are bound by PCIe, and a trainer step by
FLOPs at a model FLOPs utilisation. Constants tagged [V] were read in a public source, [D] derived
from one, [A] are assumptions: `venusrl.sim.calibrate` fits the same formulas to our engine's
measured iterations (on CPU here; the GPU constants wait for a GPU to measure them on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from venusrl.sim.settings import key_values

GB = 1e9
TB = 1e12


def parse_overrides(text: str) -> dict[str, float]:
    """ "KEY=VALUE,..." (`--cost`) as numbers for `CostModel.overridden` (`inf` too);
    ValueError names a bad one."""
    settings: dict[str, float] = {}
    for key, value in key_values(text).items():
        try:
            settings[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}: needs a number, got {value!r}") from None
    return settings


# Constants `CostModel.overridden` may set to 0 (times and sizes added, not divided by), and
# the shares, at most 1; every other constant is a size or rate > 0.
MAY_BE_ZERO = frozenset(("reserved_bytes", "transfer_latency_s", "host_kv_bytes_per_gpu",
                         "weight_sync_fixed_s", "t_fix", "t_per_request"))  # fmt: skip
SHARES = frozenset(("memory_fraction", "train_mfu"))


def numeric_fields(spec: object) -> list[str]:
    """The fields of a cost model's dataclass that hold numbers (not `tp`: the workload's)."""
    return [
        f.name
        for f in fields(spec)  # type: ignore[arg-type]
        if isinstance(getattr(spec, f.name), int | float) and f.name != "tp"
    ]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float  # N
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:  # W
        return self.params * self.bytes_per_param

    @cached_property  # read for every KV copy the simulator makes
    def kv_bytes_per_token(self) -> float:  # kv: K and V of every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @cached_property
    def attention_flops_factor(self) -> float:  # A = 4 * layers * q_heads * head_dim
        return 4 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: float
    bw_weights: float  # bytes/s a decode step reads weights at (BW_w)
    bw_kv: float  # bytes/s it reads resident KV at (BW_kv)
    f_gemm: float  # FLOP/s of prefill GEMMs (F_gemm)
    f_attn: float  # FLOP/s of prefill attention (F_attn)
    peak_flops: float  # bf16 dense peak, for the trainer's MFU
    pcie_h2d: float  # bytes/s host to device (B_pcie)
    pcie_d2h: float
    t_fix: float = 0.8e-3  # s of fixed overhead per engine iteration [A]
    t_per_request: float = 0.0  # s per request per iteration (sampling, bookkeeping) [A]


MODELS = {
    # Qwen3-4B: 36 layers, 32 query heads, 8 KV heads x 128, 4.0 B params [V: its config.json].
    "qwen3-4b": ModelSpec("qwen3-4b", 4.0e9, 36, 32, 8, 128),
    # Qwen3-32B: 64 layers, 64 query heads, 8 KV heads x 128, 32.8 B params [V].
    "qwen3-32b": ModelSpec("qwen3-32b", 32.8e9, 64, 64, 8, 128),
}

GPUS = {
    # H200: 141 GB, 4.8 TB/s peak (~4.3 copy), 989 TFLOP/s bf16 (~790 matmul) [V]; the effective
    # rates below are WORKLOADS.md's starting values; PCIe 35 GB/s H2D, 53 D2H measured [V].
    "h200": GpuSpec("h200", 141 * GB, 3.36 * TB, 2.9 * TB, 650 * TB, 450 * TB, 989 * TB,
                    35 * GB, 53 * GB),
    # H100 SXM: 80 GB, 3.35 TB/s, the same 989 TFLOP/s [V]; rates scaled from H200 by the
    # bandwidth ratio 3.35/4.8 for memory-bound terms, equal for compute [D].
    "h100": GpuSpec("h100", 80 * GB, 2.35 * TB, 2.02 * TB, 650 * TB, 450 * TB, 989 * TB,
                    35 * GB, 53 * GB),
}  # fmt: skip


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    reserved_bytes: float = 6 * GB  # activations, CUDA graphs, fragmentation [A]
    memory_fraction: float = 0.9  # of HBM the engine takes [A]
    transfer_latency_s: float = 1e-3  # fixed cost of one host<->device copy [A]
    host_kv_bytes_per_gpu: float = 128 * GB  # host RAM for offloaded KV: half of 2 TB / 8 GPUs [A]
    train_mfu: float = 0.40  # WORKLOADS.md: 35-45 % [A]
    weight_sync_bytes_per_s: float = 25 * GB  # trainer -> engines broadcast [A]
    weight_sync_fixed_s: float = 2.0  # pause, gather, reload [A]

    @classmethod
    def preset(cls, model: str, gpu: str, tp: int = 1, **overrides: Any) -> CostModel:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
        return replace(cls(MODELS[model], GPUS[gpu], tp), **overrides)

    def overridden(self, settings: Mapping[str, float]) -> CostModel:
        """This cost model with some constants set: `FIELD` of the cost model, `gpu.FIELD` or
        `model.FIELD` (sizes and rates > 0, shares in (0, 1], fixed times >= 0; a rate may be
        `inf`: copies or steps that cost nothing), to see what a figure owes to one constant
        (`sim_scenarios.py --cost`). ValueError names a bad one."""
        specs: dict[str, Any] = {"": self, "gpu": self.gpu, "model": self.model}
        parts: dict[str, dict[str, Any]] = {part: {} for part in specs}
        for key, value in settings.items():
            part, _, name = key.rpartition(".")
            if part not in specs or name not in numeric_fields(specs[part]):
                known = [
                    f"{p}.{n}".lstrip(".") for p, s in specs.items() for n in numeric_fields(s)
                ]
                raise ValueError(
                    f"{key}: not a constant of the cost model; known: {', '.join(known)}"
                )
            current = getattr(specs[part], name)
            least = 0 if name in MAY_BE_ZERO else math.ulp(0)
            if not least <= value <= (1 if name in SHARES else math.inf) or (
                isinstance(current, int) and not (math.isfinite(value) and value == int(value))
            ):
                kind = "an integer" if isinstance(current, int) else "a number"
                bounds = "in (0, 1]" if name in SHARES else ">= 0" if least == 0 else "> 0"
                raise ValueError(f"{key}: needs {kind} {bounds}, got {value}")
            parts[part][name] = type(current)(value)
        gpu, model = replace(self.gpu, **parts["gpu"]), replace(self.model, **parts["model"])
        cost = replace(self, gpu=gpu, model=model, **parts[""])
        cost.kv_capacity_tokens  # noqa: B018 (a model that no longer fits says so now)
        return cost

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one engine holds on device: (0.9 HBM - W/tp - 6 GB) / (kv/tp)."""
        free = self.memory_fraction * self.gpu.hbm_bytes - self.model.weight_bytes / self.tp
        free -= self.reserved_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit {self.tp} x {self.gpu.name}")
        return int(free / (self.model.kv_bytes_per_token / self.tp))

    @property
    def host_capacity_tokens(self) -> int:
        """KV tokens one engine can keep in host memory."""
        return int(self.host_kv_bytes_per_gpu * self.tp / self.model.kv_bytes_per_token)

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """One decode iteration of `batch` requests whose contexts sum to `context_tokens`."""
        if batch == 0:
            return 0.0
        fixed, kv_bytes, kv_rate, per_request = self._decode_terms
        return fixed + context_tokens * kv_bytes / kv_rate + batch * per_request

    def decode_s(self, iterations: float, tokens: float, reads: float) -> float:
        """`iterations` decode iterations that generate `tokens` tokens in all, reading `reads`
        KV tokens in all (`decode_step_s` summed, in the terms that add up)."""
        fixed, kv_bytes, kv_rate, per_request = self._decode_terms
        return iterations * fixed + reads * kv_bytes / kv_rate + tokens * per_request

    @cached_property  # the simulator costs every iteration: what does not change, once
    def _decode_terms(self) -> tuple[float, float, float, float]:
        """t_fix + W / (tp BW_w), kv, tp BW_kv, t_per_request."""
        weights = self.model.weight_bytes / (self.tp * self.gpu.bw_weights)
        return (
            self.gpu.t_fix + weights,
            self.model.kv_bytes_per_token,
            self.tp * self.gpu.bw_kv,
            self.gpu.t_per_request,
        )

    def prefill_s(self, new_tokens: float, prefix_tokens: float) -> float:
        """Computing `new_tokens` after `prefix_tokens` already in KV (one request's chunk)."""
        if new_tokens <= 0:
            return 0.0
        gemm = 2 * self.model.params * new_tokens / self.gpu.f_gemm
        attn = (
            self.model.attention_flops_factor
            * new_tokens
            * (prefix_tokens + new_tokens / 2)
            / self.gpu.f_attn
        )
        return (gemm + attn) / self.tp

    def transfer_s(self, tokens: float, to_device: bool) -> float:
        """Moving `tokens` of KV between host and device memory."""
        if tokens <= 0:
            return 0.0
        kv_bytes, h2d, d2h, latency = self._transfer_terms
        return tokens * kv_bytes / (h2d if to_device else d2h) + latency

    @cached_property
    def _transfer_terms(self) -> tuple[float, float, float, float]:
        """kv, tp B_h2d, tp B_d2h, the fixed latency."""
        tp, gpu = self.tp, self.gpu
        kv = self.model.kv_bytes_per_token
        return kv, tp * gpu.pcie_h2d, tp * gpu.pcie_d2h, self.transfer_latency_s

    def train_s(self, tokens: float, mean_sequence: float, gpus: int) -> float:
        """A trainer step over `tokens`: (10 N + 2.5 A S) FLOPs per token at `train_mfu`
        (forward and backward 6 N, the old and reference log-probabilities 2 N each)."""
        flops = tokens * (
            10 * self.model.params + 2.5 * self.model.attention_flops_factor * mean_sequence
        )
        return flops / (gpus * self.gpu.peak_flops * self.train_mfu)

    def weight_sync_s(self) -> float:
        return self.weight_sync_fixed_s + self.model.weight_bytes / self.weight_sync_bytes_per_s
