"""The image-sandbox benchmark runs and prints what it says it prints. Slow: it needs the SWE
example's Debian image, and podman."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes and podman need root"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="apt-get install podman"),
]


def test_the_image_sandbox_benchmark_prints_one_json_object_with_every_comparison() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/image_sandboxes.py", "--k", "4", "--repeats", "1",
         "--budget-gib", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=True,
    ).stdout  # fmt: skip
    result = json.loads(out)
    group = result["group_start"]
    assert set(group["median"]) == {"ours", "ours_warm", "cold", "podman"}
    assert all(group[k] > 0 for k in ("start_speedup_vs_podman", "memory_vs_podman"))
    density = result["density"]
    assert density["ours"]["oom_kills"] == 0 and density["quota"]["oom_kills"] == 0
    assert density["ours"]["held"] >= density["quota"]["held"]
    cache = result["cache"]
    assert cache["tasks"] == 4 and cache["cache_mib"] < cache["unshared_mib"]
