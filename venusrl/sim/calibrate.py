"""Fit the cost model's constants to our own engine, and check them on shapes the fit did not see.

Decode iterations are timed on a grid of (batch, context) and prefill iterations on a grid of
(new tokens, cached prefix), on the real `Engine` (CPU here; the same code on a GPU when one is
lent). Each shape's time is the fastest of several runs, taken in rounds that visit every shape
in turn: on a shared machine the slower runs measure the neighbours, and a neighbour busy for a
while would otherwise land on whichever shapes were being timed then (one pass per shape swung
held-back errors from 17 % to 80 % between runs). The cost model's formulas are linear in their
unknowns:

    decode  = T_fix + W / BW_w + batch * t_request + sum(ctx) * kv / BW_kv
    prefill = T_fix + new * 2 N / F_gemm + A * new * (prefix + new / 2) / F_attn

so least squares on the fitting shapes gives T_fix, BW_w, t_request, BW_kv, F_gemm and F_attn, and
the relative errors on the held-back shapes say whether the model describes the engine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.model.directory import read_model_config
from venusrl.sim.cost_model import CostModel, GpuSpec, ModelSpec
from venusrl.types import SamplingParams


@dataclass(frozen=True)
class Sample:
    kind: str  # "decode" | "prefill"
    a: int  # decode: batch; prefill: new tokens
    b: int  # decode: context tokens summed over the batch; prefill: cached prefix
    seconds: float


def model_spec(model_dir: Path, bytes_per_param: int = 4) -> ModelSpec:
    cfg = read_model_config(model_dir)
    h, L = cfg.hidden_size, cfg.num_layers
    attn = h * cfg.num_heads * cfg.head_dim * 2 + h * cfg.num_kv_heads * cfg.head_dim * 2
    params = L * (attn + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h
    return ModelSpec(model_dir.name, float(params), L, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim, bytes_per_param)  # fmt: skip


def _engine(model_dir: Path, threads: int, budget: int) -> Engine:
    cfg = EngineConfig(threads=threads, page_size=16, token_budget=budget, max_running=256)
    engine = Engine.from_model_dir(model_dir, cfg)
    # A fresh engine's first passes allocate and warm caches: not what an iteration costs.
    engine.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return engine


def measure_decode(
    model_dir: Path, batch: int, context: int, threads: int, steps: int = 12
) -> Sample:
    engine = _engine(model_dir, threads, budget=max(batch * context, 256))
    vocab = engine.model.config.vocab_size
    rng = random.Random(batch * 100_003 + context)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
            for _ in range(batch)]  # fmt: skip
    while any(r.tokens_to_compute > 1 or not r.output_ids for r in reqs):
        engine.step()  # prefill, and the first decode compiles nothing but warms caches
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    ctx = sum(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
    return Sample("decode", batch, ctx, min(times))


def measure_prefill(model_dir: Path, new: int, prefix: int, threads: int, reps: int = 2) -> Sample:
    times = []
    for rep in range(reps):
        engine = _engine(model_dir, threads, budget=max(new + prefix, 256))
        vocab = engine.model.config.vocab_size
        rng = random.Random(new * 7919 + prefix * 31 + rep)
        head = [rng.randrange(vocab) for _ in range(prefix)]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        if prefix:
            engine.generate([head], one)  # now cached
        engine.add_request(head + [rng.randrange(vocab) for _ in range(new)], one)
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return Sample("prefill", new, prefix, min(times))


def measure(model_dir: Path, shapes: Sequence[tuple[str, int, int]], threads: int,
            rounds: int) -> list[Sample]:  # fmt: skip
    """Each shape's fastest time over `rounds` visits of all of them."""
    best: dict[tuple[str, int, int], Sample] = {}
    for _ in range(rounds):
        for shape in shapes:
            kind, a, b = shape
            run = measure_decode if kind == "decode" else measure_prefill
            s = run(model_dir, a, b, threads)
            if shape not in best or s.seconds < best[shape].seconds:
                best[shape] = s
    return [best[shape] for shape in shapes]


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x v - y| over v >= 0, by dropping the most negative unknown until none is (enough
    for six unknowns). Every constant is a time per unit of something, so none can be negative;
    clamping a negative one after an unconstrained fit moved every prediction that uses it."""
    free = list(range(x.shape[1]))
    while True:
        v = np.zeros(x.shape[1])
        v[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        negative = [i for i in free if v[i] < 0]
        if not negative:
            return v
        free.remove(min(negative, key=lambda i: v[i]))


def fit(model: ModelSpec, samples: Sequence[Sample]) -> CostModel:
    """One least-squares problem over both kinds, so that T_fix is shared as the formulas share
    it, in relative terms (each row divided by its measured time): a 5 ms decode weighs as much as
    a 100 ms prefill. Fitting the kinds apart let a noisy prefill intercept swallow the decode's
    whole weight-reading term."""
    rows, times = [], []
    for s in samples:
        if s.kind == "decode":
            rows.append([1.0, 1.0, s.a, s.b, 0.0, 0.0])
        else:
            rows.append([1.0, 0.0, 0.0, 0.0, s.a, s.a * (s.b + s.a / 2)])
        times.append(s.seconds)
    x = np.array(rows) / np.array(times)[:, None]
    solution = nonnegative_least_squares(x, np.ones(len(times)))
    t_fix, weights_s, t_request, per_ctx, per_new, per_attn = (float(v) for v in solution)
    t_fix = max(t_fix, 1e-6)
    eps = 1e-12
    gpu = GpuSpec(
        "calibrated",
        hbm_bytes=0.0,
        bw_weights=model.weight_bytes / max(weights_s, eps),
        bw_kv=model.kv_bytes_per_token / max(per_ctx, eps),
        f_gemm=2 * model.params / max(per_new, eps),
        f_attn=model.attention_flops_factor / max(per_attn, eps),
        peak_flops=0.0,
        pcie_h2d=0.0,
        pcie_d2h=0.0,
        t_fix=t_fix,
        t_per_request=t_request,
    )
    return CostModel(model, gpu)


def predict(cost: CostModel, s: Sample) -> float:
    if s.kind == "decode":
        return cost.decode_step_s(s.a, s.b)
    return cost.gpu.t_fix + cost.prefill_s(s.a, s.b)


DECODE_FIT = [(1, 64), (4, 64), (16, 64), (1, 512), (8, 256), (16, 512), (32, 128), (4, 1024)]
DECODE_HELD = [(2, 128), (8, 64), (12, 384), (24, 256)]
PREFILL_FIT = [(64, 0), (256, 0), (1024, 0), (64, 512), (256, 1024), (512, 256)]
PREFILL_HELD = [(128, 0), (512, 0), (128, 256), (384, 512)]


def calibrate(model_dir: Path, threads: int = 1, rounds: int = 3) -> dict[str, Any]:
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    torch.set_num_threads(threads)
    spec = model_spec(model_dir)
    fitting = [("decode", *s) for s in DECODE_FIT] + [("prefill", *s) for s in PREFILL_FIT]
    held_back = [("decode", *s) for s in DECODE_HELD] + [("prefill", *s) for s in PREFILL_HELD]
    samples = measure(model_dir, fitting + held_back, threads, rounds)
    fit_samples, held = samples[: len(fitting)], samples[len(fitting) :]
    cost = fit(spec, fit_samples)
    errors: list[dict[str, Any]] = [
        {"kind": s.kind, "shape": [s.a, s.b], "measured_s": s.seconds,
         "predicted_s": predict(cost, s), "error": predict(cost, s) / s.seconds - 1}
        for s in held
    ]  # fmt: skip
    g = cost.gpu
    return {
        "model": {
            "params": spec.params,
            "layers": spec.layers,
            "kv_bytes": spec.kv_bytes_per_token,
        },
        "constants": {
            "t_fix_s": g.t_fix,
            "t_per_request_s": g.t_per_request,
            "bw_weights": g.bw_weights,
            "bw_kv": g.bw_kv,
            "f_gemm": g.f_gemm,
            "f_attn": g.f_attn,
        },
        "held_back": errors,
        "max_abs_error": max(abs(float(e["error"])) for e in errors),
    }
