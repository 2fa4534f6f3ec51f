"""Why does a guess_number policy lose? Plays sampled episodes of a checkpoint, sorts the losses.

Loads a model directory (a run's `checkpoints/step-N`, or the run directory: its latest
checkpoint), plays `--episodes` episodes through the real engine and real sandboxes at the rollout
temperature (or greedy with `--temperature 0`), and classifies each lost episode by its first
departure from binary search:

- `malformed_call`: a turn whose tool call does not parse (or is not a guess);
- `outside_interval`: a guess outside the interval the observations left;
- `off_midpoint`: a guess inside that interval but not its midpoint (it may still have won);
- `no_guess`: the episode ended without a departure (it stopped calling the tool early).

Prints one JSON object: wins, the loss counts by kind, and for `outside_interval` the depth (the
guess number) at which it happened.

    python benchmarks/train_failures.py RUN_DIR_OR_MODEL_DIR [--episodes 128] [--temperature 1]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.config import load_config  # noqa: E402
from venusrl.coordinator.agent_loop import ChatFormat  # noqa: E402
from venusrl.envs.builtin.guess_number import MAX_GUESSES, GuessNumber, N  # noqa: E402
from venusrl.model.tokenizer import Tokenizer  # noqa: E402
from venusrl.model.tool_calls import ToolCall  # noqa: E402
from venusrl.model.tool_formats import tool_parser  # noqa: E402
from venusrl.runtime.evaluate import evaluation_tasks, play_policy  # noqa: E402
from venusrl.trainer.checkpoint import checkpoints  # noqa: E402
from venusrl.types import Trajectory  # noqa: E402


def model_dir_of(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    saved = checkpoints(path)
    if not saved:
        raise SystemExit(f"{path}: neither a model directory nor a run directory with checkpoints")
    return saved[-1]


def model_turns(traj: Trajectory, fmt: ChatFormat) -> list[str]:
    """The text of each model turn of an episode."""
    bounds = [*traj.turn_starts, len(traj.token_ids)]
    return [
        fmt.text([t for t, m in zip(traj.token_ids[a:b], traj.mask[a:b], strict=True) if m])
        for a, b in itertools.pairwise(bounds)
    ]


def classify(turns: list[str], secret: int) -> tuple[str, int]:
    """(kind, guess number) of a lost episode's first departure from binary search."""
    low, high = 1, N
    for depth, text in enumerate(turns, 1):
        calls = tool_parser("hermes").parse(text)  # the CPU example's format
        if not calls:
            return "no_guess", depth
        call = calls[0]
        if not isinstance(call, ToolCall) or call.name != "guess" or len(calls) > 1:
            return "malformed_call", depth
        n = call.arguments.get("n")
        if not isinstance(n, int) or not low <= n <= high:
            return "outside_interval", depth
        if n != (low + high) // 2:
            return "off_midpoint", depth
        if n == secret:
            break
        low, high = (n + 1, high) if n < secret else (low, n - 1)
    return "no_guess", len(turns)


async def play(model_dir: Path, episodes: int, temperature: float, seed: int) -> dict[str, Any]:
    cfg = load_config(None, [f"engine.seed={seed}", "rollout.env=guess_number"])
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer is None:
        raise SystemExit(f"{model_dir} has no tokenizer")
    fmt = ChatFormat(tokenizer)
    tasks = evaluation_tasks(GuessNumber, seed, episodes)
    trajectories = await play_policy(model_dir, GuessNumber, tasks, cfg, temperature)
    secrets = [int(task.setup.removeprefix("secret = ")) for task in tasks]
    played = list(zip(trajectories, secrets, strict=True))
    kinds: Counter[str] = Counter()
    outside_depth: Counter[int] = Counter()
    wins = 0
    for traj, secret in played:
        if traj.reward:
            wins += 1
            continue
        kind, depth = classify(model_turns(traj, fmt), secret)
        kinds[kind] += 1
        if kind == "outside_interval":
            outside_depth[depth] += 1
    return {
        "model_dir": str(model_dir),
        "episodes": episodes,
        "temperature": temperature,
        "wins": wins,
        "losses": dict(kinds.most_common()),
        "outside_interval_by_guess": {str(k): v for k, v in sorted(outside_depth.items())},
        "max_guesses": MAX_GUESSES,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.episodes < 1 or args.temperature < 0:
        raise SystemExit("--episodes must be >= 1 and --temperature >= 0")
    torch.set_num_threads(1)
    result = asyncio.run(play(model_dir_of(args.path), args.episodes, args.temperature, args.seed))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
