"""KV retention on the real engine: LRU radix cache vs trajectory-aware retention, side by side.

One seeded multi-turn agentic workload: G groups of K trajectories; a group shares its prompt;
each trajectory takes 5-20 turns; each turn generates (greedy, a fixed number of tokens), then
waits on a tool and appends an observation. Tool latencies follow WORKLOADS.md's body
LN(0.4 s, 0.8), scaled by `--tool-scale` for a CPU (the model is far faster to wait on than to
run than a real one). The device KV pool holds `--capacity` (about a third) of the pages that
all trajectories' final contexts need; the host tier holds all of them.

The same workload runs through the same engine class twice, once per `engine.retention`:

- `lru`: a plain radix cache (SGLang-like): least recently used first, dropped;
- `trajectory`: each turn's request tells the engine the tool wait that follows
  (`expected_wait_s`, the latency distribution's 90th percentile); that KV is ranked by its
  owners' state and offloaded to the host tier rather than dropped; a returning trajectory loads
  it back.

With `--layer-residency L`, a third run, `trajectory_layers`, adds layer-wise residency at
threshold L (`engine.layer_residency`): under pressure, running trajectories keep a band of their
layers on device and read the rest from host. On a CPU both tiers are the same memory, so what it
shows is the scheduling effect (fewer preemptions and evictions) and the bytes it streams, not
what streaming costs on a GPU (`benchmarks/kv_transfer.py` measures that).

Prints one JSON object: per policy the makespan, tokens re-prefilled, the engine's counters
(`Engine.counters`: re-prefills by cause, device and host hit tokens, bytes offloaded and loaded,
preemptions, time in forward passes, the turns that followed a tool call and their wait for their
first token) and `turn_wait_mean_s`, that wait's mean; then `reprefill_reduction` (1 - ours /
LRU), `makespan_ratio` (LRU / ours) and `outputs_identical`. Targets (issue 5): reduction >= 0.9
and makespan ratio >= 1.3.

    python benchmarks/kv_retention.py [--groups 2] [--group-size 8] [--seed 0] [--threads 1]
        [--layer-residency 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.engine.config import EngineConfig  # noqa: E402
from venusrl.engine.engine import Engine, tool_return_wait_mean_s  # noqa: E402
from venusrl.engine.kv_manager import REPREFILL_CAUSES  # noqa: E402
from venusrl.model.directory import (  # noqa: E402
    ModelConfigError,
    init_model_dir,
    read_model_config,
)
from venusrl.policy.critical_groups import HIGH  # noqa: E402
from venusrl.types import SamplingParams, TurnMeta  # noqa: E402
from venusrl.workloads import LogNormal  # noqa: E402

TOOL_BODY = LogNormal(0.4, 0.8)  # WORKLOADS.md, swe-long: tool latency body, seconds
P90 = math.exp(1.2816 * TOOL_BODY.sigma)  # 90th percentile over the median of a log-normal


@dataclass
class Turn:
    action_tokens: int
    observation: list[int]
    tool_s: float


@dataclass
class Trajectory:
    tid: str
    prompt: list[int]
    turns: list[Turn]
    context: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def make_workload(
    seed: int, groups: int, group_size: int, vocab: int, tool_scale: float
) -> list[Trajectory]:
    rng = random.Random(seed)
    tool = TOOL_BODY.scaled(tool_scale)
    out = []
    for g in range(groups):
        prompt = [
            rng.randrange(vocab) for _ in range(int(LogNormal(256, 0.3, 64, 512).sample(rng)))
        ]
        for m in range(group_size):
            turns = [
                Turn(
                    int(LogNormal(24, 0.5, 4, 64).sample(rng)),
                    [
                        rng.randrange(vocab)
                        for _ in range(int(LogNormal(96, 0.8, 8, 400).sample(rng)))
                    ],
                    tool.sample(rng),
                )
                for _ in range(rng.randint(5, 20))
            ]
            out.append(Trajectory(f"g{g}-m{m}", prompt, turns))
    return out


def final_context(t: Trajectory) -> int:
    return len(t.prompt) + sum(turn.action_tokens + len(turn.observation) for turn in t.turns)


def run(
    model_dir: Path,
    workload: list[Trajectory],
    retention: str,
    device_pages: int,
    host_pages: int,
    tool_scale: float,
    max_context: int,
    layer_residency: float | None = None,
) -> dict[str, Any]:
    cfg = EngineConfig(
        device_kv_pages=device_pages,
        host_kv_pages=host_pages,
        retention=retention,
        max_context=max_context,
        layer_residency=layer_residency,
    )
    engine = Engine.from_model_dir(model_dir, cfg)
    engine.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    engine.flush_cache()
    trajs = [
        Trajectory(t.tid, t.prompt, t.turns, context=list(t.prompt), outputs=[]) for t in workload
    ]
    by_request: dict[str, Trajectory] = {}
    ready: list[tuple[float, int, int]] = []  # (when the tool answers, index, turn)
    pin_s = TOOL_BODY.median * tool_scale * P90
    start = time.perf_counter()
    for i in range(len(trajs)):
        heapq.heappush(ready, (start, i, 0))
    while ready or engine.has_work():
        now = time.perf_counter()
        while ready and ready[0][0] <= now:
            _, i, turn = heapq.heappop(ready)
            t = trajs[i]
            params = SamplingParams(
                max_tokens=t.turns[turn].action_tokens, temperature=0, ignore_eos=True
            )
            r = engine.add_request(
                t.context,
                params,
                TurnMeta(
                    priority=HIGH,
                    trajectory_id=t.tid,
                    group_id=t.tid.split("-")[0],
                    expected_wait_s=pin_s if turn + 1 < len(t.turns) else None,
                ),
            )
            by_request[r.request_id] = t
        if not engine.has_work():
            time.sleep(max(0.0, ready[0][0] - time.perf_counter()))
            continue
        finished = engine.step()
        now = time.perf_counter()
        for r in finished:
            out = engine.pop_finished(r.request_id)
            t = by_request.pop(r.request_id)
            turn = len(t.outputs)
            t.outputs.append(out.token_ids)
            if turn + 1 == len(t.turns):
                engine.end_trajectory(t.tid)
                continue
            t.context = t.context + out.token_ids + t.turns[turn].observation
            heapq.heappush(ready, (now + t.turns[turn].tool_s, trajs.index(t), turn + 1))
    makespan = time.perf_counter() - start
    engine.check()
    counters = engine.counters()
    return {
        "makespan_s": round(makespan, 2),
        "reprefill_tokens": sum(counters[f"reprefill_{c}_tokens"] for c in REPREFILL_CAUSES),
        **counters,
        "turn_wait_mean_s": tool_return_wait_mean_s(counters),
        "outputs": [t.outputs for t in trajs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--capacity",
        type=float,
        default=1 / 3,
        help="device KV pages as a fraction of what all final contexts need",
    )
    parser.add_argument(
        "--tool-scale", type=float, default=0.25, help="tool latencies: WORKLOADS.md's, times this"
    )
    parser.add_argument("--model-dir", type=Path, help="default: runs/bench-models/PRESET")
    parser.add_argument(
        "--layer-residency", type=float, help="also run trajectory retention with layer bands"
    )
    args = parser.parse_args()  # fmt: skip
    for name in ("groups", "group_size", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.capacity <= 1 or args.tool_scale < 0:
        raise SystemExit("--capacity must be in (0, 1] and --tool-scale >= 0")
    if args.layer_residency is not None and not 0 < args.layer_residency < 1:
        raise SystemExit("--layer-residency must be in (0, 1)")
    torch.set_num_threads(args.threads)

    model_dir = args.model_dir or ROOT / "runs" / "bench-models" / args.preset
    if not (model_dir / "config.json").exists():
        try:
            init_model_dir(model_dir, args.preset, seed=args.seed)
        except ModelConfigError as e:
            raise SystemExit(f"--preset: {e}") from None
    cfg = read_model_config(model_dir)
    workload = make_workload(
        args.seed, args.groups, args.group_size, cfg.vocab_size, args.tool_scale
    )
    page_size = EngineConfig().page_size
    need = sum(-(-final_context(t) // page_size) for t in workload)
    max_context = max(final_context(t) for t in workload) + 1
    if max_context > cfg.max_position_embeddings:
        raise SystemExit(f"a context of {max_context} tokens does not fit this model")
    # At least one whole context fits (and the padding page), or the engine refuses to start.
    device_pages = max(int(need * args.capacity), -(-max_context // page_size) + 1)

    def replay(retention: str, layer_residency: float | None = None) -> dict[str, Any]:
        return run(
            model_dir,
            workload,
            retention,
            device_pages,
            need + 1,
            args.tool_scale,
            max_context,
            layer_residency,
        )

    lru, ours = replay("lru"), replay("trajectory")
    layers = None
    if args.layer_residency is not None:
        layers = replay("trajectory", args.layer_residency)
    outputs = [r.pop("outputs") for r in (lru, ours, layers) if r is not None]
    identical = all(o == outputs[0] for o in outputs)
    print(json.dumps({
        "workload": {
            "trajectories": len(workload),
            "group_size": args.group_size,
            "turns_mean": round(statistics.fmean(len(t.turns) for t in workload), 1),
            "tool_returns": sum(len(t.turns) - 1 for t in workload),
            "final_context_mean": round(statistics.fmean(final_context(t) for t in workload)),
            "device_kv_pages": device_pages,
            "pages_needed": need,
            "tool_scale": args.tool_scale,
            "preset": args.preset,
            "seed": args.seed,
            "threads": args.threads,
        },
        "lru": lru,
        "trajectory": ours,
        **({"trajectory_layers": layers} if layers is not None else {}),
        "reprefill_reduction": round(1 - ours["reprefill_tokens"] / lru["reprefill_tokens"], 3)
        if lru["reprefill_tokens"] else None,
        "makespan_ratio": round(lru["makespan_s"] / ours["makespan_s"], 3),
        **({"layers_makespan_ratio": round(ours["makespan_s"] / layers["makespan_s"], 3)}
           if layers is not None else {}),
        "outputs_identical": identical,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
