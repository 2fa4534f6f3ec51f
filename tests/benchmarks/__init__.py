"""Tests of the benchmark commands: each runs as a user runs it, in its own process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/SCRIPT ARGS...`, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True
    )
