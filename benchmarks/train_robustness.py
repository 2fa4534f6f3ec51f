"""Does `venusrl train` learn the same through a crash, through failures, and over HTTP?

The built-in CPU example (every default but `run.steps`), one `venusrl train` process per run, one
run after another, on the same seed:

  plain            uninterrupted
  resumed          killed with SIGKILL once half of its steps are in `metrics.jsonl`, then
                   `venusrl train --resume` on the same run directory
  faults           10 % of sandboxes killed at random and 5 % of engine calls failed
                   (`faults.kill_sandboxes=0.1 faults.engine_errors=0.05`)
  local_from_start RL only (no warm start) from plain's `start-model/`, in-process engine
  http_from_start  the same against `venusrl serve` in a separate process (`run.engine_url`)

Prints one JSON object: per run the training reward of the first and last `--window` steps
(sampled, temperature 1) and their gain, whether the steps are consecutive with none repeated,
the largest mean staleness of a step (at most `rollout.max_staleness`), the infrastructure
failures and masked members the metrics count, and `failed_scored`, the recorded trajectories
that failed for the platform yet carry a reward (0 when no failure is scored as a loss); then the
gaps between the final windows of the pairs that should agree (`resumed` and `faults` against
`plain`, `http_from_start` against `local_from_start`). One seed per run, so gaps of 0.1-0.2 are
within run-to-run noise (BENCHMARKS.md).

    python benchmarks/train_robustness.py [--steps 60] [--window 10] [--seed 0]
        [-- extra k=v overrides, given to every run]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRAIN = [sys.executable, "-m", "venusrl.cli", "train"]
FAULTS = ["faults.kill_sandboxes=0.1", "faults.engine_errors=0.05"]


def venusrl_train(
    run_dir: Path, flags: list[str], overrides: list[str], kill_after_steps: int | None = None
) -> float:
    """Runs `venusrl train` to the end (killing it once and resuming, when asked); wall seconds."""
    cmd = [*TRAIN, "--run-dir", str(run_dir), *flags, *overrides]  # k=v after every flag
    started = time.monotonic()
    if kill_after_steps is not None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= kill_after_steps:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        if proc.wait() != -signal.SIGKILL:
            raise SystemExit(f"{run_dir.name}: ended (exit {proc.returncode}) before it was killed")
        cmd = [*cmd, "--resume"]
    proc_done = subprocess.run(cmd, capture_output=True, text=True)
    if proc_done.returncode != 0:
        raise SystemExit(f"{run_dir.name}: venusrl train failed:\n{proc_done.stderr[-3000:]}")
    return time.monotonic() - started


def summary(run_dir: Path, window: int, wall_s: float) -> dict[str, Any]:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [s["reward_mean"] or 0.0 for s in steps]
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").open()]
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    return {
        "wall_s": round(wall_s, 1),
        "steps": len(steps),
        "steps_consecutive": [s["step"] for s in steps] == list(range(len(steps))),
        "reward_first": round(first, 3),
        "reward_last": round(last, 3),
        "gain": round(last - first, 3),
        "staleness_max": max(s["staleness_mean"] for s in steps),  # bounded by max_staleness
        "infra_failures": sum(s["infra_failures"] for s in steps),
        "masked": sum(s["masked"] for s in steps),
        "failed_scored": sum(r["finish"] == "infra" and r["reward"] is not None for r in records),
    }


def serve(model_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "venusrl.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "engine.threads=1"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"venusrl serve did not answer at {url} within 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a tmp dir)")
    p.add_argument("overrides", nargs="*", help="config overrides given to every run")
    args = p.parse_args()
    if args.steps < 2 * args.window:
        raise SystemExit("--steps must hold two windows")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = args.out or Path(tempfile.mkdtemp(prefix="venusrl-robustness-"))
    base = ["run.checkpoint_every=5", *args.overrides]  # a checkpoint to resume from, by default
    base += [f"run.seed={args.seed}", f"run.steps={args.steps}"]
    runs: dict[str, dict[str, Any]] = {}

    def run(
        name: str, extra: list[str], kill_after: int | None = None, model: Path | None = None
    ) -> None:
        flags = [] if model is None else ["--model", str(model)]
        wall = venusrl_train(out / name, flags, [*base, *extra], kill_after)
        runs[name] = summary(out / name, args.window, wall)

    run("plain", [])
    run("resumed", [], kill_after=args.steps // 2)
    run("faults", FAULTS)
    start = out / "plain" / "start-model"
    run("local_from_start", ["run.warm_start_episodes=0"], model=start)
    server, url = serve(start)
    try:
        run("http_from_start", ["run.warm_start_episodes=0", f"run.engine_url={url}"], model=start)
    finally:
        server.terminate()
        server.wait(30)

    def gap(a: str, b: str) -> float:
        return round(runs[a]["reward_last"] - runs[b]["reward_last"], 3)

    print(
        json.dumps(
            {
                "reward": "training reward: sampled episodes (temperature 1), mean per step",
                "runs": runs,
                "last_gap_resumed_vs_plain": gap("resumed", "plain"),
                "last_gap_faults_vs_plain": gap("faults", "plain"),
                "last_gap_http_vs_local": gap("http_from_start", "local_from_start"),
                "out": str(out),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
