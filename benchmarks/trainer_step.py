"""Trainer step time: one process against `trainer.world_size=2` FSDP2 ranks at the same total
threads, on CPU, printed as JSON.

The batch is shaped like the CPU example's (B x K = 32 rows of ~500 tokens that share a
~190-token system prompt, turns of model tokens between observations), on the example's model
(the `micro` preset) and trainer defaults (KL penalty on, so the reference's forward is in the
step). Both trainers are built once (their start is reported apart) and step on the same batches,
one process then the ranks, pair by pair (A B A B): each pair's ratio (ranks / one process) is the
figure and their median the summary; absolute times are context only. The ranks' time includes
dealing the rows to them over pipes and their collectives (FSDP2's all-gathers and
reduce-scatters over gloo), which is the overhead this measures.

    python benchmarks/trainer_step.py                      # micro, 32 rows, 8 pairs, 2 threads
    python benchmarks/trainer_step.py --preset tiny --pairs 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from venusrl.engine.model_dir import init_model_dir, load_model
from venusrl.trainer.api import Trainer
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.ranks import RankedTrainer
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import Trajectory

TURN_TOKENS, OBSERVATION_TOKENS = 24, 40  # the CPU example's turn cap; a tool response's size


def batch(
    seed: int, rows: int, prefix: int, tokens: int, vocab: int
) -> tuple[list[Trajectory], list[float]]:
    """`rows` trajectories of about `tokens` tokens sharing a `prefix`-token prompt, with
    advantages of both signs (every row trains)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(prefix)]
    trajectories = []
    for i in range(rows):
        prompt = shared + [rng.randrange(1, vocab) for _ in range(20)]
        t = Trajectory.start(f"t{i}", f"g{i // 8}", f"p{i // 8}", prompt)
        while len(t.token_ids) < tokens:
            n = rng.randrange(TURN_TOKENS // 2, TURN_TOKENS + 1)
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            t.add_model_turn(ids, [-rng.uniform(1.0, 4.0) for _ in ids], [0] * n)
            t.add_observation([rng.randrange(1, vocab) for _ in range(OBSERVATION_TOKENS)])
        trajectories.append(t)
    return trajectories, [1.0 if i % 2 else -1.0 for i in range(rows)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(Path(tmp) / "model", preset=args.preset, tokenizer=False)
        config = TrainerConfig()  # the CPU example's trainer
        vocab = load_model(model_dir).config.vocab_size
        batches = [
            batch(args.seed + i, args.rows, args.prefix, args.tokens, vocab)
            for i in range(args.pairs + 1)
        ]
        started = time.perf_counter()
        one: Trainer = GRPOTrainer(load_model(model_dir), config)
        start_one = time.perf_counter() - started
        ranked = config.model_copy(update={"world_size": 2, "rank_threads": args.threads // 2})
        started = time.perf_counter()
        ranks: Trainer = RankedTrainer(model_dir, ranked)
        start_ranks = time.perf_counter() - started
        try:
            # A first step of each kind, untimed: the KL reference is frozen, the imitation
            # optimizer made, the allocators warm.
            for trainer in (one, ranks):
                trainer.step(*batches[0])
                trainer.imitation_step(batches[0][0], lr=1e-4)
            grpo: dict[str, list[float]] = {"one_s": [], "ranks_s": []}
            imitation: dict[str, list[float]] = {"one_s": [], "ranks_s": []}
            for trajectories, advantages in batches[1:]:
                for name, trainer in (("one_s", one), ("ranks_s", ranks)):
                    started = time.perf_counter()
                    trainer.step(trajectories, advantages)
                    grpo[name].append(time.perf_counter() - started)
                for name, trainer in (("one_s", one), ("ranks_s", ranks)):
                    started = time.perf_counter()
                    trainer.imitation_step(trajectories, lr=1e-4)
                    imitation[name].append(time.perf_counter() - started)
        finally:
            ranks.close()
    rows_tokens = [len(t.token_ids) for t in batches[0][0]]
    return {
        "preset": args.preset,
        "rows": args.rows,
        "tokens_per_row_mean": statistics.fmean(rows_tokens),
        "shared_prefix_tokens": args.prefix,
        "threads_total": args.threads,
        "rank_threads": args.threads // 2,
        "pairs": args.pairs,
        "start_s": {"one": round(start_one, 3), "ranks": round(start_ranks, 3)},
        "grpo_step": _ratios(grpo),
        "imitation_step": _ratios(imitation),
        "target_ratio_at_most": 1.15,
    }


def _ratios(times: dict[str, list[float]]) -> dict[str, Any]:
    ratios = [r / o for o, r in zip(times["one_s"], times["ranks_s"], strict=True)]
    return {
        "one_s": [round(t, 4) for t in times["one_s"]],
        "ranks_s": [round(t, 4) for t in times["ranks_s"]],
        "ratio": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=190, help="shared system-prompt tokens")
    parser.add_argument("--tokens", type=int, default=500, help="tokens per row, about")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="total: 2 ranks get half each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads < 2 or args.threads % 2:
        parser.error("--threads must be even and >= 2: each of the 2 ranks gets half")
    if args.rows < 2 or args.pairs < 1 or args.tokens <= args.prefix:
        parser.error("need --rows >= 2, --pairs >= 1 and --tokens > --prefix")
    print(json.dumps(measure(args), indent=1))


if __name__ == "__main__":
    main()
