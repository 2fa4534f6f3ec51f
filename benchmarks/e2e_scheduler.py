"""End to end: `venusrl train` on an agentic workload under three schedulers, side by side.

Each policy runs the same command (real engine, real sandboxes, real GRPO steps) on the built-in
`agent_workload` environment: 5-20 turns per episode, WORKLOADS.md's swe-long tool latencies (the
body, the heavy calls and the hangs, with a per-task slowness) x 0.25, observations of ~100
characters, one draw per group member, all seeded, so every policy gets the same work. The model
is the micro preset with random weights (what it writes does not matter here: every turn is a tool
call; `--preset tiny`, kv_retention.py's model, puts more of the run in the engine).
The device KV pool holds about a third of what the trajectories in flight need; the host
tier holds all of it. At these defaults the groups' slowest members spend under a tenth of their
time at the engine, so no engine policy can gain much; `--preset tiny --groups-per-batch 4
--capacity 0.15` puts the engine on the critical path (about half of that time). A run takes
minutes per policy: seed 0 has a slow task whose members spend up to 440 s in tools
(BENCHMARKS.md).

- `fifo`: synchronous (`max_staleness=0`), groups in arrival order, LRU radix cache: a batch rolls
  out, then trains, then the next one starts (veRL-like); it waits for every straggler;
- `overlap`: groups start one version ahead, arrival order, LRU cache: the next batch's groups
  fill the engine while the current one finishes, with no group awareness (RollFlash-like);
- `venus`: groups start one version ahead, critical groups first, trajectory-aware KV retention
  (the KV of a trajectory waiting on a tool is pinned and offloaded, not dropped), and each turn
  admitted into the engine's KV window by that ranking (`rollout.admission=critical`).

`fifo+offload` and `overlap+offload` are those baselines with the host tier venus has (the same
`engine.host_kv_pages`): trajectory retention, so idle KV is offloaded rather than dropped, with
no priorities (what SGLang's HiCache or LMCache give a plain server).

`overlap` and `venus` train a group at most `--train-staleness` versions after it started
(`rollout.max_train_staleness`, default 4, the value AReaL's documentation gives as its example
off-policyness bound): a batch takes later complete groups in a straggler's place instead of
waiting for it. `--train-staleness 1` makes every batch wait for its due stragglers (the bound
before 2026-12-03's fourth session). `--release-overtaken` sets `rollout.release_overtaken` for
them too: a straggler overtaken by the batches stops holding a place under the start bound, so
its replacement starts at once instead of when new weights are out.

Prints one JSON object: per policy `time_to_batches_s` (the training loop's wall time when the last
batch has trained) and of it the time the loop waited for batches, trained and published
(`batch_wait_s`, `train_s`, `publish_s`, summed over the steps), group completion time (p50, p90
and max over the groups trained), staleness (mean and max, in versions, of the model tokens
trained), the groups started and still running at the end (a straggler not yet trained), the
engine's counters (`Engine.counters`: busy time, tokens computed and re-prefilled by cause, device
and host hits, bytes offloaded), the mean wait of a tool's answer for the next turn's first token,
the share of the groups' longest members' time spent at the engine (`critical_generation_share`:
what no engine policy can beat, the rest being tool calls), and venus's ratio `speedup_vs_<policy>`
to every other policy run. `later_batch_wait_s` is the loop's wait for batches after the first;
`speedup_ceiling_vs_<policy>` the ratio venus would reach had it never waited after its first
batch: with the trainer sharing the 2 cores, its own pace bounds what any engine policy gains.
Targets: >= 2.0 (fifo) and >= 1.3 (overlap) on a 2-core machine (issue 5); >= 1.2 the best of
fifo, overlap and their `+offload` forms (issue 40).

    python benchmarks/e2e_scheduler.py [--batches 4] [--groups-per-batch 2] [--seed 0]
                                       [--train-staleness 4] [--preset micro]
                                       [--policies fifo,overlap,fifo+offload,overlap+offload,venus]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.engine.engine import tool_return_wait_mean_s  # noqa: E402
from venusrl.envs.builtin.agent_workload import AgentWorkload  # noqa: E402
from venusrl.runtime.record import read_records  # noqa: E402
from venusrl.sim.report import quantile  # noqa: E402

POLICIES: dict[str, list[str]] = {
    "fifo": [
        "rollout.max_staleness=0",
        "rollout.priorities=fifo",
        "engine.retention=lru",
        "rollout.admission=none",
    ],
    "overlap": [
        "rollout.max_staleness=1",
        "rollout.priorities=fifo",
        "engine.retention=lru",
        "rollout.admission=none",
    ],
    "venus": [
        "rollout.max_staleness=1",
        "rollout.priorities=critical",
        "engine.retention=trajectory",
        "rollout.admission=critical",
    ],
}
OFFLOAD = "+offload"  # a baseline with the host tier: KV offloaded, not dropped; no priorities
ASYNC = ("overlap", "venus")  # the policies `--train-staleness` applies to
PAGE_SIZE = 8
MAX_TOKENS_PER_TURN = 24
TEMPLATE_TOKENS = 40  # chat-template tokens around a turn and its tool response (byte-level)
SYSTEM_TOKENS = 400  # the system prompt with the tool announced (byte-level tokenizer)


def context_tokens(prompt: str, draw: dict[str, Any]) -> int:
    """A trajectory's final context, in byte-level tokens (one per character, roughly)."""
    turns = len(draw["tool_s"])
    observed = sum(draw["observation_chars"])
    return SYSTEM_TOKENS + len(prompt) + turns * (MAX_TOKENS_PER_TURN + TEMPLATE_TOKENS) + observed


def kv_pages(seed: int, groups_in_flight: int, group_size: int, capacity: float) -> tuple[int, int]:
    """(device pages, host pages): a `capacity` share of what the first groups in flight need."""
    tasks = itertools.islice(AgentWorkload.tasks(seed), groups_in_flight)
    need = sum(
        -(-context_tokens(t.prompt, d) // PAGE_SIZE)
        for t in tasks
        for d in t.reference["members"][:group_size]
    )
    return int(need * capacity), 2 * need


def run_policy(
    name: str, common: list[str], knobs: list[str], out: Path, batches: int
) -> dict[str, Any]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "venusrl.cli", "train", "--run-dir", str(run_dir)]
    proc = subprocess.run([*cmd, *common, *knobs], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: venusrl train failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(steps) != batches:
        raise SystemExit(f"{name}: {len(steps)} steps in metrics.jsonl, expected {batches}")
    groups = sorted(d for s in steps for d in s["group_s"])
    engine = steps[-1]["engine"]
    return {
        "time_to_batches_s": round(steps[-1]["wall_s"], 1),
        "step_wall_s": [round(s["wall_s"], 1) for s in steps],
        # The training loop's time over the steps: waiting for batches, training, publishing.
        **{k: round(sum(s[k] for s in steps), 1) for k in ("batch_wait_s", "train_s", "publish_s")},
        # The part of that wait an engine policy could still take off once the first batch is
        # in; without it the trainer's own pace sets the run.
        "later_batch_wait_s": round(sum(s["batch_wait_s"] for s in steps[1:]), 1),
        "group_s_p50": round(quantile(groups, 0.5) or 0.0, 2),
        "group_s_p90": round(quantile(groups, 0.9) or 0.0, 2),
        "group_s_max": round(groups[-1], 2),
        "staleness_mean": round(statistics.fmean(s["staleness_mean"] for s in steps), 3),
        "staleness_max": max(s["staleness_max"] for s in steps),
        "groups_started": steps[-1]["groups_started"],
        "groups_running_at_end": steps[-1]["groups_running"],
        # How much of the run the engine spent in steps that ran a forward pass, how long a turn
        # back from its tool call waited for its first token, and what the cache did.
        "engine_busy_share": round(engine["busy_s"] / steps[-1]["wall_s"], 3),
        "tool_return_wait_mean_s": tool_return_wait_mean_s(engine),
        "critical_generation_share": critical_generation_share(run_dir),
        "engine": {k: round(v, 3) for k, v in engine.items()},
        "knobs": knobs,
    }


def critical_generation_share(run_dir: Path) -> float:
    """Of the time each trained group's longest member took, the share its turns spent at the
    engine (from a request to its last token: queueing, prefill and decode); the rest is tool
    calls and the agent loop. A group is done when that member is, so this share bounds what any
    engine policy can take off group times: an engine that answered at once would make them
    1 / (1 - share) times shorter, and priorities, which only reorder the engine's work, less."""
    longest: dict[str, tuple[float, float]] = {}
    for record in read_records(run_dir):
        turns = record["turns"]
        span = turns[-1]["acted"] - turns[0]["requested"]
        at_engine = sum(t["generated"] - t["requested"] for t in turns)
        if span > longest.get(record["group_id"], (-1.0, 0.0))[0]:
            longest[record["group_id"]] = (span, at_engine)
    spans = sum(span for span, _ in longest.values())
    return round(sum(e for _, e in longest.values()) / spans, 3) if spans else 0.0


def knobs(policy: str, train_staleness: int, release_overtaken: bool = False) -> list[str]:
    base = policy.removesuffix(OFFLOAD)
    train = [f"rollout.max_train_staleness={train_staleness}"] if base in ASYNC else []
    if train and release_overtaken:
        train.append("rollout.release_overtaken=true")
    retention = ["engine.retention=trajectory"] if policy.endswith(OFFLOAD) else []
    return [*(k for k in POLICIES[base] if not retention or k != "engine.retention=lru"),
            *retention, *train]  # fmt: skip


def known(policy: str) -> bool:
    """A policy of POLICIES, or a baseline's with the host tier (`fifo+offload`)."""
    base = policy.removesuffix(OFFLOAD)
    lru = "engine.retention=lru" in POLICIES.get(base, [])
    return policy in POLICIES or (policy.endswith(OFFLOAD) and lru)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=4, help="trainer steps to run")
    parser.add_argument("--groups-per-batch", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="micro", help="model shape: micro, tiny, small")
    parser.add_argument(
        "--capacity",
        type=float,
        default=1 / 3,
        help="device KV as a share of what the groups in flight need",
    )
    parser.add_argument(
        "--train-staleness",
        type=int,
        default=4,
        help="versions after its start a group may be trained (overlap, venus)",
    )
    parser.add_argument(
        "--release-overtaken",
        action="store_true",
        help="an overtaken straggler frees its start place (overlap, venus)",
    )
    parser.add_argument("--policies", default="fifo,overlap,venus")
    parser.add_argument("--out", type=Path, help="run directories (default: a temporary one)")
    args = parser.parse_args()  # fmt: skip
    for flag in ("batches", "groups_per_batch", "group_size"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.capacity <= 1:
        raise SystemExit("--capacity must be in (0, 1]")
    if args.train_staleness < 1:
        raise SystemExit("--train-staleness must be >= 1 (the start bound of overlap and venus)")
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(p for p in policies if not known(p))
    if unknown or "venus" not in policies:
        raise SystemExit(
            f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}, fifo{OFFLOAD},"
            f" overlap{OFFLOAD} (venus needed)"
        )

    # Two batches in flight at one version of staleness.
    device, host = kv_pages(args.seed, 2 * args.groups_per_batch, args.group_size, args.capacity)
    device = max(device, 4096 // PAGE_SIZE + 1)  # one whole context must fit
    common = [
        f"run.seed={args.seed}",
        f"run.steps={args.batches}",
        "run.warm_start_episodes=0",
        f"run.preset={args.preset}",
        "rollout.env=agent_workload",
        f"rollout.group_size={args.group_size}",
        f"rollout.batch_groups={args.groups_per_batch}",
        "rollout.max_context=4096",
        f"rollout.max_tokens_per_turn={MAX_TOKENS_PER_TURN}",
        f"engine.page_size={PAGE_SIZE}",
        f"engine.device_kv_pages={device}",
        f"engine.host_kv_pages={host}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        results = {
            name: run_policy(
                name,
                common,
                knobs(name, args.train_staleness, args.release_overtaken),
                out,
                args.batches,
            )
            for name in policies
        }
    venus = results["venus"]["time_to_batches_s"]
    report: dict[str, Any] = {
        "workload": {
            "batches": args.batches,
            "groups_per_batch": args.groups_per_batch,
            "group_size": args.group_size,
            "seed": args.seed,
            "preset": args.preset,
            "train_staleness": args.train_staleness,
            "release_overtaken": args.release_overtaken,
            "device_kv_pages": device,
            "host_kv_pages": host,
            "common_overrides": common,
        },
        **results,
    }
    unwaited = venus - results["venus"]["later_batch_wait_s"]
    for base in (p for p in policies if p != "venus"):
        report[f"speedup_vs_{base}"] = round(results[base]["time_to_batches_s"] / venus, 3)
        report[f"speedup_ceiling_vs_{base}"] = round(
            results[base]["time_to_batches_s"] / unwaited, 3
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
