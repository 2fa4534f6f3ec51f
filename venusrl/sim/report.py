"""Figures over seeds: each seed's, their median and the worst, so that one favourable seed cannot
carry a claim (`venusrl sim --seeds`, `benchmarks/sim_scenarios.py`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Each ratio of one policy's figure to another's ("ours is Nx the other": the other's seconds
# over ours), by the prefix of its key: `speedup_vs_<other>` and so on.
SPEEDUPS = {
    "speedup_vs_": "mean_step_s",  # the steps after the first (which only fills the pipeline)
    "uncut_speedup_vs_": "s_per_uncut_sample",  # per trained sample not cut at the time limit
    "token_speedup_vs_": "s_per_trained_mtoken",  # per token trained (batches differ in size)
    "run_speedup_vs_": "run_s",  # the whole run, to its last step, the first step included
}


def speedups(results: Sequence[dict[str, Any]]) -> None:
    """Add to each of `results` (one seed's runs, one per policy) its `SPEEDUPS` over every
    other, where both have the figure."""
    for r in results:
        for other in results:
            for prefix, figure in SPEEDUPS.items():
                if other is not r and r[figure] and other[figure]:
                    r[f"{prefix}{other['policy']}"] = other[figure] / r[figure]


def spread(values: Sequence[float], worst: Callable[[Sequence[float]], float]) -> dict[str, Any]:
    """`values` by seed, in order, their median and the `worst` of them."""
    return {"per_seed": list(values), "median": statistics.median(values), "worst": worst(values)}


def over_seeds(runs: Mapping[Any, Sequence[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy, from `runs` (seed -> `simulate`'s results, the policies in the same order):
    its mean step time (the worst: the longest) and its speedup over every other policy (the
    worst: the smallest), for each seed, with the median and the worst; so for each of
    `SPEEDUPS`; and its `floor_headroom`."""
    seeds = list(runs)
    names = [r["policy"] for r in runs[seeds[0]]]
    summary: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        per_seed = [runs[s][i] for s in seeds]
        row = {"mean_step_s": spread([r["mean_step_s"] for r in per_seed], max)}
        if all(r["mean_step_s"] and r["work_floor_step_s"] for r in per_seed):
            # Its step over the GPU work its samples need (`work_floor`): the most a schedule
            # could gain where rollout sets the pace (the worst: the largest, most to gain).
            ratios = [r["mean_step_s"] / r["work_floor_step_s"] for r in per_seed]
            row["floor_headroom"] = spread(ratios, max)
        for other in names:
            for key in (prefix + other for prefix in SPEEDUPS):
                if other != name and all(key in r for r in per_seed):
                    row[key] = spread([r[key] for r in per_seed], min)
        summary[name] = row
    return summary


def parse_seeds(text: str) -> list[int]:
    """Comma-separated workload seeds, each once (a seed twice would count its run twice)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds: comma-separated integers, got {text!r}") from None
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds: a seed listed twice in {text!r} would count its run twice")
    return seeds


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The value below which a share `q` of `sorted_values` lies (the one at index q n): the
    percentiles of the simulator's figures, of the step line's reward latency and of the e2e
    benchmark's group completion."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
