"""Time to publish the trainer's weights into an engine, against model size, printed as JSON.

For each preset (random weights, fp32), an in-process engine takes the weights of a trainer
as `venusrl train` publishes them each step: from one trainer process (views of its own
tensors, copied in place) and from `trainer.world_size=2` FSDP2 ranks (each parameter gathered
by the ranks, streamed from rank 0 in flat buckets over shared memory, checked against the
manifest, copied as it arrives). Both publish the same weights in turn (A B A B), the median of
`--repeats`; the figure is seconds and bytes per second of weights, and the ranks' time against
one process's. Absolute times are context: this machine is shared.

    python benchmarks/publish_weights.py [--presets micro,tiny,small] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.engine.config import EngineConfig  # noqa: E402
from venusrl.engine.engine import Engine  # noqa: E402
from venusrl.model.directory import init_model_dir, load_model  # noqa: E402
from venusrl.model.presets import PRESETS  # noqa: E402
from venusrl.trainer.config import TrainerConfig  # noqa: E402
from venusrl.trainer.ranks import RankedTrainer  # noqa: E402
from venusrl.trainer.trainer import GRPOTrainer  # noqa: E402


def timed(publish: Callable[[], None]) -> float:
    started = time.perf_counter()
    publish()
    return time.perf_counter() - started


def measure(preset: str, repeats: int, threads: int, root: Path) -> dict[str, Any]:
    model_dir = init_model_dir(root / preset, preset=preset, seed=0)
    engine = Engine.from_model_dir(model_dir, EngineConfig(device_kv_pages=64, max_context=256))
    one = GRPOTrainer(load_model(model_dir), TrainerConfig())
    ranks = RankedTrainer(model_dir, TrainerConfig(world_size=2, rank_threads=max(1, threads // 2)))
    try:
        weight_bytes = sum(t.nbytes for _, t in engine.model.hf_state_dict().items())
        times: dict[str, list[float]] = {"one_process": [], "two_ranks": []}
        version = 0
        for _ in range(repeats + 1):  # the first pair warms both up
            for name, trainer in (("one_process", one), ("two_ranks", ranks)):
                version += 1
                seconds = timed(
                    lambda t=trainer, v=version: engine.update_weights(t.hf_weights(), version=v)
                )
                times[name].append(seconds)
        expected = one.model.hf_state_dict()
        got = engine.model.hf_state_dict()
        same = all(torch.equal(got[k], expected[k]) for k in expected)  # the ranks' last publish
    finally:
        ranks.close()
    out: dict[str, Any] = {
        "preset": preset,
        "weight_bytes": weight_bytes,
        "ranks_weights_equal": same,
    }
    for name, samples in times.items():
        median = statistics.median(samples[1:])
        out[name] = {
            "seconds": [round(s, 4) for s in samples[1:]],
            "median_s": round(median, 4),
            "gb_per_s": round(weight_bytes / median / 1e9, 3),
        }
    ratios = [r / o for o, r in zip(times["one_process"][1:], times["two_ranks"][1:], strict=True)]
    out["ranks_over_one_process"] = round(statistics.median(ratios), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="micro,tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    presets = args.presets.split(",")
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; presets: {', '.join(PRESETS)}")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(p, args.repeats, args.threads, Path(tmp)) for p in presets]
    print(json.dumps({"threads": args.threads, "presets": results}, indent=1))


if __name__ == "__main__":
    main()
