"""The transfer benchmark measures page copies and decode steps with and without layer bands,
and the banded run streams layers from host with the same outputs."""

from __future__ import annotations

import json

from tests.benchmarks import refused, run_benchmark


def test_banded_decode_streams_layers_from_host_with_identical_outputs() -> None:
    args = ["--preset", "micro", "--requests", "3", "--context", "64", "--steps", "4"]
    proc = run_benchmark("kv_transfer.py", *args, "--pages", "16", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["outputs_identical"] is True
    for name in ("to_host", "to_device", "streamed_layers"):
        assert out["copies"][name]["gb_per_s"] > 0
    dec = out["decode"]
    assert dec["expected_bands"] == 2 and dec["banded"]["bands"] == [2]
    assert dec["resident"]["bands"] == [1] and dec["resident"]["streamed_bytes_per_step"] == 0
    assert dec["banded"]["streamed_bytes_per_step"] > 0
    assert dec["step_time_ratio"] == round(
        dec["banded"]["step_s_median"] / dec["resident"]["step_s_median"], 3
    )


def test_bad_arguments_are_refused_with_the_flag_named() -> None:
    code, stderr = refused("kv_transfer.py", "--threshold", "1.5")
    assert code != 0 and "--threshold" in stderr
    code, stderr = refused("kv_transfer.py", "--device", "nonsense")
    assert code != 0 and "--device" in stderr and "Traceback" not in stderr
