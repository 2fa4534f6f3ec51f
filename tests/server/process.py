"""`venusrl serve` as a user starts it: a process on a free port, healthy before a test uses it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(model_dir: Path, *args: str) -> Iterator[str]:
    """The server's URL while it runs `model_dir`; `args` are `venusrl serve`'s flags and
    config overrides."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "venusrl.cli", "serve", "--model", str(model_dir)]
    proc = subprocess.Popen(
        [*command, "--port", str(port), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("server did not become healthy within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
