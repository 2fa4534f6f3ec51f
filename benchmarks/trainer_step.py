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

`--throughput` measures one trainer process on `--device` instead (a GPU's figure: the ranks take
one GPU each): GRPO step tokens/s and model FLOPs utilisation, 6 x params x tokens / step time /
`--peak-flops` (989e12: an H200's dense bf16), the median of `--steps` steps after one warm-up.
It computes in `--param-dtype` (`trainer.param_dtype`: bf16 autocast over fp32 weights; bfloat16
by default on CUDA, float32 elsewhere), which the JSON says; the KL reference's forward
(2 x params x tokens) is in the step but not counted.

    python benchmarks/trainer_step.py                      # micro, 32 rows, 8 pairs, 2 threads
    python benchmarks/trainer_step.py --preset tiny --pairs 6
    python benchmarks/trainer_step.py --throughput --device cuda --preset qwen3-0.6b \
        --rows 32 --tokens 1024 --prefix 0
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
from devices import device_problem

from venusrl.model.architecture import ModelConfig
from venusrl.model.directory import QWEN3_DEFAULTS, build_model, init_model_dir, load_model
from venusrl.model.presets import PRESETS
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


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer process on `args.device`: step tokens/s and model FLOPs utilisation."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig.from_hf({**QWEN3_DEFAULTS, **PRESETS[args.preset]})
    model = build_model(cfg, device)  # made in place, not through a directory on disk
    model.init_random(args.seed)
    dtype = args.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    trainer = GRPOTrainer(model, TrainerConfig(device=args.device, param_dtype=dtype))
    batches = [
        batch(args.seed + i, args.rows, args.prefix, args.tokens, cfg.vocab_size)
        for i in range(args.steps + 1)
    ]

    def timed_step(trajectories: list[Trajectory], advantages: list[float]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        trainer.step(trajectories, advantages)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    warm_up_s = timed_step(*batches[0])  # freezes the KL reference; kernels and allocator warm
    seconds = [timed_step(*b) for b in batches[1:]]
    # The positions the forward and backward run over (a row's last token is only a target); a
    # prefix shared by the rows of a micro-batch is computed once but counted per row.
    tokens = [sum(len(t.token_ids) - 1 for t in trajectories) for trajectories, _ in batches[1:]]
    per_s = [n / t for n, t in zip(tokens, seconds, strict=True)]
    return {
        "mode": "throughput",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "params": cfg.num_params,
        "compute_dtype": dtype,
        "weights_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "rows": args.rows,
        "tokens_per_step": tokens,
        "shared_prefix_tokens": args.prefix,
        "kl_reference_forward": trainer.config.kl_coef > 0,
        "warm_up_s": round(warm_up_s, 3),
        "step_s": [round(t, 4) for t in seconds],
        "tokens_per_s": round(statistics.median(per_s), 1),
        "peak_flops": args.peak_flops,
        "mfu": round(statistics.median(6 * cfg.num_params * r / args.peak_flops for r in per_s), 6),
        "peak_memory_gb": (
            round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
            if device.type == "cuda"
            else None
        ),
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
    parser.add_argument(
        "--throughput", action="store_true", help="one process on --device: tokens/s and MFU"
    )
    parser.add_argument("--device", default="cpu", help="with --throughput")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, with --throughput")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="with --throughput")
    parser.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16"],
        help="with --throughput: compute dtype (default bfloat16 on CUDA, float32 elsewhere)",
    )
    args = parser.parse_args()
    if args.throughput:
        if args.preset not in PRESETS:
            parser.error(f"--preset: unknown {args.preset!r}; presets: {', '.join(PRESETS)}")
        if args.steps < 1 or args.rows < 1 or args.tokens <= args.prefix:
            parser.error("need --steps >= 1, --rows >= 1 and --tokens > --prefix")
        if not args.peak_flops > 0:
            parser.error("--peak-flops must be > 0")
        if problem := device_problem(args.device):
            parser.error(problem)
        print(json.dumps(throughput(args), indent=1))
        return
    if args.device != "cpu":
        parser.error("--device: the ranks comparison runs on the CPU; --throughput for a GPU")
    if args.threads < 2 or args.threads % 2:
        parser.error("--threads must be even and >= 2: each of the 2 ranks gets half")
    if args.rows < 2 or args.pairs < 1 or args.tokens <= args.prefix:
        parser.error("need --rows >= 2, --pairs >= 1 and --tokens > --prefix")
    print(json.dumps(measure(args), indent=1))


if __name__ == "__main__":
    main()
