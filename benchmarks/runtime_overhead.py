"""What the Ray runtime costs per trainer step, against one process, on the same CPU example.

Runs `venusrl train` (the built-in CPU example, same seed) with `--runtime local` and with
`--runtime ray` (one rollout worker actor: the engine, the sandbox pool and the agent loops, on a
one-node Ray cluster the command starts), alternating the order over `--repeats`, each a
separate process. A step's time comes from the run's own `metrics.jsonl` (`wall_s` at each
step's end), over the steps after the first (`--skip`, while the first groups fill the
pipeline); start-up (Ray, actors, warm start) is reported apart, as `startup_s`. A Ray run also
reports its actor calls by method (warm-start demonstrations included), and `actor_call_ms` /
`actor_call_caller_cpu_ms` time 2,000 calls shaped like a turn's `generate` to an actor that
does nothing (what a call per turn would cost).

The warm start (demonstrations played in sandboxes, a tokenizer learnt, imitation) runs once, in
a one-step local run, and every timed run starts from its `start-model/` with no warm start of
its own: it is the same for both runtimes and was most of each run's time. Each run's end is
printed to stderr as it comes; a run that fails is recorded with its error, and the JSON is
printed all the same (an overhead of None when a side has no run).

The policy is held at the warm start (`trainer.lr=1e-12`: the trainer still computes every step
and every new version is published to the engines) so that both runtimes play one stationary
workload. Runs that learn drift apart whatever the runtime: on one seed, the policy of one run
made 6 tool calls an episode and another's 29, and step times follow that, not the runtime.
`--learning` measures with the example's own learning rate all the same. Sampling still makes
episodes differ in length, so the overhead is given per step and per token.

Prints one JSON object: per runtime the step times and token rates of each repeat, then
`overhead_per_step` (median Ray step time / median local step time - 1) and
`overhead_per_token` (median local tokens/s / median Ray tokens/s - 1); the target is <= 0.15.

    python benchmarks/runtime_overhead.py [--steps 10] [--repeats 2] [--seed 0] [--learning]
                                          [k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from venusrl.types import SamplingParams, TurnMeta

FROZEN = "trainer.lr=1e-12"  # the trainer steps and publishes; the policy stays where it started


def run(
    runtime: str, steps: int, seed: int, skip: int, overrides: list[str], out: Path
) -> dict[str, Any]:
    run_dir = out / f"{runtime}-{len(list(out.iterdir()))}"
    cmd = [
        sys.executable, "-m", "venusrl.cli", "train", "--run-dir", str(run_dir),
        "--runtime", runtime, *overrides, f"run.steps={steps}", f"run.seed={seed}",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        return {"error": f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}"}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = lines[skip:]
    span = timed[-1]["wall_s"] - lines[skip - 1]["wall_s"] if skip else timed[-1]["wall_s"]
    cluster = run_dir / "cluster.json"  # Ray runs: what crossed process boundaries
    calls = json.loads(cluster.read_text())["actor_calls"] if cluster.exists() else {}
    return {
        "steps_run": len(lines),
        "step_s": round(span / len(timed), 4),
        "tokens_per_s": round(sum(m["tokens"] for m in timed) / span, 1),
        "reward_mean": round(statistics.fmean(m["reward_mean"] or 0.0 for m in lines), 3),
        "startup_s": round(wall - lines[-1]["wall_s"], 1),
        **({"actor_calls": calls} if calls else {}),
    }


class _Echo:
    async def generate(self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta) -> int:
        return len(prompt_ids)


def actor_call_cost(calls: int = 2000) -> dict[str, float]:
    """What one actor call costs the caller, shaped like a turn's `generate` (a 300-token
    context, sampling parameters, metadata), on a one-node cluster started for it."""
    import asyncio

    import ray

    ray.init(include_dashboard=False, logging_level="WARNING")
    try:
        echo = ray.remote(_Echo).options(num_cpus=0).remote()
        prompt, params = list(range(300)), SamplingParams()
        meta = TurnMeta(priority=1, trajectory_id="g1-m0-1", group_id="g1", expected_wait_s=5.0)

        async def burst() -> tuple[float, float]:
            await echo.generate.remote(prompt, params, meta)
            wall, cpu = time.monotonic(), time.process_time()
            for _ in range(calls):
                await echo.generate.remote(prompt, params, meta)
            return time.monotonic() - wall, time.process_time() - cpu

        wall, cpu = asyncio.run(burst())
    finally:
        ray.shutdown()
    return {
        "actor_call_ms": round(1000 * wall / calls, 3),
        "actor_call_caller_cpu_ms": round(1000 * cpu / calls, 3),
    }


def warm_start(seed: int, overrides: list[str], out: Path) -> list[str]:
    """The overrides that start a run from the CPU example's warm-started policy, made once."""
    run_dir = out / "warm-start"
    cmd = [sys.executable, "-m", "venusrl.cli", "train", "--run-dir", str(run_dir),
           "--runtime", "local", *overrides, "run.steps=1", f"run.seed={seed}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the warm start failed:\n{proc.stderr[-3000:]}")
    return [f"model={run_dir / 'start-model'}", "run.warm_start_episodes=0"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a tmp dir)")
    p.add_argument("--learning", action="store_true", help="let the policy learn (it drifts)")
    p.add_argument("overrides", nargs="*", help="config overrides passed to both runs")
    args = p.parse_args()
    if not args.learning:
        args.overrides = [FROZEN, *args.overrides]
    if args.steps <= args.skip + 1 or args.repeats < 1 or args.skip < 0:
        raise SystemExit("need --steps > --skip + 1 >= 1 and --repeats >= 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="venusrl-runtime-overhead-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say = lambda what: print(f"[{time.monotonic() - started:6.0f} s] {what}", file=sys.stderr)  # noqa: E731
    say("warm start (once, for every run)")
    overrides = [*args.overrides, *warm_start(args.seed, args.overrides, out)]
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
    for i in range(args.repeats):
        # Alternate the order: a machine that slows down over time must not favour one side.
        for runtime in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
            say(f"{runtime} run {i + 1} of {args.repeats}: {args.steps} steps")
            result = run(runtime, args.steps, args.seed, args.skip, overrides, out)
            runs[runtime].append(result)
            step_s = result.get("step_s")
            say(f"{runtime}: {step_s} s a step" if step_s else f"{runtime}: failed (see the JSON)")

    def median(runtime: str, key: str) -> float | None:
        done = [r[key] for r in runs[runtime] if "error" not in r]
        return statistics.median(done) if done else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b - 1, 3) if a is not None and b else None

    try:
        say("the cost of one actor call")
        calls: dict[str, Any] = actor_call_cost()
    except Exception as e:  # the JSON of the runs is still worth printing
        calls = {"actor_call_error": f"{type(e).__name__}: {e}"}
    print(
        json.dumps(
            {
                "steps": args.steps,
                "timed_steps": args.steps - args.skip,
                "seed": args.seed,
                "overrides": args.overrides,
                **runs,
                # None where a side has no run that finished, or (per token) none trained a token
                "overhead_per_step": ratio(median("ray", "step_s"), median("local", "step_s")),
                "overhead_per_token": ratio(
                    median("local", "tokens_per_s"), median("ray", "tokens_per_s")
                ),
                "target": 0.15,
                **calls,
                "runs_in": str(out),
            }
        )
    )


if __name__ == "__main__":
    main()
