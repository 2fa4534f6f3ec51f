"""The rollout engine on a GPU: a GRPO-shaped workload's output tokens/s, each decode step against
its memory roofline, `transformers` generate side by side, and the top ops of a profile; JSON.

Per model shape (`--presets`; random weights made on the device, no disk; bf16 on CUDA): G groups
x K requests, the K of a group sharing one ~1K-token prompt, 64-512 output tokens each, sampled at
temperature 1 with a seed per request, EOS ignored (`SamplingParams.ignore_eos`), all submitted
at once. Sections (`--sections`):

- engine: our engine, stepped here with the device synchronised around each `Engine.step()`.
  Output tokens/s, and for each pure decode step at batch >= `--roofline-min-batch` its fraction
  of the memory roofline: (weight bytes + KV bytes its attention reads) / `--peak-bandwidth` /
  step time. The KV read is taken from the step's own batch: a shared prefix counts once per
  group where the step attends it once (cascade groups, engine/batch.py), once per row otherwise.
- hf: `transformers` generate in static batches of `--hf-batch` on the same requests and weights
  (hf_static.py): `speedup_vs_hf`.
- profile: torch.profiler over `--profile-steps` decode steps at full batch: the top ops by host
  time and, on CUDA, the top kernels by device time, with the device's busy time per step against
  the step's wall time.

A profile or baseline that fails is reported in the JSON (`"error"`) and the exit status is 3;
an engine that fails stops the run. `--out FILE` is rewritten after each section.

    python benchmarks/engine_gpu.py            # Qwen3-0.6B and 4B shapes on CUDA (~3 min, a guess)
    python benchmarks/engine_gpu.py --cpu      # tiny sizes on the CPU (seconds): the same code
        [--presets a,b] [--sections engine,hf,profile] [--attention-backend torch|triton|auto]
        [--cuda-graphs] [--groups 32] [--group-size 8] [--prompt-tokens 1024]
        [--output-tokens 64,512] [--hf-batch 128] [--peak-bandwidth 4.8e12]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # run from a checkout, installed or not

from devices import device_problem  # noqa: E402
from hf_static import generate_static, without_early_stop  # noqa: E402

from venusrl.engine.attention import StepBatch  # noqa: E402
from venusrl.engine.config import EngineConfig  # noqa: E402
from venusrl.engine.engine import Engine  # noqa: E402
from venusrl.engine.kv_manager import DTYPES  # noqa: E402
from venusrl.model.architecture import CausalLM, ModelConfig  # noqa: E402
from venusrl.model.directory import QWEN3_DEFAULTS, build_model  # noqa: E402
from venusrl.model.presets import PRESETS  # noqa: E402
from venusrl.types import SamplingParams  # noqa: E402

SECTIONS = ("engine", "hf", "profile")
SECTION_FAILED = 3  # exit status: the engine's figures are in, the profile or HF baseline failed
# What each mode runs unless a flag says otherwise: the workload on a GPU, and the same
# code at sizes a CPU runs in seconds.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": dict(
        device="cuda",
        dtype="bfloat16",
        presets="qwen3-0.6b,qwen3-4b",
        groups=32,
        group_size=8,
        prompt_tokens=1024,
        output_tokens="64,512",
        hf_batch=128,  # 2 batches: a bigger static batch is HF's better figure; 256 risked OOM
        profile_steps=5,
        roofline_min_batch=64,
    ),
    "cpu": dict(
        device="cpu",
        dtype="float32",  # bf16 matmuls are ~2x slower than fp32 on a CPU
        presets="tiny",
        groups=2,
        group_size=4,
        prompt_tokens=384,  # long enough that siblings attend it once (cascade)
        output_tokens="6,16",
        hf_batch=8,
        profile_steps=2,
        roofline_min_batch=1,
    ),
}
PAGE_SIZE = 16


def grpo_workload(
    seed: int,
    groups: int,
    group_size: int,
    prompt_tokens: int,
    output_tokens: tuple[int, int],
    vocab: int,
) -> list[dict[str, Any]]:
    """G x K requests; a group's prompt is `prompt_tokens` +- 1/8, each request's length and
    sampling seed its own."""
    rng = np.random.default_rng(seed)
    low, high = output_tokens
    requests = []
    for _ in range(groups):
        n = int(
            rng.integers(prompt_tokens - prompt_tokens // 8, prompt_tokens + prompt_tokens // 8 + 1)
        )
        prompt = rng.integers(0, vocab, n).tolist()
        for _ in range(group_size):
            requests.append({
                "prompt_token_ids": prompt,
                "max_tokens": int(rng.integers(low, high + 1)),
                "seed": int(rng.integers(0, 2**62)),
            })  # fmt: skip
    return requests


def random_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> CausalLM:
    """A preset's shape with weights drawn on the device as Hugging Face initialises them
    (normal(0, 0.02), norms at 1): a 4B model's 16 GB of fp32 draws on a CPU took minutes."""
    hf = {**QWEN3_DEFAULTS, **PRESETS[preset]}
    model = build_model(ModelConfig.from_hf(hf), device, dtype)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.hf_state_dict().items():  # views of the parameters
            if name.endswith("norm.weight"):
                weight.fill_(1.0)
            else:
                weight.normal_(0.0, 0.02, generator=generator)
    model.pack_for_inference()
    return model.eval()


def hf_twin(preset: str, model: CausalLM) -> Any:
    """The same weights in `transformers`' own Qwen3, on the same device, copied in memory."""
    import transformers

    hf = {k: v for k, v in {**QWEN3_DEFAULTS, **PRESETS[preset]}.items() if k != "model_type"}
    weight = next(model.parameters())
    config = transformers.AutoConfig.for_model("qwen3", **hf)
    with torch.device(weight.device):
        twin = transformers.AutoModelForCausalLM.from_config(config, dtype=weight.dtype)
    twin.to(weight.dtype)  # a transformers older than `dtype=` would have made it fp32
    missing, unexpected = twin.load_state_dict(model.hf_state_dict(), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise SystemExit(f"transformers' Qwen3 differs: missing {missing}, extra {unexpected}")
    return without_early_stop(twin.eval())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Step:
    seconds: float
    decode_rows: int
    prefill_tokens: int
    kv_tokens_read: int  # keys per layer the step's decode attention must read
    cascade: bool  # a shared prefix attended once per group
    graph: bool  # replayed from a CUDA graph


def decode_kv_tokens(batch: StepBatch, page_size: int) -> int:
    """Keys per layer the decode rows read: each row's own keys, plus each shared prefix once
    for its group (what both backends read; padding and gather copies are their overhead)."""
    d = batch.decode
    if d is None:
        return 0
    own = int(d.lengths.sum().item())
    return own + sum(g.num_pages * page_size for g in d.prefix_groups)


class SteppedEngine:
    """Drives `Engine.step()` by hand, timing each step with the device synchronised around it,
    and keeps the batch each step built (wrapping the engine's `BatchBuilder.build`) to count
    what its attention reads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last: StepBatch | None = None
        build = engine.batches.build

        def recorded(work: Any) -> StepBatch:
            self.last = build(work)
            return self.last

        engine.batches.build = recorded  # type: ignore[method-assign]

    def step(self) -> Step | None:
        """One timed step; None when it ran no forward pass (nothing could be scheduled)."""
        self.last = None
        device = self.engine.device
        synchronize(device)
        start = time.perf_counter()
        self.engine.step()
        synchronize(device)
        seconds = time.perf_counter() - start
        batch = self.last
        if batch is None:
            return None
        d, graphs = batch.decode, self.engine.graphs
        return Step(
            seconds=seconds,
            decode_rows=d.num_rows if d is not None else 0,
            prefill_tokens=sum(s.num_tokens for s in batch.prefills),
            kv_tokens_read=decode_kv_tokens(batch, self.engine.page_size),
            cascade=bool(d is not None and d.prefix_groups),
            graph=graphs is not None and graphs.fits(batch),
        )


def make_engine(model: CausalLM, args: argparse.Namespace, requests: Sequence[dict]) -> Engine:
    """An engine whose device pool holds the whole workload at once (no preemption): each
    group's prompt pages once, each request's partial prompt page and its output."""
    output = max(max(r["max_tokens"] for r in requests), args.profile_steps + 4)
    longest = max(len(r["prompt_token_ids"]) for r in requests) + output
    pages = -(-args.prompt_tokens * 9 // 8 // PAGE_SIZE) * args.groups
    pages += sum(-(-(r["max_tokens"] + PAGE_SIZE) // PAGE_SIZE) for r in requests)
    cfg = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        page_size=PAGE_SIZE,
        device_kv_pages=max(pages, -(-longest // PAGE_SIZE)) + 64,
        max_running=len(requests),
        max_context=longest + 1,
        threads=args.threads,
    )
    return Engine(model, cfg)


def params_of(r: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=r["max_tokens"], temperature=1.0, seed=r["seed"], ignore_eos=True
    )


def warm_up(engine: Engine, requests: Sequence[dict[str, Any]], group_size: int) -> None:
    """Two groups whose members finish one by one: kernels compile (Triton's per shape of a
    shared-prefix group, whose member count is a compile-time constant) and graphs are captured
    before anything is timed. The cache is flushed after."""
    warm = [
        dict(r, max_tokens=2 + 2 * (i % group_size))
        for i, r in enumerate(requests[: 2 * group_size])
    ]
    engine.generate([r["prompt_token_ids"] for r in warm], [params_of(r) for r in warm])
    engine.flush_cache()


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Spread of `values`, to 4 significant digits (a CPU's roofline fractions are ~1e-4)."""
    q = np.percentile(values, [0, 10, 25, 50, 75, 90, 100])
    names = ("min", "p10", "p25", "median", "p75", "p90", "max")
    return {name: float(f"{v:.4g}") for name, v in zip(names, q, strict=True)}


def run_engine(
    engine: Engine, requests: Sequence[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    stepped = SteppedEngine(engine)
    before = engine.counters()
    graphs_before = len(engine.graphs._by_rows) if engine.graphs is not None else 0
    ids = [engine.add_request(r["prompt_token_ids"], params_of(r)).request_id for r in requests]
    steps: list[Step] = []
    start = time.perf_counter()
    while engine.has_work():
        step = stepped.step()
        if step is not None:
            steps.append(step)
    elapsed = time.perf_counter() - start
    outs = [engine.pop_finished(i) for i in ids]
    counted = {k: v - before[k] for k, v in engine.counters().items()}
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == sum(r["max_tokens"] for r in requests), "EOS was not ignored"

    cfg = engine.model.config

    # Decode reads every weight once a step, but of an untied embedding only the rows it looks up.
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    weight_bytes = sum(nbytes(p) for p in engine.model.parameters())  # a tied weight once
    if not cfg.tie_word_embeddings:
        weight_bytes -= nbytes(engine.model.embed_tokens.weight)
    kv_bytes_per_token = engine.cache.kv.page_bytes() // PAGE_SIZE  # K and V of every layer
    decode = [s for s in steps if s.decode_rows and not s.prefill_tokens]
    at_batch = [s for s in decode if s.decode_rows >= args.roofline_min_batch]
    fractions = [
        (weight_bytes + s.kv_tokens_read * kv_bytes_per_token) / args.peak_bandwidth / s.seconds
        for s in at_batch
    ]
    roofline: dict[str, Any] = {
        "min_batch": args.roofline_min_batch,
        "peak_bandwidth_bytes_per_s": args.peak_bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "steps": len(at_batch),
    }
    if at_batch:
        roofline["fraction"] = percentiles(fractions)
        # How many steps reached each tenth of the roofline ([0, 0.1), ..., [0.9, 1), >= 1).
        roofline["fraction_histogram"] = np.histogram(
            np.minimum(fractions, 1.0), bins=np.linspace(0, 1.0 + 1e-9, 11)
        )[0].tolist()
        roofline["step_ms"] = percentiles([1e3 * s.seconds for s in at_batch])
        roofline["decode_rows"] = percentiles([s.decode_rows for s in at_batch])
        roofline["kv_bytes_read"] = percentiles(
            [s.kv_tokens_read * kv_bytes_per_token for s in at_batch]
        )
    logprobs = [lp for o in outs for lp in o.logprobs]
    report = {
        "elapsed_s": round(elapsed, 3),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / elapsed, 1),
        "steps": len(steps),
        "decode_steps": len(decode),
        "cascade_decode_steps": sum(s.cascade for s in decode),
        "graph_decode_steps": sum(s.graph for s in decode),
        # On CUDA the engine records every bucket when it starts (`DecodeGraphs.capture_all`):
        # this should be 0 there; a bucket made inside the timed run has its cost in the figures.
        "graph_buckets_captured_in_run": (
            len(engine.graphs._by_rows) - graphs_before if engine.graphs is not None else 0
        ),
        "decode_step_ms": percentiles([1e3 * s.seconds for s in decode]) if decode else None,
        "time_in_steps_with_prefill_s": round(sum(s.seconds for s in steps if s.prefill_tokens), 3),
        "prefix_hit_ratio": round(counted["cached_prompt_tokens"] / counted["prompt_tokens"], 4),
        "preemptions": counted["preemptions"],
        "logprobs_finite": all(math.isfinite(lp) for lp in logprobs),
        "roofline": roofline,
    }
    return report


def top_ops(engine: Engine, requests: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
    """torch.profiler over `steps` pure decode steps of the whole workload at once (its prompts
    cached by the engine section, else computed first), after two unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.device
    chosen = [dict(r, max_tokens=steps + 4) for r in requests]
    ids = [engine.add_request(r["prompt_token_ids"], params_of(r)).request_id for r in chosen]
    while engine.waiting or any(r.num_computed < r.num_tokens - 1 for r in engine.running):
        engine.step()  # prefill until every row decodes
    for _ in range(2):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
            synchronize(device)
    profiled_s = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    for i in ids:
        engine.pop_finished(i)
    # Self times, so that rows do not count their children again: on the host every op's (where
    # a launch-bound step spends it), and on CUDA every kernel's, against the step's wall time.
    events = prof.key_averages()
    report: dict[str, Any] = {
        "steps": steps,
        "rows": len(chosen),
        "wall_ms_per_step": round(profiled_s * 1e3 / steps, 3),
        "ops": _top(events, "self_cpu_time_total", steps),
    }
    if device.type == "cuda":
        from torch.autograd import DeviceType

        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        field = "self_device_time_total"
        if kernels and not hasattr(kernels[0], field):
            field = "self_cuda_time_total"  # torch before 2.4
        report["kernels"] = _top(kernels, field, steps)
        report["device_ms_per_step"] = round(
            sum(getattr(e, field) for e in kernels) / 1e3 / steps, 3
        )
    return report


def _top(events: Sequence[Any], field: str, steps: int, n: int = 15) -> list[dict[str, Any]]:
    """The `n` largest of `events` by `field` (microseconds), per step and as a share of all."""
    total = sum(getattr(e, field) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, field), reverse=True)[:n]
    return [
        {
            "name": e.key,
            "calls_per_step": round(e.count / steps, 2),
            "ms_per_step": round(getattr(e, field) / 1e3 / steps, 4),
            "share": round(getattr(e, field) / total, 4),
        }
        for e in ranked
    ]


def run_preset(
    preset: str, args: argparse.Namespace, report: dict[str, Any], done: Callable[[str], None]
) -> bool:
    """Fills `report` section by section, calling `done(section)` after each (a run cut short by
    a timeout keeps what it measured). False when the profile or the baseline failed."""
    device = torch.device(args.device)
    model = random_model(preset, device, DTYPES[args.dtype], args.seed)
    cfg = model.config
    requests = grpo_workload(
        args.seed,
        args.groups,
        args.group_size,
        args.prompt_tokens,
        args.output_tokens,
        cfg.vocab_size,
    )
    report["model"] = {
        "preset": preset,
        "params": cfg.num_params,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "kv_heads": cfg.num_kv_heads,
    }
    report["workload"] = {
        "requests": len(requests),
        "prompt_tokens_median": float(np.median([len(r["prompt_token_ids"]) for r in requests])),
        "output_tokens_total": sum(r["max_tokens"] for r in requests),
    }
    engine = None
    if "engine" in args.sections or "profile" in args.sections:
        engine = make_engine(model, args, requests)
        started = time.perf_counter()
        warm_up(engine, requests, args.group_size)
        report["warm_up_s"] = round(time.perf_counter() - started, 2)
        done("warm-up")
    if "engine" in args.sections:
        assert engine is not None
        report["engine"] = run_engine(engine, requests, args)
        done("engine")
    failed = False
    if "profile" in args.sections:
        assert engine is not None
        profiled = partial(top_ops, engine, requests, args.profile_steps)
        failed |= not guarded(report, "profile", profiled)
        done("profile")
    del engine
    gc.collect()  # the engine's KV pool goes before HF's cache comes (a cycle holds it)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "hf" in args.sections:
        failed |= not guarded(report, "hf", partial(run_hf, preset, model, requests, args))
        if "engine" in report and "error" not in report["hf"]:
            report["speedup_vs_hf"] = round(
                report["engine"]["output_tokens_per_s"] / report["hf"]["output_tokens_per_s"], 2
            )
    del model
    gc.collect()
    if device.type == "cuda":
        report["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    done("hf" if "hf" in args.sections else "end")
    return not failed


def run_hf(
    preset: str, model: CausalLM, requests: Sequence[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    twin = hf_twin(preset, model)
    warm = [dict(r, max_tokens=2) for r in requests[: args.hf_batch]]
    generate_static(twin, warm, args.hf_batch, sample=True, seed=args.seed)  # warm-up
    hf = generate_static(twin, requests, args.hf_batch, sample=True, seed=args.seed)
    hf.pop("outputs")
    hf["output_tokens_per_s"] = round(hf["generated_tokens"] / hf["elapsed_s"], 1)
    hf["elapsed_s"] = round(hf["elapsed_s"], 3)
    hf["batch"] = args.hf_batch
    return hf


def guarded(report: dict[str, Any], section: str, measure: Callable[[], Any]) -> bool:
    """A section other than the engine's own (the profile, the HF baseline): if it fails, the
    error goes into the report and on stderr, and the run goes on; False then."""
    try:
        report[section] = measure()
        return True
    except Exception as e:  # whatever broke there, the engine's figures stand
        traceback.print_exc()
        report[section] = {"error": f"{type(e).__name__}: {e}"}
        return False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--device", help="default: cuda (cpu with --cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 (fp32 on cpu)")
    parser.add_argument("--presets", help="comma-separated model shapes (venusrl/model/presets.py)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="of " + ",".join(SECTIONS))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--cuda-graphs", action="store_true", help="engine.cuda_graphs")
    parser.add_argument("--groups", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--prompt-tokens", type=int, help="a group's prompt, +- 1/8")
    parser.add_argument("--output-tokens", help="LOW,HIGH: each request's, uniform")
    parser.add_argument("--hf-batch", type=int, help="requests per static HF batch")
    parser.add_argument("--profile-steps", type=int)
    parser.add_argument("--roofline-min-batch", type=int, help="decode steps counted: rows >= this")
    parser.add_argument("--peak-bandwidth", type=float, default=4.8e12, help="bytes/s (H200)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here, after each section")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS["cpu" if args.cpu else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.presets = [p for p in args.presets.split(",") if p]
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown or not args.presets:
        parser.error(f"--presets: unknown {unknown}; presets: {', '.join(PRESETS)}")
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections: {args.sections}; sections: {', '.join(SECTIONS)}")
    try:
        low, high = (int(x) for x in args.output_tokens.split(","))
    except ValueError:
        parser.error(f"--output-tokens must be LOW,HIGH, got {args.output_tokens!r}")
    if not 1 <= low <= high:
        parser.error(f"--output-tokens: need 1 <= LOW <= HIGH, got {low},{high}")
    args.output_tokens = (low, high)
    for name in ("groups", "group_size", "prompt_tokens", "hf_batch", "profile_steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_tokens < 8:
        parser.error("--prompt-tokens must be >= 8")
    if not args.peak_bandwidth > 0:
        parser.error("--peak-bandwidth must be > 0")
    if problem := device_problem(args.device):
        parser.error(f"{problem} (--cpu runs the CPU mode)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "cuda_graphs": args.cuda_graphs,
        "seed": args.seed,
        "groups": args.groups,
        "group_size": args.group_size,
        "output_tokens": list(args.output_tokens),
        "presets": {},
    }
    started = time.perf_counter()

    def done(section: str) -> None:
        print(
            f"engine_gpu: {section} done at {time.perf_counter() - started:.1f} s", file=sys.stderr
        )
        if args.out is not None:  # replaced whole, so that a reader never sees half a file
            partial = args.out.with_suffix(".partial")
            partial.write_text(json.dumps(report, indent=1) + "\n")
            partial.replace(args.out)

    ok = True
    for preset in args.presets:
        report["presets"][preset] = {}
        ok &= run_preset(preset, args, report["presets"][preset], done)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    done("all")
    json.dump(report, sys.stdout, indent=1)
    print()
    if not ok:
        sys.exit(SECTION_FAILED)


if __name__ == "__main__":
    main()
