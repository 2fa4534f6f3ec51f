"""Warm templates: one interpreter that sets up once, then forks sandboxes in ~2 ms.

A zygote is a Python process that runs a template's setup (imports, data, tool functions), calls
`gc.freeze()` so the garbage collector never writes to the template's objects (which would copy
their pages into every child), and then serves three requests from the pool: `spawn` a sandbox
(fork, then `isolation.enter`, then `member.serve`), `fork` a group zygote (fork, join the group's
cgroup, run the group's setup on top), and `setup`. Children share the template's pages
copy-on-write, so K members of a 200 MB template cost one template plus their private pages.

A host zygote is this machine's Python, as root. An image zygote is the image's own Python, in
the image's root and the sandboxes' user namespace (`isolation.enter_image_zygote`), so that a
hostile image's interpreter never runs with any power over the host; the pool reaches it through
the same three requests. Cgroups are joined through files the pool opens and passes with each
request: a process in a user namespace could not open them itself.

The process side (`main`, `serve`) is blocking and single-threaded, as fork requires, and also
runs on an image's Python (3.8 syntax); the pool side (`Zygote`) drives it from asyncio through a
worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

from venusrl.envs import member, wire
from venusrl.envs.isolation import IsolationConfig, enter, enter_image_zygote, join_cgroups
from venusrl.envs.syscalls import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl

MAX_CGROUP_FDS = 8  # one per cgroup v1 controller


def _become_zygote(cgroup_fds: list[int], parent_death: bool) -> None:
    join_cgroups(cgroup_fds)
    # A pool-wide OOM should take a sandbox, not the template every sandbox forks from (best
    # effort: lowering it needs CAP_SYS_RESOURCE, which a container's root may lack).
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("-900")
    if parent_death:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the pool died: so do its zygotes
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # sandbox inits are adopted here...
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ...and reaped by the kernel


def serve(sock: socket.socket, env: dict[str, Any]) -> None:
    while True:
        try:
            req, blobs, fds = wire.recv_with_fds(sock, MAX_CGROUP_FDS)
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
                    _become_zygote(fds, parent_death=True)  # its template's zygote
                    serve(child_end, env)
                else:
                    _start_member(IsolationConfig(**req["config"]), fds, child_end, env, req)
                os._exit(0)
            child_end.close()
            for fd in fds:
                os.close(fd)
            wire.send(sock, {"ok": True}, fds=(parent_end.fileno(),))
            parent_end.close()
        else:
            wire.send(sock, {"error": f"unknown op {op!r}"})


def _start_member(
    cfg: IsolationConfig,
    cgroup_fds: list[int],
    sock: socket.socket,
    env: dict[str, Any],
    req: dict[str, Any],
) -> None:
    try:
        enter(cfg, cgroup_fds, keep_fds=[sock.fileno()])
    except BaseException as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        with contextlib.suppress(OSError):
            problem = f"sandbox setup failed in {where.name} (line {where.lineno}): {e}"
            wire.send(sock, {"error": problem})
        os._exit(1)
    wire.send(sock, {"ready": True})
    member.serve(sock, env, cfg.workspace, bool(req.get("python", True)))


def main() -> None:
    """A host zygote: `python -c ... SOCKET_FD`, in its cgroups already."""
    fd = int(sys.argv[1])
    _become_zygote([], parent_death=True)
    serve(socket.socket(fileno=fd), _fresh_globals())


def _fresh_globals() -> dict[str, Any]:
    return {"__name__": "__sandbox__", "__builtins__": builtins}


# The image's Python starts here, after the launcher built its root (`launch_image_zygote`).
IMAGE_BOOT = (
    "import sys; sys.path.insert(0, '/.venusrl/py'); sys.dont_write_bytecode = True;"
    " from venusrl.envs.zygote import image_main; image_main()"
)


def image_main() -> None:
    fd = int(sys.argv[1])
    sys.path.remove("/.venusrl/py")  # the setup's imports are the image's own
    _become_zygote([], parent_death=False)
    serve(socket.socket(fileno=fd), _fresh_globals())


def launch_image_zygote() -> None:
    """Run by the pool as `python -c ... SOCKET_FD CONFIG_JSON CGROUP_FD...` on this machine's
    Python: join the cgroups, enter the image (`isolation.enter_image_zygote`), then become the
    image's Python. An error before the exec is sent on the socket."""
    sock_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    sock = socket.socket(fileno=sock_fd)
    try:
        join_cgroups([int(fd) for fd in sys.argv[3:]])
        enter_image_zygote(
            tuple(cfg["id_map"]), cfg["root_dir"], cfg["layers"], cfg["hidden"], cfg["tmp_bytes"]
        )
        os.execve(cfg["python"], [cfg["python"], "-c", IMAGE_BOOT, str(sock_fd)], cfg["env"])
    except BaseException as e:
        with contextlib.suppress(OSError):
            wire.send(sock, {"error": f"the image's zygote did not start: {e}"})
        os._exit(1)


# --- pool side -----------------------------------------------------------------------------------


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


class Zygote:
    """Handle on a zygote process; one request at a time."""

    def __init__(
        self, sock: socket.socket, proc: subprocess.Popen[bytes] | None, log: str | None = None
    ) -> None:
        self._sock = sock
        self._proc = proc
        self._log = log  # where an image zygote's stderr goes, quoted in its errors
        self._lock = threading.Lock()

    @classmethod
    async def start(cls, cgroup_procs: list[str]) -> Zygote:
        """A fresh interpreter of this machine whose every page is charged to the given cgroup:
        a shell joins the cgroup, then execs Python."""
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

    @classmethod
    async def start_in_image(
        cls, cgroup_procs: list[str], config: dict[str, Any], log: str, timeout_s: float
    ) -> Zygote:
        """The image's Python as a zygote (`launch_image_zygote`), in the given cgroup; its
        stderr goes to `log`. `ZygoteError` when it does not come up."""
        ours, theirs = socket.socketpair()
        fds = open_cgroups(cgroup_procs)
        code = "from venusrl.envs.zygote import launch_image_zygote; launch_image_zygote()"
        argv = [sys.executable, "-c", code, str(theirs.fileno()), json.dumps(config)]
        try:
            with open(log, "ab") as err:
                proc = subprocess.Popen(
                    [*argv, *map(str, fds)],
                    pass_fds=[theirs.fileno(), *fds],
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    env=zygote_env(),
                )
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)
        zygote = cls(ours, proc, log)
        # The launcher exits once the zygote is up; a `ping` is a setup of nothing.
        await zygote.setup("ping", "", timeout_s)
        return zygote

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        with contextlib.suppress(OSError), open(self._log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 2000))
            tail = f.read().decode(errors="replace").strip()
            return f"\n{tail}" if tail else ""
        return ""

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
        return got[0] if got else None

    async def setup(self, name: str, code: str, timeout_s: float) -> None:
        header = {"op": "setup", "name": name}
        await asyncio.to_thread(self._call, header, code.encode(), timeout_s, ())

    async def spawn(
        self, cfg: dict[str, Any], cgroup_procs: list[str], python: bool, timeout_s: float = 30.0
    ) -> socket.socket:
        fds = open_cgroups(cgroup_procs)
        header = {"op": "spawn", "config": cfg, "python": python}
        try:
            fd = await asyncio.to_thread(self._call, header, None, timeout_s, tuple(fds))
        finally:
            for f in fds:
                os.close(f)
        assert fd is not None
        return socket.socket(fileno=fd)

    async def fork(self, cgroup_procs: list[str], timeout_s: float = 30.0) -> Zygote:
        fds = open_cgroups(cgroup_procs)
        try:
            fd = await asyncio.to_thread(self._call, {"op": "fork"}, None, timeout_s, tuple(fds))
        finally:
            for f in fds:
                os.close(f)
        assert fd is not None
        return Zygote(socket.socket(fileno=fd), None, self._log)

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


if __name__ == "__main__":
    main()
