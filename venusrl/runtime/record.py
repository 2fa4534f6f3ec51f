"""The run's record of its trajectories: `trajectories.jsonl`, one object per trajectory trained on.

Each trainer step appends the trajectories of its batch (masked infrastructure failures included,
and the attempts a replacement member played again), so a finished trajectory is on disk once it
has been trained on, and a run can be studied, plotted or replayed in the simulator afterwards.
An object holds:

- `step`, `env`, `trajectory_id`, `group_id`, `prompt_id`, `reward` (null when masked),
  `reward_s` (from its last turn to its reward: the reward workers' queue and scoring), `finish`,
  `failure` (what went wrong, for people) and `failure_kind` (`types.FailureKind`), `tool_calls`,
  `output` (what the episode produced beyond its transcript, an SWE episode's diff; null),
  `replaced` (true: an attempt the platform failed, played again by a replacement member);
- `token_ids` and `turn_starts` (the whole token record; `mask` follows from the turns, see
  `turns`), `versions`: how many model tokens each weight version produced (`{"3": 41}`);
- `turns`: per turn the model's tokens (`action_tokens`), the observation's (`observation_tokens`,
  0 after the last turn), the weight versions that sampled the model's tokens (`weight_versions`,
  one unless new weights came mid-turn), and when it happened in seconds since the run's start:
  `requested` (sent to the engine), `generated` (tokens back) and `acted` (the environment done,
  tool calls included).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from venusrl.types import Trajectory

FILE = "trajectories.jsonl"
METRICS_FILE = "metrics.jsonl"


def trajectory_record(
    traj: Trajectory, step: int, env: str, t0: float, replaced: bool = False
) -> dict[str, Any]:
    """The JSON object of one trajectory of environment `env`; `t0` is the run's start on
    `time.monotonic()`."""
    bounds = [*traj.turn_starts, len(traj.token_ids)]
    turns = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        action = next((k for k in range(start, end) if not traj.mask[k]), end) - start
        turn: dict[str, Any] = {
            "action_tokens": action,
            "observation_tokens": end - start - action,
            "weight_versions": sorted(set(traj.versions[start : start + action])),
            "cut": i in traj.cut_turns,  # the engine stopped it at its max_tokens
        }
        if i < len(traj.turn_times):
            times = traj.turn_times[i]
            turn |= {
                "requested": round(times.requested - t0, 4),
                "generated": round(times.generated - t0, 4),
                "acted": round(times.acted - t0, 4),
            }
        turns.append(turn)
    versions = Counter(v for v, m in zip(traj.versions, traj.mask, strict=True) if m)
    return {
        "step": step,
        "env": env,
        "trajectory_id": traj.trajectory_id,
        "group_id": traj.group_id,
        "prompt_id": traj.prompt_id,
        "reward": traj.reward,
        "reward_s": None if traj.reward_s is None else round(traj.reward_s, 4),
        "finish": None if traj.finish is None else str(traj.finish),
        "failure": None if traj.failure is None else traj.failure.message,
        "failure_kind": None if traj.failure is None else str(traj.failure.kind),
        "tool_calls": traj.tool_calls,
        "output": traj.output,
        "replaced": replaced,
        "versions": {str(v): n for v, n in sorted(versions.items())},
        "turns": turns,
        "turn_starts": traj.turn_starts,
        "token_ids": traj.token_ids,
    }


def append_records(run_dir: Path, records: Iterable[dict[str, Any]]) -> None:
    with (run_dir / FILE).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def read_records(run_dir: Path, after_step: int | None = None) -> Iterator[dict[str, Any]]:
    """The records of `run_dir`, skipping a torn last line (the run was killed mid-write) and, with
    `after_step`, those of steps after it."""
    path = run_dir / FILE
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if after_step is None or record["step"] <= after_step:
                yield record


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of `run_dir/metrics.jsonl`, but a torn last one (the run was killed while
    writing it, or the disk filled): that step is trained again on resume. A bad line before
    the last is damage this cannot mend, and an error naming the file and line."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    metrics = []
    for i, (number, line) in enumerate(lines):
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
    return metrics


def truncate_records(run_dir: Path, last_step: int) -> None:
    """Keep only the records of steps up to `last_step`: on resume, the steps after the checkpoint
    are trained again, and their first trajectories must not be counted twice."""
    path = run_dir / FILE
    if path.exists():
        kept = [json.dumps(r) + "\n" for r in read_records(run_dir, last_step)]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
