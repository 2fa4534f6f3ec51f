"""The plots of a run directory, drawn from its `metrics.jsonl` and `trajectories.jsonl`:

- `reward.png`: the training reward of every step and its moving mean (single steps are noisy:
  a step holds only B groups, and a group's reward depends on its task as much as on the policy);
- `timeline.png`: over the run's time, how many requests were in the engine (sent, tokens not yet
  back) and how many trajectories waited on their environment (tool calls), with the spans where the
  engine had nothing to do shaded;
- `staleness.png`: per trainer step, the share of the batch's model tokens produced 0, 1, 2 ...
  weight versions behind the policy being trained (the paper's Fig. 12).

    venusrl plot RUN_DIR        (`venusrl train` draws them when it finishes)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from venusrl.runtime.record import read_metrics, read_records


def plot_run(run_dir: Path) -> list[Path]:
    """Draw the plots into `run_dir/plots/` and return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training machine
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists():
        raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl: not a run directory")
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{metrics_file} is empty: the run has not finished a step yet")
    records = list(read_records(run_dir))
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    paths = [_reward(metrics, out / "reward.png")]
    if records:
        paths += [_timeline(records, out / "timeline.png"), _staleness(metrics, records, out)]
    return paths


def _reward(metrics: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics if m["reward_mean"] is not None]
    rewards = np.array([m["reward_mean"] for m in metrics if m["reward_mean"] is not None])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, rewards, ".", alpha=0.4, label="step (sampled episodes)")
    window = min(10, len(rewards))
    if window > 1:
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, "-", label=f"mean of {window} steps")
    ax.set(xlabel="trainer step", ylabel="reward", ylim=(-0.02, 1.02), title="Training reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _counts(spans: list[tuple[float, float]], grid: np.ndarray) -> np.ndarray:
    """How many of `spans` cover each time of `grid`."""
    starts = np.sort([s for s, _ in spans])
    ends = np.sort([e for _, e in spans])
    return np.searchsorted(starts, grid, side="right") - np.searchsorted(ends, grid, side="right")


def _timeline(records: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    turns = [t for r in records for t in r["turns"] if "requested" in t]
    generating = [(t["requested"], t["generated"]) for t in turns]
    acting = [(t["generated"], t["acted"]) for t in turns]
    fig, ax = plt.subplots(figsize=(10, 4))
    if turns:
        end = max(t["acted"] for t in turns)
        grid = np.linspace(0.0, end, min(20_000, max(200, int(end * 20))))
        in_engine = _counts(generating, grid)
        ax.plot(grid, in_engine, lw=0.8, label="requests in the engine")
        ax.plot(grid, _counts(acting, grid), lw=0.8, label="trajectories waiting on tools")
        ax.fill_between(
            grid, 0, 1, where=in_engine == 0, transform=ax.get_xaxis_transform(),
            color="0.85", label="engine idle",
        )  # fmt: skip
    ax.set(xlabel="seconds since the run started", ylabel="trajectories", title="Timeline")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _staleness(
    metrics: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], out: Path
) -> Path:
    import matplotlib.pyplot as plt

    # The policy trained at a step has the version before the step's update.
    trained = {m["step"]: m["weight_version"] - 1 for m in metrics}
    steps = sorted(trained)
    rows: dict[int, dict[int, int]] = {s: {} for s in steps}
    for r in records:
        if r["step"] not in rows:
            continue
        for version, n in r["versions"].items():
            lag = max(0, trained[r["step"]] - int(version))
            rows[r["step"]][lag] = rows[r["step"]].get(lag, 0) + n
    depth = max((lag for row in rows.values() for lag in row), default=0) + 1
    share = np.zeros((depth, len(steps)))
    for j, s in enumerate(steps):
        total = sum(rows[s].values())
        for lag, n in rows[s].items():
            share[lag, j] = n / total if total else 0.0
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.5 * depth))
    image = ax.imshow(
        share, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1, interpolation="none",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, depth - 0.5),
    )  # fmt: skip
    ax.set_yticks(range(depth))
    ax.set(xlabel="trainer step", ylabel="versions behind", title="Staleness of trained tokens")
    fig.colorbar(image, ax=ax, label="share of the step's model tokens")
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
