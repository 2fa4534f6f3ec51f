"""Generation throughput on a GRPO-shaped workload: venusrl vs `transformers` vs vLLM (CPU).

One seeded workload (G groups x K requests; the K of a group share one prompt; prompt lengths
log-normal with median 300, <= 1024; output lengths fixed per request, log-normal with median 100,
in [8, 512]; greedy; everything submitted at once) runs through three engines side by side on the
same random-weight Qwen3 model directory:

- venusrl: this repository's engine, in-process;
- hf: `transformers` `generate` in static padded batches of 16, as RL frameworks without a serving
  engine sample; only the tokens each request asked for count as useful;
- vllm: vLLM's CPU build in its own virtualenv (`benchmarks/setup_vllm.sh`), as a subprocess.

Prints one JSON object: tokens/s per engine, `speedup_vs_hf`, `speedup_vs_vllm`, and
`prefix_hit_ratio` (fraction of prompt tokens our engine served from its cache).

    python benchmarks/engine_throughput.py [--preset tiny|small] [--threads 2] [--repeats 3]
                                           [--skip-vllm]

Each engine runs the workload `--repeats` times from a cold prefix cache; the median run is
reported with every run's time beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hf_static import generate_static, without_early_stop

ROOT = Path(__file__).resolve().parent.parent
HF_BATCH = 16


def make_workload(seed: int, groups: int, group_size: int, vocab: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(groups):
        prompt_len = int(np.clip(round(rng.lognormal(np.log(300), 0.5)), 16, 1024))
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        for _ in range(group_size):
            max_tokens = int(np.clip(round(rng.lognormal(np.log(100), 0.6)), 8, 512))
            requests.append({"prompt_token_ids": prompt, "max_tokens": max_tokens})
    return requests


def run_venusrl(model_dir: Path, threads: int) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """Load our engine once; each call runs the workload from a cold prefix cache."""
    from venusrl.engine.config import EngineConfig
    from venusrl.engine.engine import Engine
    from venusrl.types import SamplingParams

    engine = Engine.from_model_dir(model_dir, EngineConfig(threads=threads, device_kv_pages=8192))
    engine.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=8, temperature=0))  # warm-up

    def run(requests: list[dict[str, Any]]) -> dict[str, Any]:
        engine.flush_cache()
        before = engine.counters()
        params = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)
            for r in requests
        ]
        start = time.perf_counter()
        outs = engine.generate([r["prompt_token_ids"] for r in requests], params)
        elapsed = time.perf_counter() - start
        counted = {k: v - before[k] for k, v in engine.counters().items()}  # this run only
        return {
            "elapsed_s": elapsed,
            "generated_tokens": sum(len(o.token_ids) for o in outs),
            "prefix_hit_ratio": counted["cached_prompt_tokens"] / counted["prompt_tokens"],
            "steps": counted["steps"],
            "preemptions": counted["preemptions"],
            "outputs": [o.token_ids for o in outs],
        }

    return run


def run_hf(model_dir: Path, threads: int) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """`transformers` generate in static, left-padded batches of 16 (greedy, no early stop)."""
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    without_early_stop(model.eval())
    return lambda requests: generate_static(model, requests, HF_BATCH, sample=False)


def run_vllm(
    model_dir: Path, requests: list[dict[str, Any]], threads: int, python: Path, repeats: int
) -> dict[str, Any]:
    if not python.exists():
        print("vLLM's environment is missing; running benchmarks/setup_vllm.sh", file=sys.stderr)
        setup = subprocess.run(["bash", str(ROOT / "benchmarks" / "setup_vllm.sh")], check=False)
        if setup.returncode != 0 or not python.exists():
            raise SystemExit("could not set up vLLM (see above); pass --skip-vllm to go without")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"requests": requests}, f)
    cmd = [
        str(python),
        str(ROOT / "benchmarks" / "vllm_runner.py"),
        "--model",
        str(model_dir),
        "--workload",
        f.name,
        "--threads",
        str(threads),
        "--repeats",
        str(repeats),
    ]
    # The same allocator tuning our process applies (venusrl/engine/host_malloc.py), so that
    # vLLM is not slowed by page faults our engine avoids.
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    }
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, check=False, env=env
        )
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM runner failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time, plus every run's time."""
    ordered = sorted(runs, key=lambda r: r["elapsed_s"])
    median = dict(ordered[len(ordered) // 2])
    median["tokens_per_s"] = median["generated_tokens"] / median["elapsed_s"]
    median["elapsed_samples_s"] = [r["elapsed_s"] for r in runs]
    return median


def agreement(a: list[list[int]], b: list[list[int]], prefix: int = 16) -> float:
    """Fraction of requests whose first `prefix` greedy tokens agree (fp32 ties may differ)."""
    same = sum(x[:prefix] == y[:prefix] for x, y in zip(a, b, strict=True))
    return same / len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model shape: tiny or small (~100M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--engines", default="venusrl,hf,vllm")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--model-dir", type=Path, help="default: runs/bench-models/PRESET")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from venusrl.model.directory import init_model_dir, read_model_config

    model_dir = args.model_dir or ROOT / "runs" / "bench-models" / args.preset
    if not (model_dir / "config.json").exists():
        init_model_dir(model_dir, args.preset, seed=args.seed)
    cfg = read_model_config(model_dir)
    requests = make_workload(args.seed, args.groups, args.group_size, cfg.vocab_size)
    engines = [e for e in args.engines.split(",") if e and not (args.skip_vllm and e == "vllm")]
    unknown = set(engines) - {"venusrl", "hf", "vllm"}
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; engines: venusrl, hf, vllm")

    # Ours and HF run in this process, interleaved run by run so that a noisy neighbour hits
    # both alike; vLLM repeats inside its own process (its start-up costs over a minute).
    runners = {"venusrl": run_venusrl, "hf": run_hf}
    in_process = {
        name: runners[name](model_dir, args.threads) for name in engines if name in runners
    }
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in in_process}
    for _ in range(args.repeats):
        for name, run in in_process.items():
            samples[name].append(run(requests))
    results = {name: _median_run(runs) for name, runs in samples.items()}
    if "vllm" in engines:
        results["vllm"] = run_vllm(
            model_dir, requests, args.threads, args.vllm_python, args.repeats
        )
    report: dict[str, Any] = {
        "workload": {
            "groups": args.groups,
            "group_size": args.group_size,
            "seed": args.seed,
            "prompt_tokens_median": float(
                np.median([len(r["prompt_token_ids"]) for r in requests])
            ),
            "output_tokens_total": sum(r["max_tokens"] for r in requests),
            "repeats": args.repeats,
        },
        "model": {
            "preset": args.preset,
            "params": cfg.num_params,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
        },
        "threads": args.threads,
        "engines": {
            name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()
        },
    }
    ours = results.get("venusrl")
    if ours is not None:
        report["prefix_hit_ratio"] = ours["prefix_hit_ratio"]
        for other in ("hf", "vllm"):
            if other in results:
                report[f"speedup_vs_{other}"] = (
                    ours["tokens_per_s"] / results[other]["tokens_per_s"]
                )
                report[f"greedy_agreement_with_{other}"] = agreement(
                    ours["outputs"], results[other]["outputs"]
                )
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
