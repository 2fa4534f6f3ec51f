"""Rewards scored inline against the reward workers, on `venusrl train`, side by side.

The CPU example (treasure_hunt, the micro model, its warm start, K=8, B=4) graded the way SWE
tasks are: after the episode's own reward, "its test suite" runs in its sandbox, `--grade-cpu-s`
seconds of CPU (a busy loop on the sandbox's interpreter, bounded by its CPU time, not by the
clock). Each pair runs `venusrl train` twice with the same seed and config,
`reward.placement=inline` (every reward in its episode, all at once, holding its places: its
admission slot with `--admission aimd`, its KV-window place until its tool-wait timer lets it go
with the default `critical`: what RL frameworks do) and `reward.placement=pool`
(`reward.workers` at a time, the most critical group's first, the places given up as the turns
end), in alternating order.

Prints one JSON object: per placement the mean step time (steps 1 on, wall clock between step
lines), the share of the step the trainer waited on rewards alone (`reward_wait_share`), the
reward latency p50/p95, the mean reward; per pair the ratio inline / pool of the step time; and
their mean.

    python benchmarks/reward_workers.py [--pairs 2] [--steps 8] [--grade-cpu-s 1.0]
        [--workers 2] [--admission critical|aimd|none] [-- extra k=v overrides]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.config import load_config  # noqa: E402
from venusrl.envs.builtin.treasure_hunt import TreasureHunt  # noqa: E402
from venusrl.runtime.train import train  # noqa: E402

# --grade-cpu-s, read where the run loads this file as its environment's module.
GRADE_CPU_S_VAR = "VENUSRL_BENCH_GRADE_CPU_S"
# Burns the given CPU seconds in the sandbox's own process, as a test suite does.
BURN = """
import time
t0 = time.process_time()
x = 0
while time.process_time() - t0 < {seconds}:
    x += 1
"""


class GradedHunt(TreasureHunt):
    """treasure_hunt whose reward also runs the task's tests: seconds of CPU per trajectory."""

    name = "graded_hunt"

    async def reward(self) -> float:
        found = await super().reward()
        seconds = float(os.environ.get(GRADE_CPU_S_VAR, "1.0"))
        ran = await self.sandbox.run_python(
            BURN.format(seconds=seconds), timeout_s=seconds * 30 + 30
        )
        if ran.exit_code != 0:
            raise RuntimeError(f"the test suite failed to run: {ran.stderr.decode()[-300:]}")
        return found


def config(placement: str, args: argparse.Namespace) -> Any:
    overrides = [
        f"rollout.env={Path(__file__).resolve()}:GradedHunt",
        f"reward.placement={placement}",
        f"reward.workers={args.workers}",
        f"rollout.admission={args.admission}",
        f"run.steps={args.steps}",
        f"run.seed={args.seed}",
        "run.checkpoint_every=1000",
        *args.overrides,
    ]
    return load_config(ROOT / "examples/cpu-treasure-hunt.yaml", overrides)


def one_run(placement: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="venusrl-reward-bench-") as tmp:
        metrics = asyncio.run(train(config(placement, args), Path(tmp) / "run"))
    walls = [m["wall_s"] for m in metrics]
    steps = [b - a for a, b in itertools.pairwise(walls)]  # from step 1 on
    rewards = [m["reward_mean"] for m in metrics if m["reward_mean"] is not None]
    p50 = [m["reward_p50_s"] for m in metrics if m["reward_p50_s"] is not None]
    p95 = [m["reward_p95_s"] for m in metrics if m["reward_p95_s"] is not None]
    return {
        "step_s": round(statistics.mean(steps), 3),
        "reward_wait_share": round(statistics.mean(m["reward_wait_share"] for m in metrics), 3),
        "reward_p50_s": round(statistics.median(p50), 3) if p50 else None,
        "reward_p95_s": round(max(p95), 3) if p95 else None,
        "reward_mean": round(statistics.mean(rewards), 3) if rewards else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--grade-cpu-s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2, help="reward.workers of the pool")
    parser.add_argument(
        "--admission",
        default="critical",
        choices=["critical", "aimd", "none"],
        help="rollout.admission: critical (the default: the KV window, turn by turn) or aimd"
        " (a bound on the episodes that run at once, as peers bound their agent loops)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="k=v config overrides, after --")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ[GRADE_CPU_S_VAR] = str(args.grade_cpu_s)
    runs: dict[str, list[dict[str, Any]]] = {"inline": [], "pool": []}
    for pair in range(args.pairs):
        order = ["inline", "pool"] if pair % 2 == 0 else ["pool", "inline"]
        for placement in order:
            runs[placement].append(one_run(placement, args))
    ratios = [
        round(i["step_s"] / p["step_s"], 3)
        for i, p in zip(runs["inline"], runs["pool"], strict=True)
    ]
    print(
        json.dumps(
            {
                "grade_cpu_s": args.grade_cpu_s,
                "admission": args.admission,
                "workers": args.workers,
                "steps": args.steps,
                "inline": runs["inline"],
                "pool": runs["pool"],
                "step_time_ratio_inline_over_pool": ratios,
                "ratio_mean": round(statistics.mean(ratios), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
