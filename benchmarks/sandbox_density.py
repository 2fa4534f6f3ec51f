"""Sandbox density and cost: quota admission vs footprint admission vs footprint + group fork.

One seeded workload, one memory budget (the pool's cgroup limit, so an OOM is real and counted),
three pool configurations run one after another for the same wall time:

  quota            admit by declared memory (4 GiB per sandbox), every sandbox cold
  footprint        admit by measured footprint + learned growth, every sandbox cold
  footprint+fork   footprint admission, and the K members of a group fork from one warm zygote

The workload follows DESIGN.md's footprint admission and page sharing: groups of K=8 sandboxes share
a template that imports numpy and holds a 200-400 MB read-mostly working set (different per group:
no sharing across groups); every sandbox declares 4 GiB and runs a task of several tool calls
separated by "model thinking" time; each call reads part of the working set and keeps some private
memory, and a rare call spikes. A preempted member is replaced (the task restarts in a new sandbox
of its group), as the coordinator would do. Groups are launched while fewer than K members wait for
admission, so every configuration runs at the concurrency its admission allows.

Prints one JSON object: per configuration `mean_concurrent` (time-averaged live sandboxes),
`completed_per_min`, `oom_kills`, `preemptions`, `gb_seconds_per_completed` (budget x wall time
per completed task: what the node costs) and `physical_gb_seconds_per_completed` (what the pool's
cgroup was actually charged), then `density_ratio` and `cost_ratio` of footprint+fork over quota.

    python benchmarks/sandbox_density.py [--duration-s 60] [--budget-gib 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from venusrl.envs import InfraFailure, SandboxGroup, SandboxPool, TemplateSpec

GiB = 1 << 30
MiB = 1 << 20
CONFIGS = {
    "quota": ("quota", False),
    "footprint": ("footprint", False),
    "footprint+fork": ("footprint", True),
}


@dataclass(frozen=True)
class Call:
    think_s: float  # the model generating before it calls the tool
    keep_mb: int  # private memory the call leaves behind (results, caches)
    read_fraction: float  # share of the working set the call reads
    spike_mb: int  # transient allocation (0 for most calls)


@dataclass(frozen=True)
class GroupSpec:
    seed: int
    working_set_mb: int
    tasks: tuple[tuple[Call, ...], ...]  # one task per member


@dataclass(frozen=True)
class Workload:
    seed: int = 0
    k: int = 8
    working_set_mb: tuple[int, int] = (200, 400)
    calls: tuple[int, int] = (3, 6)
    think_s: tuple[float, float] = (0.5, 1.5)
    keep_mb: tuple[int, int] = (8, 32)
    spike_probability: float = 0.01
    spike_mb: tuple[int, int] = (300, 600)
    declared_gib: float = 4.0

    def groups(self, n: int) -> list[GroupSpec]:
        rng = random.Random(self.seed)
        out = []
        for g in range(n):
            tasks = []
            for _ in range(self.k):
                calls = []
                for _ in range(rng.randint(*self.calls)):
                    spike = rng.random() < self.spike_probability
                    calls.append(
                        Call(
                            think_s=rng.uniform(*self.think_s),
                            keep_mb=rng.randint(*self.keep_mb),
                            read_fraction=rng.uniform(0.05, 0.3),
                            spike_mb=rng.randint(*self.spike_mb) if spike else 0,
                        )
                    )
                tasks.append(tuple(calls))
            out.append(GroupSpec(g, rng.randint(*self.working_set_mb), tuple(tasks)))
        return out


TEMPLATE_SETUP = "import numpy as np\n"


def group_setup(spec: GroupSpec) -> str:
    # Read-mostly data the task needs (a repository index, a dataset shard): touched once here.
    n = spec.working_set_mb * MiB // 8
    return f"working_set = np.full({n}, {spec.seed}.0)\nkept = []\n"


def tool_call(call: Call) -> str:
    lines = [
        f"kept.append(np.ones({call.keep_mb * MiB // 8}))",
        f"total = float(working_set[: int(len(working_set) * {call.read_fraction})].sum())",
    ]
    if call.spike_mb:
        lines.append(f"spike = np.ones({call.spike_mb * MiB // 8}); del spike")
    lines.append("print(total)")
    return "\n".join(lines)


async def run_config(
    name: str, workload: Workload, budget_bytes: int, duration_s: float
) -> dict[str, Any]:
    admission, share = CONFIGS[name]
    groups = iter(workload.groups(100_000))
    pool = SandboxPool(
        budget_bytes,
        admission=admission,  # type: ignore[arg-type]
        share_pages=share,
        admission_timeout_s=duration_s + 120,
    )
    completed = 0
    waiting = 0  # members asked for but not started yet
    failures: list[str] = []
    async with pool:
        await pool.prepare_template(
            TemplateSpec(
                name="bench",
                setup=TEMPLATE_SETUP,
                declared_memory_bytes=int(workload.declared_gib * GiB),
                max_pids=64,
            )
        )
        start = time.monotonic()
        deadline = start + duration_s
        base = pool.stats()

        async def member(group: SandboxGroup, calls: tuple[Call, ...]) -> None:
            nonlocal completed, waiting
            while True:  # a preempted member is replaced and its task restarts
                try:
                    sb = await group.add()
                finally:
                    waiting -= 1
                try:
                    for call in calls:
                        await asyncio.sleep(call.think_s)
                        r = await sb.run_python(tool_call(call), timeout_s=60)
                        if not r.ok:
                            failures.append(r.text()[-500:])
                            return
                    if time.monotonic() <= deadline:
                        completed += 1
                    return
                except InfraFailure:
                    waiting += 1
                finally:
                    await sb.close()

        async def run_group(spec: GroupSpec) -> None:
            group = await pool.open_group("bench", setup=group_setup(spec))
            try:
                await asyncio.gather(*(member(group, calls) for calls in spec.tasks))
            finally:
                await group.close()

        running: set[asyncio.Task[None]] = set()
        while time.monotonic() < deadline:
            if waiting < workload.k:
                waiting += workload.k
                task = asyncio.create_task(run_group(next(groups)))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.05)
        end = pool.stats()
        window = time.monotonic() - start
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    budget_gib = budget_bytes / GiB
    physical = end.physical_gb_seconds - base.physical_gb_seconds
    return {
        "mean_concurrent": (end.sandbox_seconds - base.sandbox_seconds) / window,
        "completed": completed,
        "completed_per_min": completed / window * 60,
        "oom_kills": end.oom_kills,
        "preemptions": end.preemptions - base.preemptions,
        "gb_seconds_per_completed": budget_gib * window / completed if completed else None,
        "physical_gb_seconds_per_completed": physical / completed if completed else None,
        "mean_physical_gb": physical / window,
        "peak_physical_gb": end.peak_physical_bytes / GiB,
        "mean_create_latency_s": end.mean_create_latency_s,
        "mean_admission_wait_s": end.mean_admission_wait_s,
        "task_failures": failures[:3],
        "window_s": window,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--working-set-mb", type=int, nargs=2, default=(200, 400))
    parser.add_argument("--think-s", type=float, nargs=2, default=(0.5, 1.5))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("sandbox_density needs root (namespaces and cgroups)")
    workload = Workload(
        seed=args.seed,
        k=args.k,
        working_set_mb=tuple(args.working_set_mb),
        think_s=tuple(args.think_s),
    )
    budget = int(args.budget_gib * GiB)
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    results = {c: asyncio.run(run_config(c, workload, budget, args.duration_s)) for c in names}
    out: dict[str, Any] = {
        "workload": asdict(workload),
        "budget_gib": args.budget_gib,
        "duration_s": args.duration_s,
        "configs": results,
    }
    if {"quota", "footprint+fork"} <= set(results):
        quota, fork = results["quota"], results["footprint+fork"]
        out["density_ratio"] = fork["mean_concurrent"] / quota["mean_concurrent"]
        if quota["gb_seconds_per_completed"] and fork["gb_seconds_per_completed"]:
            out["cost_ratio"] = fork["gb_seconds_per_completed"] / quota["gb_seconds_per_completed"]
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
