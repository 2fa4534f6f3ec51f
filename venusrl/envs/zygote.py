"""Warm templates: one interpreter that sets up once, then forks sandboxes in ~2 ms.

A zygote is a Python process that runs a template's setup (imports, data, tool functions), calls
`gc.freeze()` so the garbage collector never writes to the template's objects (which would copy
their pages into every child), and then serves three requests from the pool: `spawn` a sandbox
(fork, then `isolation.enter`, then `member.serve`), `fork` a group zygote (fork, join the group's
cgroup, run the group's setup on top), and `setup`. Children share the template's pages
copy-on-write, so K members of a 200 MB template cost one template plus their private pages
(MEASURED.md: 248 MB instead of 3.5 GB for K=16).

The process side (`main`, `serve`) is blocking and single-threaded, as fork requires; the pool side
(`Zygote`) drives it from asyncio through a worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

from venusrl.envs import wire
from venusrl.envs.isolation import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    IsolationConfig,
    enter,
    prctl,
)


def _become_zygote(cgroup_procs: list[str]) -> None:
    for procs in cgroup_procs:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    # A pool-wide OOM should take a sandbox, not the template every sandbox forks from (best
    # effort: lowering it needs CAP_SYS_RESOURCE, which a container's root may lack).
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("-900")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the pool died: so do its zygotes
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # sandbox inits are adopted here...
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ...and reaped by the kernel


def serve(sock: socket.socket, env: dict[str, Any]) -> None:
    while True:
        try:
            req, blobs = wire.recv(sock)
        except (EOFError, OSError):
            os._exit(0)
        op = req.get("op")
        if op == "setup":
            try:
                exec(compile(blobs[0].decode(), f"<setup {req.get('name', '')}>", "exec"), env)
                gc.collect()
                gc.freeze()
                wire.send(sock, {"ok": True})
            except BaseException:
                wire.send(sock, {"error": traceback.format_exc(limit=8)})
        elif op in ("spawn", "fork"):
            parent_end, child_end = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                sock.close()
                parent_end.close()
                if op == "fork":
                    _become_zygote(req["cgroup_procs"])
                    serve(child_end, env)
                else:
                    _start_member(IsolationConfig(**req["config"]), child_end, env)
                os._exit(0)
            child_end.close()
            wire.send_with_fd(sock, {"ok": True}, parent_end.fileno())
            parent_end.close()
        else:
            wire.send(sock, {"error": f"unknown op {op!r}"})


def _start_member(cfg: IsolationConfig, sock: socket.socket, env: dict[str, Any]) -> None:
    from venusrl.envs import member

    try:
        enter(cfg, keep_fds=[sock.fileno()])
    except BaseException as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        with contextlib.suppress(OSError):
            wire.send(
                sock, {"error": f"sandbox setup failed in {where.name} (line {where.lineno}): {e}"}
            )
        os._exit(1)
    wire.send(sock, {"ready": True})
    member.serve(sock, env)


def main() -> None:
    fd = int(sys.argv[1])
    _become_zygote([])
    env: dict[str, Any] = {"__name__": "__sandbox__", "__builtins__": builtins}
    serve(socket.socket(fileno=fd), env)


# --- pool side -----------------------------------------------------------------------------------


def zygote_env() -> dict[str, str]:
    """An allow-list: the pool's environment (tokens, keys) never reaches a template."""
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "TZ")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    # One BLAS thread per sandbox: its CPU share is bounded anyway, and thread pools created in
    # the zygote do not survive fork.
    return {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ZygoteError(Exception):
    pass


class Zygote:
    """Handle on a zygote process; one request at a time."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes] | None) -> None:
        self._sock = sock
        self._proc = proc
        self._lock = threading.Lock()

    @classmethod
    async def start(cls, cgroup_procs: list[str]) -> Zygote:
        """A fresh interpreter whose every page is charged to the given cgroup: a shell joins the
        cgroup, then execs Python."""
        ours, theirs = socket.socketpair()
        join = "".join(f'echo $$ > "{p}" && ' for p in cgroup_procs)
        main = "from venusrl.envs.zygote import main; main()"
        cmd = f'{join}exec "$0" -c "{main}" {theirs.fileno()}'
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd, sys.executable],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=zygote_env(),
        )
        theirs.close()
        return cls(ours, proc)

    def _call(self, header: dict[str, Any], blob: bytes | None, timeout_s: float) -> Any:
        with self._lock:
            self._sock.settimeout(timeout_s)
            try:
                wire.send(self._sock, header, (blob,) if blob is not None else ())
                if header["op"] in ("spawn", "fork"):
                    reply, fd = wire.recv_with_fd(self._sock)
                else:
                    (reply, _), fd = wire.recv(self._sock, max_blob_bytes=0), None
            except (OSError, EOFError, wire.WireError) as e:
                raise ZygoteError(f"zygote did not answer {header['op']}: {e!r}") from None
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return fd

    async def setup(self, name: str, code: str, timeout_s: float) -> None:
        await asyncio.to_thread(self._call, {"op": "setup", "name": name}, code.encode(), timeout_s)

    async def spawn(self, cfg: dict[str, Any], timeout_s: float = 30.0) -> socket.socket:
        fd = await asyncio.to_thread(self._call, {"op": "spawn", "config": cfg}, None, timeout_s)
        return socket.socket(fileno=fd)

    async def fork(self, cgroup_procs: list[str], timeout_s: float = 30.0) -> Zygote:
        header = {"op": "fork", "cgroup_procs": cgroup_procs}
        fd = await asyncio.to_thread(self._call, header, None, timeout_s)
        return Zygote(socket.socket(fileno=fd), None)

    def close(self) -> None:
        """Closing the socket ends the zygote (it exits on EOF); the pool also kills its cgroup."""
        self._sock.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    main()
