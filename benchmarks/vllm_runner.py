"""Run a token-id workload through vLLM's CPU build and report throughput.

Baseline for the throughput benchmark. Run it with the interpreter of the
separate venv made by benchmarks/setup_vllm.sh:

    .venv-vllm/bin/python benchmarks/vllm_runner.py \
        --model DIR --workload FILE.json --threads N

The workload is {"requests": [{"prompt_token_ids": [...], "max_tokens": n}]}.
Every request is decoded greedily for exactly max_tokens tokens (EOS ignored),
all requests are submitted in one `LLM.generate` call, and that call is timed.

stdout gets exactly one line, a JSON object:
    {"engine", "generated_tokens", "elapsed_s", "tokens_per_s", "outputs",
     "vllm_version", ...}
Everything else (vLLM's logs, its engine process's output) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, TextIO


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (safetensors)")
    p.add_argument("--workload", required=True, help="workload JSON file")
    p.add_argument("--threads", type=int, required=True, help="CPU threads for the model")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size (GiB)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: longest prompt + max_tokens in the workload",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    return p.parse_args()


def redirect_stdout_to_stderr() -> TextIO:
    """Point fd 1 at stderr (for us and the engine processes we spawn).

    Returns a stream on the original stdout, kept for the final JSON line.
    """
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return result


def configure_cpu_env(threads: int, kv_cache_gib: int) -> None:
    """Environment read by vLLM's CPU backend; must be set before importing vllm."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cpus):
        sys.exit(f"--threads must be in 1..{len(cpus)} (CPUs available to this process)")
    # The model worker's OpenMP threads: one per listed CPU. The default
    # ("auto") keeps one core back for the scheduler, i.e. 1 thread on 2 cores.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[:threads])
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # GiB; default: most of RAM
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # default is stdout
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no network here anyway
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_workload(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        requests = json.load(f)["requests"]
    if not requests:
        sys.exit(f"{path}: no requests")
    return requests


def main() -> None:
    args = parse_args()
    real_stdout = redirect_stdout_to_stderr()
    configure_cpu_env(args.threads, args.kv_cache_gib)
    requests = load_workload(args.workload)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    max_model_len = args.max_model_len or max(
        len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in requests
    )

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enable_prefix_caching=True,
        seed=0,
        max_model_len=max_model_len,
    )
    startup_s = time.perf_counter() - t0
    try:

        def params(n: int) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

        # Warm-up: short prompts sharing no prefix with the workload.
        warm = [TokensPrompt(prompt_token_ids=[i + 1] * 16) for i in range(2)]
        llm.generate(warm, [params(8)] * len(warm), use_tqdm=False)

        prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in requests]
        sampling = [params(int(r["max_tokens"])) for r in requests]
        samples = []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()  # every run starts cold, as the first one did
            t0 = time.perf_counter()
            results = llm.generate(prompts, sampling, use_tqdm=False)
            samples.append(time.perf_counter() - t0)
        elapsed = statistics.median(samples)
    finally:
        llm.llm_engine.engine_core.shutdown()  # stop the engine process now

    outputs = [list(r.outputs[0].token_ids) for r in results]
    total = sum(len(o) for o in outputs)
    report = {
        "engine": "vllm",
        "generated_tokens": total,
        "elapsed_s": elapsed,
        "elapsed_samples_s": samples,
        "tokens_per_s": total / elapsed,
        "outputs": outputs,
        "vllm_version": vllm.__version__,
        "threads": args.threads,
        "startup_s": startup_s,
    }
    real_stdout.write(json.dumps(report) + "\n")
    real_stdout.flush()


if __name__ == "__main__":
    main()
