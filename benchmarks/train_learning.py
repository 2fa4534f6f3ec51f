"""Does `venusrl train` learn? The built-in CPU example, once per seed, timed from the command line.

Runs `venusrl train` (the default config: the micro model on treasure_hunt, warm start, then GRPO)
as a separate process per seed, one after another, and reads each run's `metrics.jsonl`. The
reward is the training reward: the mean over the step's sampled episodes (temperature 1), not a
greedy evaluation.

Prints one JSON object: per seed the wall time of the whole command, the warm start, the mean
reward of the first and the last `--window` steps and their difference (`gain`), and the mean
tool calls of the episodes that won (the task is multi-turn only if that stays >= 3); then the
smallest gain and the longest wall time over the seeds.

A window of 5 steps holds only 20 groups, and a group's reward depends on its task (the length of
its trail, its secret) as much as on the policy, so `gain` is noisy (about +-0.1 between runs).
With `--eval-episodes N` (default 256) each run's start policy (`start-model/`, after the warm
start) and its final checkpoint also play the same N tasks of the run's environment
(`venusrl.runtime.evaluate`, as `venusrl eval` does: the share of the tasks won, pass@1, an
episode the platform failed left out), after the run and outside its wall time, sampled at the
run's temperature (`eval_start`, `eval_final`, `eval_gain`) and greedy (the same keys with
`_greedy`): what reinforcement learning changed, measured on identical tasks.

    python benchmarks/train_learning.py [--seeds 0,1,2] [--window 5] [--eval-episodes 256]
        [-- extra k=v overrides]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def evaluate(run_dir: Path, episodes: int) -> dict[str, Any]:
    """Win rates of the start policy (`start_policy`: the warm-started model, or the one the run
    was given) and the final checkpoint on the same tasks of the run's environment, sampled at the
    run's temperature and greedy."""
    from venusrl.config import load_config
    from venusrl.envs.loading import environment_class
    from venusrl.runtime.evaluate import evaluation_tasks, play_policy, resolve_model, summarize
    from venusrl.runtime.run_dir import start_policy

    cfg = load_config(run_dir / "config.yaml", [])
    if cfg.rollout.mix:
        raise SystemExit(f"{run_dir}: evaluating a run that mixes environments is not supported")
    env = environment_class(cfg.rollout.env)
    tasks = evaluation_tasks(env, cfg.run.seed, episodes)
    final, _ = resolve_model(run_dir)  # as `venusrl eval RUN_DIR` plays it
    out: dict[str, Any] = {"eval_episodes": episodes}
    for name, temperature in (("", cfg.rollout.temperature), ("_greedy", 0.0)):
        wins = {}
        for which, model in (("start", start_policy(cfg, run_dir)), ("final", final)):
            played = asyncio.run(play_policy(model, env, tasks, cfg, temperature))
            share = summarize(played, samples=1, k=1)["pass@1"]
            if share is None:
                raise SystemExit(f"{model}: no evaluation episode was scored (all failed)")
            wins[which] = share
        out |= {
            f"eval_start{name}": round(wins["start"], 3),
            f"eval_final{name}": round(wins["final"], 3),
            f"eval_gain{name}": round(wins["final"] - wins["start"], 3),
        }
    return out


def run_seed(seed: int, window: int, overrides: list[str], out: Path) -> dict[str, Any]:
    run_dir = out / f"seed-{seed}"
    cmd = [
        sys.executable, "-m", "venusrl.cli", "train", "--run-dir", str(run_dir),
        f"run.seed={seed}", *overrides,
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: venusrl train failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(steps) < 2 * window:
        raise SystemExit(f"seed {seed}: {len(steps)} steps, fewer than two windows of {window}")
    rewards = [s["reward_mean"] or 0.0 for s in steps]
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    wins = [(s["wins"], s["tool_calls_per_win"]) for s in steps if s["wins"]]
    # None: the run started from a trained model (run.warm_start_episodes=0, a LoRA run).
    warm_file = run_dir / "warm_start.json"
    warm = json.loads(warm_file.read_text()) if warm_file.exists() else None
    return {
        "seed": seed,
        "wall_s": round(wall_s, 1),
        "steps": len(steps),
        "warm_start_s": None if warm is None else round(warm["wall_s"], 1),
        "reward_first": round(first, 3),
        "reward_last": round(last, 3),
        "gain": round(last - first, 3),
        "tool_calls_per_win": round(sum(n * c for n, c in wins) / sum(n for n, _ in wins), 2)
        if wins
        else None,
        "run_dir": str(run_dir),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--window", type=int, default=5)
    p.add_argument(
        "--eval-episodes", type=int, default=256, help="0: no evaluation of start vs final"
    )
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a tmp dir)")
    p.add_argument("overrides", nargs="*", help="config overrides passed to venusrl train")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = args.out or Path(tempfile.mkdtemp(prefix="venusrl-learning-"))
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.eval_episodes < 0:
        raise SystemExit("--eval-episodes must be >= 0")
    torch.set_num_threads(1)
    runs = []
    for seed in seeds:
        run = run_seed(seed, args.window, args.overrides, out)
        if args.eval_episodes > 0:
            run |= evaluate(Path(run["run_dir"]), args.eval_episodes)
        runs.append(run)
    print(
        json.dumps(
            {
                "reward": "training reward: sampled episodes (temperature 1), mean per step",
                "runs": runs,
                "min_gain": min(r["gain"] for r in runs),
                **(
                    {"min_eval_gain": min(r["eval_gain"] for r in runs)}
                    if args.eval_episodes > 0
                    else {}
                ),
                "max_wall_s": max(r["wall_s"] for r in runs),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
