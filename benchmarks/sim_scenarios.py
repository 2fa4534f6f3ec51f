"""Every scenario x policy in the simulator, over several seeds: the table of BENCHMARKS.md.

Runs `venusrl.sim` (the real policies on virtual time, WORKLOADS.md's cost model and workloads)
for each scenario, seed and policy, side by side on the same seeded workload, and prints one JSON
object: per scenario the workload's parameters and their sources, per seed each policy's figures
(with its knobs and its speedups, `venusrl.sim.report.SPEEDUPS`: `speedup_vs_<policy>` in the
mean step after the first, `run_speedup_vs_<policy>` in the time to the last step,
`uncut_speedup_vs_<policy>` in seconds per trained sample not cut at the workload's time limit,
and `token_speedup_vs_<policy>` in seconds per token trained), and per policy the mean over
the seeds of each figure and, for its step time and its speedups, each seed's, the median and the
worst (`venusrl.sim.report`). `--markdown` prints the table instead.

Each run also says the least step its trained samples allow where rollout sets the pace,
`work_floor_step_s` (`venusrl.sim.work_floor`: their decode and prefill GPU work, nothing
computed twice, moved or waited for, divided among the engines, plus the weight load), and each
policy its `floor_headroom`, its step over that floor by seed (the worst: the largest): no
schedule of the engines can take more than that off a step the GPUs are busy for.
`gpu_s_per_floor_s` reads the same over the whole run, whatever the steps' window: the rollout
GPU seconds busy per second of floor work of every trajectory finished, trained or not.

    python benchmarks/sim_scenarios.py [--scenarios swe-short,search-short] [--seeds 0,1,2]
                                       [--policies sync,async,concur,venus] [--steps 4]
                                       [--markdown] [--json-out FILE] [--workload FILE] [--jobs N]
                                       [--unloaded] [--cost KEY=VALUE,...]

`--unloaded` adds, per staleness bound the policies use, a run `unloaded@N:L` of the same seeds
with a rollout engine for every trajectory that can be in flight, so each runs alone: every turn
as fast as an engine can run it, nothing queued, preempted or evicted. The coordinator, the
bound, the tools, the sandboxes and the trainer are the scenario's, so that run is the batches'
critical path; its `run_speedup_vs_<policy>` (at the policy's bound) is the most any schedule of
the engines could take off that policy's time to the last step. (Its prompts are not shared
between members, which costs it one prompt's prefill per member: tens of milliseconds. The mean
step after the first is not bounded so: a policy whose first step ends later can have shorter
steps after it.)

A policy NAME@N runs with a staleness bound of N versions (`--policies async@2,venus@2`);
NAME+offload is a baseline with the host tier ours has (`--policies async,async+offload`);
NAME[KNOB=VALUE,...] sets the policy's knobs, its admission control's constants and the
retention pin (`--policies 'venus,venus[leave_after_calls=5,lane=0.5]'`; a bad knob lists them).

`--cost KEY=VALUE,...` sets constants of the cost model for every run, to see what a figure owes
to one of them: `--cost gpu.pcie_h2d=inf` makes loading KV back from host free, `--cost
gpu.pcie_h2d=25e9,gpu.pcie_d2h=25e9` is PCIe 4 (`CostModel.overridden` lists the keys). The
JSON says what was set (`cost`).

Simulated time is not wall time: a full `swe-long` run takes minutes of this machine per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from venusrl.sim.cost_model import parse_overrides
from venusrl.sim.executor import simulate, workload_cost
from venusrl.sim.policies import SimPolicy, sim_policies
from venusrl.sim.report import over_seeds, parse_seeds, speedups
from venusrl.sim.types import SimConfig
from venusrl.workloads import SCENARIOS, Workload, load_workload

FIGURES = (  # their means over the seeds; the step time and speedups by seed
    "gpu_busy",
    "reprefill_tokens",
    "group_completion_p99_s",
    "staleness_mean",
    "train_s_per_step",
    "cut_share_trained",
    "work_floor_step_s",
    "gpu_s_per_floor_s",
    "sandbox_gb_s",
    "sandbox_idle_before_first_turn",
    "sandbox_idle_between_turns",
)


def unloaded(workload: Workload, policies: list[SimPolicy]) -> list[tuple[Workload, SimPolicy]]:
    """Per staleness bound among `policies`, the scenario with a rollout engine for every
    trajectory that bound lets be in flight ((N + 1) batches of groups: past those, a group
    starts only in the place of one trained) and a policy at that bound that admits them all."""
    bounds = dict.fromkeys((p.max_staleness, p.max_train_staleness) for p in policies)
    alone = []
    for start, train in bounds:
        in_flight = (start + 1) * workload.prompts_per_batch * workload.group_size
        name = f"unloaded@{start}" + ("" if train is None else f":{train}")
        alone.append((
            workload.scaled_for(rollout_gpus=in_flight * workload.tp),
            SimPolicy(name, "fifo", start, "lru", max_train_staleness=train),
        ))  # fmt: skip
    return alone


def run_scenario(
    workload: Workload,
    seeds: list[int],
    policies: list[SimPolicy],
    steps: int,
    jobs: int | None = None,
    with_unloaded: bool = False,
    cost: dict[str, float] | None = None,
) -> dict[str, Any]:
    started = time.monotonic()
    config = SimConfig(steps=steps)
    alone = unloaded(workload, policies) if with_unloaded else []
    runs = {}
    for seed in seeds:
        runs[seed] = simulate(workload, policies, seed, config, jobs, cost)
        runs[seed] += [simulate(w, [p], seed, config, 1, cost)[0] for w, p in alone]
        speedups(runs[seed])  # the unloaded runs' too
    policies = [*policies, *(p for _, p in alone)]
    summary = over_seeds(runs)
    for i, name in enumerate(p.name for p in policies):
        per_seed = [runs[s][i] for s in seeds]
        row = summary[name]
        for f in FIGURES:
            row[f] = statistics.fmean(r[f] for r in per_seed if r[f] is not None)
        row["rollout_gpu_time"] = {
            k: statistics.fmean(r["rollout_gpu_time"][k] for r in per_seed)
            for k in per_seed[0]["rollout_gpu_time"]
        }
    params = {
        k: (repr(v) if not isinstance(v, int | float | str | dict) else v)
        for k, v in dataclasses.asdict(workload).items()
    }
    return {
        "workload": params,
        "cost": cost or {},
        "wall_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "runs": {str(s): r for s, r in runs.items()},
    }


def markdown(results: dict[str, Any], policies: list[str]) -> str:
    """Step time and speedups: the median over the seeds (the worst in brackets); the other
    columns: means over the seeds."""
    speedups = [f"vs {p}" for p in policies]
    head = ["scenario", "policy", "step (s)", "GPU busy", "re-prefill tokens",
            "GPU time re-prefilling", "GPU idle", "train (s/step)", "group p99 (s)", "staleness",
            *speedups]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, res in results.items():
        for name in policies:
            row = res["summary"][name]
            cells = [
                scenario,
                name,
                f"{row['mean_step_s']['median']:.0f} ({row['mean_step_s']['worst']:.0f})",
                f"{row['gpu_busy']:.0%}",
                f"{row['reprefill_tokens']:.3g}",
                f"{row['rollout_gpu_time']['reprefill']:.0%}",
                f"{row['rollout_gpu_time']['idle']:.0%}",
                f"{row['train_s_per_step']:.0f}",
                f"{row['group_completion_p99_s']:.0f}",
                f"{row['staleness_mean']:.2f}",
            ]
            for other in policies:
                s = row.get(f"speedup_vs_{other}")
                cells.append(f"{s['median']:.2f}x ({s['worst']:.2f}x)" if s else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default="swe-short,search-short,math-python")
    p.add_argument("--workload", help="a workload YAML file instead of the scenarios")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policies", default="sync,async,concur,venus")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json-out", help="also write the JSON object to this file")
    p.add_argument("--jobs", type=int, help="policies simulated at once (default: all)")
    p.add_argument(
        "--cost",
        default="",
        help="KEY=VALUE,...: constants of the cost model set otherwise (gpu.pcie_h2d=inf)",
    )
    p.add_argument(
        "--unloaded",
        action="store_true",
        help="also each bound's run with no engine contention (the batches' critical path)",
    )
    args = p.parse_args()
    try:
        policies = sim_policies(args.policies)
    except ValueError as e:
        p.error(f"--policies: {e}")
    unknown = [n for n in args.scenarios.split(",") if n not in SCENARIOS]
    if unknown and not args.workload:
        p.error(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    if args.json_out:
        try:  # fail now, not after an hour of simulation
            open(args.json_out, "a").close()
        except OSError as e:
            p.error(f"--json-out: cannot write {args.json_out}: {e.strerror}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        p.error(str(e))
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step only fills the pipeline)")
    try:
        workloads = (
            [load_workload(args.workload)]
            if args.workload
            else [SCENARIOS[name] for name in args.scenarios.split(",")]
        )
    except (ValueError, OSError) as e:
        p.error(f"--workload: {e}")
    try:  # fail now, not after an hour: more trajectories in flight than engines it can have
        for w in workloads if args.unloaded else []:
            unloaded(w, policies)
    except ValueError as e:
        p.error(f"--unloaded: {e}")
    try:
        cost = parse_overrides(args.cost)
        for w in workloads:
            workload_cost(w, cost)
    except ValueError as e:
        p.error(f"--cost: {e}")
    results = {
        w.name: run_scenario(w, seeds, policies, args.steps, args.jobs, args.unloaded, cost)
        for w in workloads
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f)
    names = list(next(iter(results.values()))["summary"])  # the policies, then any unloaded run
    print(markdown(results, names) if args.markdown else json.dumps(results))


if __name__ == "__main__":
    main()
