"""The pool's handle on a zygote process (`zygote`): starting one, on this machine's Python or
in an image, and its three requests, driven from asyncio through a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from venusrl.envs import wire


def zygote_env() -> dict[str, str]:
    """An allow-list: the pool's environment (tokens, keys) never reaches a template."""
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "TZ")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return {**env, **ONE_THREAD}


# One BLAS thread per sandbox: its CPU share is bounded anyway, and thread pools created in the
# zygote do not survive fork.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ZygoteError(Exception):
    pass


def _import_from(code_dir: str) -> str:
    """Python that makes `code_dir` the first place imports look: the few sandbox modules,
    imported in milliseconds, where the package's __init__ would import the whole pool."""
    return f"import sys; sys.path.insert(0, {code_dir!r});"


class OutputTail:
    """The last `keep` bytes a process wrote to a pipe, read as they come by a thread of its
    own: an image's Python may write without end, and never blocks on a full pipe."""

    def __init__(self, keep: int = 64 << 10) -> None:
        self._read, self.write_fd = os.pipe()
        self._keep, self._data, self._lock = keep, bytearray(), threading.Lock()
        self._thread = threading.Thread(target=self._drain, daemon=True, name="zygote-output")
        self._thread.start()

    def _drain(self) -> None:
        while chunk := os.read(self._read, 1 << 16):
            with self._lock:
                self._data += chunk
                del self._data[: -self._keep]
        os.close(self._read)

    def started(self) -> None:
        """The process has its copy of the write end: ours goes, so its exit ends the tail."""
        with contextlib.suppress(OSError):
            os.close(self.write_fd)

    def last(self, n: int = 2000) -> str:
        self._thread.join(0.2)  # what a dying process wrote just before its answer
        with self._lock:
            return bytes(self._data[-n:]).decode(errors="replace").strip()


class Zygote:
    """Handle on a zygote process; one request at a time."""

    def __init__(
        self,
        sock: socket.socket,
        proc: subprocess.Popen[bytes] | None,
        output: OutputTail | None = None,
    ) -> None:
        self._sock = sock
        self._proc = proc
        self._output = output  # an image zygote's stdout and stderr, quoted in its errors
        self._lock = threading.Lock()

    @classmethod
    async def start(cls, cgroup_procs: list[str], code_dir: str) -> Zygote:
        """A fresh interpreter of this machine whose every page is charged to the given cgroup:
        a shell joins the cgroup, then execs Python. It imports the sandbox's modules from
        `code_dir` (`templates.INSIDE_MODULES`), not the whole package."""
        ours, theirs = socket.socketpair()
        join = "".join(f'echo $$ > "{p}" && ' for p in cgroup_procs)
        main = f"{_import_from(code_dir)} from venusrl.envs.zygote import main; main()"
        cmd = f'{join}exec "$0" -c "{main}" {theirs.fileno()}'
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd, sys.executable],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=zygote_env(),
            start_new_session=True,  # no controlling terminal for anything forked from it
        )
        theirs.close()
        return cls(ours, proc)

    async def image(
        self, cgroup_procs: list[str], config: dict[str, Any], timeout_s: float
    ) -> Zygote:
        """From this (bare, host) zygote: a child that becomes the image's Python as a zygote
        (`zygote._become_image_zygote`), in the given cgroup, its output kept in a tail.
        `ZygoteError` when it does not come up."""
        output = OutputTail()
        try:
            header = {"op": "image", "config": config}
            sock = await self._new_process(header, cgroup_procs, timeout_s, output.write_fd)
        finally:
            output.started()
        zygote = Zygote(sock, None, output)
        # Up once it answers: a setup of nothing.
        await zygote.setup("ping", "", timeout_s)
        return zygote

    def _log_tail(self) -> str:
        tail = self._output.last() if self._output is not None else ""
        return f"\n{tail}" if tail else ""

    def _call(
        self, header: dict[str, Any], blob: bytes | None, timeout_s: float, fds: tuple[int, ...]
    ) -> int | None:
        with self._lock:
            self._sock.settimeout(timeout_s)
            try:
                wire.send(self._sock, header, (blob,) if blob is not None else (), fds)
                reply, _, got = wire.recv_with_fds(self._sock, 1, max_blob_bytes=0)
            except (OSError, EOFError, wire.WireError) as e:
                problem = f"zygote did not answer {header['op']}: {e!r}{self._log_tail()}"
                raise ZygoteError(problem) from None
        if "error" in reply:
            for fd in got:
                os.close(fd)
            raise ZygoteError(f"{reply['error']}{self._log_tail()}")
        return got[0] if got else None  # recv_with_fds took at most one

    async def setup(self, name: str, code: str, timeout_s: float) -> None:
        header = {"op": "setup", "name": name}
        await asyncio.to_thread(self._call, header, code.encode(), timeout_s, ())

    async def spawn(
        self, cfg: dict[str, Any], cgroup_procs: list[str], python: bool, timeout_s: float = 30.0
    ) -> socket.socket:
        header = {"op": "spawn", "config": cfg, "python": python}
        return await self._new_process(header, cgroup_procs, timeout_s)

    async def fork(self, cgroup_procs: list[str], timeout_s: float = 30.0) -> Zygote:
        sock = await self._new_process({"op": "fork"}, cgroup_procs, timeout_s)
        return Zygote(sock, None, self._output)

    async def _new_process(
        self,
        header: dict[str, Any],
        cgroup_procs: list[str],
        timeout_s: float,
        output_fd: int | None = None,
    ) -> socket.socket:
        """A request that makes a process (a member, a group zygote, an image zygote) in the
        given cgroups: the socket to it. An image zygote's `output_fd` goes first."""
        fds = open_cgroups(cgroup_procs)
        sent = (output_fd, *fds) if output_fd is not None else tuple(fds)
        try:
            fd = await asyncio.to_thread(self._call, header, None, timeout_s, sent)
        finally:
            for f in fds:
                os.close(f)
        if fd is None:
            raise ZygoteError(f"zygote answered {header['op']} without the new process's socket")
        return socket.socket(fileno=fd)

    def close(self) -> None:
        """Closing the socket ends the zygote (it exits on EOF); the pool also kills its cgroup."""
        self._sock.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


def open_cgroups(cgroup_procs: list[str]) -> list[int]:
    """The cgroups' `cgroup.procs`, open for a process to write its pid into."""
    fds: list[int] = []
    try:
        for path in cgroup_procs:
            fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
