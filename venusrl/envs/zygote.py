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

This is the process side: blocking and single-threaded, as fork requires, and run on an image's
Python too (3.8 syntax, nothing it need not import). The pool drives it through `zygote_handle`.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import os
import signal
import socket
import sys
import traceback
from typing import Any

from venusrl.envs import member, wire
from venusrl.envs.isolation import IsolationConfig, enter, enter_image_zygote, join_cgroups
from venusrl.envs.syscalls import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl

MAX_FDS = 9  # one per cgroup v1 controller, and an image zygote's output


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
            req, blobs, fds = wire.recv_with_fds(sock, MAX_FDS)
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
        elif op in ("spawn", "fork", "image"):
            try:
                pid, end = _fork_with_socket()
            except OSError as e:  # out of pids or memory: this request fails, not the zygote
                for fd in fds:
                    os.close(fd)
                wire.send(sock, {"error": f"cannot start a process: {e}"})
                continue
            if pid == 0:
                sock.close()
                if op == "fork":
                    _become_zygote(fds, parent_death=True)  # its template's zygote
                    serve(end, env)
                elif op == "image":
                    _become_image_zygote(req["config"], fds, end)
                else:
                    _start_member(IsolationConfig(**req["config"]), fds, end, env, req)
                os._exit(0)
            for fd in fds:
                os.close(fd)
            wire.send(sock, {"ok": True}, fds=(end.fileno(),))
            end.close()
        else:
            wire.send(sock, {"error": f"unknown op {op!r}"})


def _fork_with_socket() -> tuple[int, socket.socket]:
    """fork, with a socket between the two: (0, its end) in the child, (the child's pid, our
    end) in the parent."""
    parent_end, child_end = socket.socketpair()
    try:
        pid = os.fork()
    except OSError:
        parent_end.close()
        child_end.close()
        raise
    ours, theirs = (child_end, parent_end) if pid == 0 else (parent_end, child_end)
    theirs.close()
    return pid, ours


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


def _become_image_zygote(cfg: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """In a child of a host zygote (the pool's launcher, warm: no interpreter to start): join
    the image zygote's cgroups, enter the image (`isolation.enter_image_zygote`), then become
    the image's Python, its output going to the pipe passed first (the pool keeps its tail).
    An error before the exec is sent on the socket."""
    try:
        log, *cgroup_fds = fds
        join_cgroups(cgroup_fds)
        id_map = tuple(cfg["id_map"])
        enter_image_zygote(id_map, cfg["root_dir"], cfg["layers"], cfg["tmp_bytes"], cfg["hidden"])
        for std in (1, 2):
            os.dup2(log, std)
        os.close(log)
        os.set_inheritable(sock.fileno(), True)
        argv = [cfg["python"], "-c", IMAGE_BOOT, str(sock.fileno())]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:
        with contextlib.suppress(OSError):
            wire.send(sock, {"error": f"the image's zygote did not start: {e}"})
        os._exit(1)


if __name__ == "__main__":
    main()
