"""Host <-> device KV transfer and the cost of layer-wise streaming, on the device given.

Two measurements on one model shape (`--preset`; random weights):

1. `copies`: pages moved through the engine's own `KVCache`, as the radix tree moves them
   (`to_host` until the copy has landed on the host, `to_device`: every layer of N pages), and
   every layer of N pages streamed from the host tier one layer ahead, as a banded step reads
   them (`tier_copies.StreamedLayers`). Bytes per second, the median of `--repeats`.
2. `decode`: `--requests` greedy requests at `--context` tokens decode `--steps` steps on the real
   engine twice, side by side: every layer on device, and with `engine.layer_residency` where the
   pressure keeps 1/`bands` of each request's layers on device (the device pool is sized so the
   pressure sits in the band the threshold asks for). Step time per run, bytes streamed per step,
   the ratio, and whether the outputs are identical.

On a CPU both tiers are the same memory: the figures are memcpy and context only. On a GPU
(`--device cuda`) they are the PCIe figures issue 5 asks for; there the copies run on a side
stream through pinned memory, and a decode step copies layer i+1 while layer i computes.

    python benchmarks/kv_transfer.py [--device cpu|cuda] [--preset tiny] [--requests 8]
        [--context 512] [--steps 8] [--pages 256] [--repeats 5] [--threads 2]
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

from devices import device_problem  # noqa: E402

from venusrl.engine.attention import BandedPages  # noqa: E402
from venusrl.engine.config import EngineConfig  # noqa: E402
from venusrl.engine.engine import Engine  # noqa: E402
from venusrl.engine.kv_cache import KVCache  # noqa: E402
from venusrl.engine.kv_manager import DTYPES  # noqa: E402
from venusrl.engine.tier_copies import StreamedLayers  # noqa: E402
from venusrl.model.directory import (  # noqa: E402
    ModelConfigError,
    init_model_dir,
    load_model,
    read_model_config,
)
from venusrl.policy.critical_groups import HIGH  # noqa: E402
from venusrl.policy.layer_residency import LayerResidency  # noqa: E402
from venusrl.types import SamplingParams, TurnMeta  # noqa: E402

PAGE_SIZE = 16


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copies(cfg: Any, device: torch.device, dtype: torch.dtype, pages: int, repeats: int) -> dict:
    kv = KVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        page_size=PAGE_SIZE,
        device_pages=2 * pages + 1,
        host_pages=2 * pages,
        dtype=dtype,
        device=device,
    )
    device_pages = kv.device_pages.allocate(pages)

    def offload() -> None:
        host = kv.to_host(device_pages)
        kv.copies.settle(host)  # landed on the host, not only queued
        kv.free_host(host)

    host = kv.to_host(device_pages)

    def load() -> None:
        loaded = kv.to_device(host)
        assert loaded is not None
        kv.device_pages.free(loaded)

    every_layer_streamed = BandedPages(first=0, host=torch.tensor(host), layers=range(0))

    def streamed() -> None:
        layers = StreamedLayers([every_layer_streamed], kv.copies)
        for i in range(cfg.num_layers):
            assert layers.layer(i) is not None
            layers.prefetch(after=i)

    all_layers = kv.page_bytes() * pages
    seconds = {
        "to_host": timed(offload, device, repeats),
        "to_device": timed(load, device, repeats),
        "streamed_layers": timed(streamed, device, repeats),
    }
    moved = {"to_host": all_layers, "to_device": all_layers, "streamed_layers": all_layers}
    return {
        "pages": pages,
        "page_bytes_all_layers": kv.page_bytes(),
        **{
            name: {"seconds": round(s, 6), "gb_per_s": round(moved[name] / s / 1e9, 3)}
            for name, s in seconds.items()
        },
    }


def decode(
    model_dir: Path,
    device: torch.device,
    dtype: str,
    args: argparse.Namespace,
    threshold: float | None,
    pool_pages: int,
) -> dict:
    cfg = EngineConfig(
        device=str(device),
        dtype=dtype,  # type: ignore[arg-type]
        page_size=PAGE_SIZE,
        device_kv_pages=pool_pages,
        host_kv_pages=2 * pool_pages,
        layer_residency=threshold,
        max_context=args.context + args.steps + 2,
    )
    model = load_model(model_dir, str(device), DTYPES[dtype])
    engine = Engine(model, cfg)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    ids = [
        engine.add_request(
            [(7 * r + 13 * i) % vocab for i in range(args.context)], params, TurnMeta(priority=HIGH)
        ).request_id
        for r in range(args.requests)
    ]
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()  # prefill (and the first token)
    streamed_before, times, bands = engine.stats.streamed_bytes, [], set()
    while engine.has_work():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        bands |= {r.banded.bands if r.banded else 1 for r in engine.running}
    engine.check()
    return {
        "bands": sorted(bands),
        "step_s_median": round(statistics.median(times), 5),
        "steps": len(times),
        "preemptions": engine.stats.preemptions,
        "streamed_bytes_per_step": (engine.stats.streamed_bytes - streamed_before) // len(times),
        "outputs": [engine.pop_finished(i).token_ids for i in ids],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pages", type=int, default=256, help="pages per copy measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--threshold", type=float, default=0.5, help="engine.layer_residency of the banded run"
    )
    parser.add_argument("--model-dir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    for name in ("requests", "context", "steps", "pages", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    if not 0 < args.threshold < 1:
        raise SystemExit("--threshold must be in (0, 1)")
    if problem := device_problem(args.device):
        raise SystemExit(problem)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if device.type == "cuda" else "float32"

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if not (model_dir / "config.json").exists():
            try:
                init_model_dir(model_dir, args.preset, seed=0)
            except ModelConfigError as e:
                raise SystemExit(f"--preset: {e}") from None
        cfg = read_model_config(model_dir)
        if args.context + args.steps + 2 > cfg.max_position_embeddings:
            raise SystemExit(f"--context: {args.context} tokens do not fit this model")
        # Size the pool so the pressure sits in the middle of the first band level: half the
        # layers of every request stay on device (the policy halves again further up).
        policy = LayerResidency(args.threshold)
        level2 = 1 - (1 - args.threshold) / 2
        pressure = (args.threshold + level2) / 2
        need = args.requests * -(-(args.context + args.steps + 1) // PAGE_SIZE)
        pool = max(int(need / pressure) + 1, -(-args.context // PAGE_SIZE) + 2)
        copy = copies(cfg, device, DTYPES[dtype], args.pages, args.repeats)
        resident = decode(model_dir, device, dtype, args, None, pool)
        banded = decode(model_dir, device, dtype, args, args.threshold, pool)
    identical = resident.pop("outputs") == banded.pop("outputs")
    print(json.dumps({
        "device": str(device),
        "dtype": dtype,
        "preset": args.preset,
        "layers": cfg.num_layers,
        "threads": args.threads,
        "copies": copy,
        "decode": {
            "requests": args.requests,
            "context": args.context,
            "device_kv_pages": pool,
            "pressure": round(need / pool, 3),
            "expected_bands": policy.bands(need / pool, cfg.num_layers),
            "resident": resident,
            "banded": banded,
            "step_time_ratio": round(banded["step_s_median"] / resident["step_s_median"], 3),
        },
        "outputs_identical": identical,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
