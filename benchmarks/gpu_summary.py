"""The key figures of a `benchmarks/gpu_check.sh` results folder, a line or a few per file:
what a session reads first (the files have everything).

    python benchmarks/gpu_summary.py runs/gpu_check
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def engine_lines(report: dict[str, Any]) -> Iterator[str]:
    """An engine_gpu.py report: per shape its throughput, roofline, HF ratio and top ops."""
    for preset, r in report["presets"].items():
        e, hf, profile = r.get("engine", {}), r.get("hf", {}), r.get("profile", {})
        fraction = e.get("roofline", {}).get("fraction", {}).get("median", float("nan"))
        yield (
            f"{preset} backend={report['attention_backend']} graphs={report['cuda_graphs']}:"
            f" {e.get('output_tokens_per_s')} tok/s, roofline median {fraction:.3g} over"
            f" {e.get('roofline', {}).get('steps')} steps, graph steps"
            f" {e.get('graph_decode_steps')}/{e.get('decode_steps')}, HF"
            f" {hf.get('error') or hf.get('output_tokens_per_s')} tok/s,"
            f" x{r.get('speedup_vs_hf')}, logprobs finite {e.get('logprobs_finite')}"
        )
        if "error" in profile:
            yield f"  profile: {profile['error']}"
        elif profile:
            yield (
                f"  profile at {profile['rows']} rows: {profile['wall_ms_per_step']} ms/step,"
                f" device busy {profile.get('device_ms_per_step')} ms of it"
            )
        for kind in ("kernels", "ops"):
            for op in profile.get(kind, [])[:5]:
                yield (
                    f"    {kind:7} {op['share']:6.1%} {op['ms_per_step']:8.3f} ms/step"
                    f"  {op['name'][:60]}"
                )


def main(out: Path) -> None:
    for log in sorted(out.glob("parity*.log")):
        lines = log.read_text().strip().splitlines()
        print(f"{log.name}: {lines[-1] if lines else '(empty)'}")
    for path in sorted(out.glob("engine-*.json")):
        try:
            for line in engine_lines(json.loads(path.read_text())):
                print(f"{path.name} {line}" if not line.startswith(" ") else line)
        except (OSError, ValueError, KeyError) as e:  # one file's trouble must not hide the rest
            print(f"{path.name}: {type(e).__name__} {e}")
    for name in ("trainer.json", "kv_transfer.json"):
        try:
            r = json.loads((out / name).read_text())
            if name == "trainer.json":
                print(
                    f"trainer {r['preset']} {r['compute_dtype']}: {r['tokens_per_s']} tok/s,"
                    f" MFU {r['mfu']:.3g} of {r['peak_flops']:.3g} FLOP/s"
                )
            else:
                copies = ", ".join(
                    f"{k} {v['gb_per_s']} GB/s"
                    for k, v in r["copies"].items()
                    if isinstance(v, dict)
                )
                print(
                    f"kv transfer: {copies}; banded/resident decode step"
                    f" {r['decode']['step_time_ratio']}, outputs identical {r['outputs_identical']}"
                )
        except (OSError, ValueError, KeyError) as e:  # one file's trouble must not hide the rest
            print(f"{name}: {type(e).__name__} {e}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
