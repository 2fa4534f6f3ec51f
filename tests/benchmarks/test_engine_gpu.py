"""The GPU benchmark's CPU mode runs the same code end to end at tiny sizes (what
benchmarks/gpu_check.sh --cpu runs too), and reports every figure the GPU run is read for; the
roofline counts a shared prefix's keys once per group when the step attends them once."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmarks import refused, run_benchmark
from venusrl.engine.attention import DecodeBatch, PrefixGroup, StepBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from engine_gpu import decode_kv_tokens
from gpu_summary import main as summarize


@pytest.mark.slow  # runs the benchmark
def test_cpu_mode_reports_throughput_roofline_fractions_hf_ratio_and_top_ops() -> None:
    proc = run_benchmark("engine_gpu.py", "--cpu", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    r = report["presets"]["tiny"]
    e, hf = r["engine"], r["hf"]
    # EOS ignored: every requested token ran, in both engines.
    assert e["output_tokens"] == hf["generated_tokens"] == r["workload"]["output_tokens_total"]
    assert e["logprobs_finite"] is True and e["preemptions"] == 0
    assert e["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert r["speedup_vs_hf"] == round(e["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
    # Groups of 4 compute their prompt once; 3 of 4 siblings read its full pages from the cache,
    # and their decode steps attend it once per group.
    assert 0.6 < e["prefix_hit_ratio"] <= 0.75
    assert 0 < e["cascade_decode_steps"] <= e["decode_steps"] < e["steps"]
    assert e["graph_decode_steps"] == 0  # no --cuda-graphs
    roof = e["roofline"]
    assert roof["steps"] == e["decode_steps"]  # CPU mode counts every batch size
    assert sum(roof["fraction_histogram"]) == roof["steps"]
    fraction = roof["fraction"]
    assert 0 < fraction["min"] <= fraction["median"] <= fraction["max"]
    params = r["model"]["params"]  # fp32; norms are the few bytes beyond the count
    assert params * 4 <= roof["weight_bytes"] < params * 4 * 1.01
    assert roof["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4  # K+V x layers x kv heads x dim x fp32
    profile = r["profile"]
    assert 0 < len(profile["ops"]) <= 15 and "kernels" not in profile  # host time only, on a CPU
    assert all(0 < op["share"] <= 1 for op in profile["ops"])
    assert sum(op["share"] for op in profile["ops"]) <= 1 + 1e-3


def test_a_shared_prefix_counts_once_per_group_and_each_rows_own_keys_once() -> None:
    page_size, rows, width = 16, 3, 2
    lengths = torch.tensor([5, 20, 9], dtype=torch.int32)  # keys after the shared prefix
    group = PrefixGroup(rows=torch.tensor([0, 1]), first_page=3, num_pages=4, pages=None)
    decode = DecodeBatch(
        num_rows=rows,
        pages=torch.zeros(rows, width, dtype=torch.long),
        lengths=lengths,
        key_mask=torch.zeros(1, rows, 1, width * page_size),
        prefix_groups=(group,),
    )
    none = torch.zeros(0, dtype=torch.long)
    batch = StepBatch(none, none, none, none, decode, ())
    assert decode_kv_tokens(batch, page_size) == 5 + 20 + 9 + 4 * page_size
    assert decode_kv_tokens(StepBatch(none, none, none, none, None, ()), page_size) == 0


@pytest.mark.slow  # runs the benchmark
def test_trainer_throughput_mode_reports_tokens_per_second_and_mfu() -> None:
    args = ["--throughput", "--preset", "micro", "--rows", "4", "--tokens", "100", "--prefix", "0"]
    proc = run_benchmark("trainer_step.py", *args, "--steps", "2", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["compute_dtype"] == "float32" and r["kl_reference_forward"] is True
    assert len(r["step_s"]) == len(r["tokens_per_step"]) == 2
    per_s = [n / t for n, t in zip(r["tokens_per_step"], r["step_s"], strict=True)]
    assert abs(r["tokens_per_s"] / statistics.median(per_s) - 1) < 0.01  # step_s is rounded
    mfu = 6 * r["params"] * r["tokens_per_s"] / r["peak_flops"]
    assert abs(r["mfu"] - mfu) <= 1e-6


def test_bad_arguments_are_refused_with_the_flag_named() -> None:
    code, stderr = refused("engine_gpu.py", "--cpu", "--presets", "qwen3-7b")
    assert code != 0 and "--presets" in stderr and "qwen3-4b" in stderr
    code, stderr = refused("engine_gpu.py", "--cpu", "--output-tokens", "9,3")
    assert code != 0 and "--output-tokens" in stderr
    if not torch.cuda.is_available():
        code, stderr = refused("engine_gpu.py")  # the GPU mode, on a machine without one
        assert code != 0 and "no CUDA device" in stderr and "--cpu" in stderr
    code, stderr = refused("trainer_step.py", "--device", "cuda")
    assert code != 0 and "--throughput" in stderr


def test_the_summary_reads_a_cut_short_run_and_names_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a GPU session reads first: a part that failed or never ran is named, not a crash."""
    report = {
        "attention_backend": "auto",
        "cuda_graphs": True,
        "presets": {"qwen3-4b": {"engine": {"output_tokens_per_s": 9000.0}}},
    }
    (tmp_path / "engine-qwen3-4b.json").write_text(json.dumps(report))
    (tmp_path / "parity.log").write_text("....\n28 passed in 40.1s\n")
    (tmp_path / "trainer.json").write_text("{")  # cut short mid-write
    summarize(tmp_path)
    out = capsys.readouterr().out
    assert "parity.log: 28 passed in 40.1s" in out
    assert "engine-qwen3-4b.json qwen3-4b backend=auto graphs=True: 9000.0 tok/s" in out
    assert "trainer.json: JSONDecodeError" in out and "kv_transfer.json: FileNotFoundError" in out
