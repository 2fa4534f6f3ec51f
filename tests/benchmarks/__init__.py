"""Tests of the benchmark commands: each runs as a user runs it, in its own process; arguments a
benchmark must refuse before it does any work are checked in the test's own process."""

from __future__ import annotations

import contextlib
import io
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/SCRIPT ARGS...`, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True
    )


def refused(script: str, *args: str) -> tuple[int, str]:
    """`python benchmarks/SCRIPT ARGS...` run in this process, for arguments it must refuse:
    its exit status and stderr, as the interpreter gives them (`SystemExit("message")` prints the
    message and exits 1). A process of its own spends seconds importing torch before it reads
    its arguments. An exception other than SystemExit propagates and fails the test, as a
    traceback would."""
    path = ROOT / "benchmarks" / script
    stderr = io.StringIO()
    code: int = 0
    with (
        mock.patch.object(sys, "argv", [str(path), *args]),
        mock.patch.object(sys, "path", list(sys.path)),  # the script puts ROOT first
        contextlib.redirect_stderr(stderr),
    ):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
    return code, stderr.getvalue()
