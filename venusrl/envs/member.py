"""The process inside a sandbox that serves the pool: exec, Python, files, export/import.

It is the init of the sandbox's pid namespace, forked from the template's warm interpreter, so
`run_python` runs in the template's globals without importing anything again. Non-Python commands
are forked and exec'd from it. Each `exec` goes through a short-lived leader process that is a
child subreaper: background, `setsid` and double-forked children of the command are re-parented to
the leader instead of escaping, so a timeout, or output past its cap, kills exactly the command's
whole tree.

Everything here runs as the unprivileged sandbox user; nothing it sends is trusted by the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import selectors
import signal
import socket
import stat
import sys
import tarfile
import time
import traceback
import types
from typing import Any

from venusrl.envs import wire
from venusrl.envs.syscalls import PR_SET_CHILD_SUBREAPER, prctl

# Where relative paths and commands start: set once by `serve` (the member is a process of its own).
workspace = "/workspace"
# False in an image sandbox whose image has no Python: the member is a host interpreter that
# cannot import anything more once inside the image.
python_ok = True
_EXIT_GRACE_S = 0.2  # after the command exits, how long to wait for its pipes to drain
# A process stuck in the kernel may not die at once; past this the sandbox's close kills its
# cgroup, and the leader answers rather than hold the call.
_KILL_TREE_S = 10.0


class _Timeout(BaseException):
    """Raised in `run_python` code at its deadline; a BaseException so `except Exception` in the
    sandboxed code does not swallow it."""


# --- files, confined to the workspace -----------------------------------------------------------


def _parts(path: str) -> list[str]:
    if not path or "\0" in path or path.startswith("/"):
        raise ValueError(f"path must be relative to the workspace, got {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"path must stay inside the workspace, got {path!r}")
    return parts


def _open_beneath(path: str, flags: int, create_dirs: bool = False) -> int:
    """Open `path` under the workspace, refusing any symlink on the way (O_NOFOLLOW per step)."""
    parts = _parts(path)
    dir_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts[:-1]:
            if create_dirs:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _regular(fd: int, path: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")


def _read_file(path: str, max_bytes: int) -> bytes:
    fd = _open_beneath(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the member
    _regular(fd, path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{path} is {size} bytes, over max_bytes={max_bytes}")
        return f.read(max_bytes + 1)[:max_bytes]


def _write_file(path: str, data: bytes) -> None:
    fd = _open_beneath(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, create_dirs=True)
    _regular(fd, path)
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# --- exec ----------------------------------------------------------------------------------------


def _descendants(root_pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2 :].split()
            parent[int(entry)] = int(fields[1])
    out = []
    for pid in parent:
        p = parent.get(pid, 0)
        while p > 1 and p != root_pid:
            p = parent.get(p, 0)
        if p == root_pid and pid != root_pid:
            out.append(pid)
    return out


def _kill_tree(leader: int) -> None:
    """SIGKILL every descendant of the (subreaper) leader and reap them until the leader has no
    child left. A dying process's orphans are re-parented to the leader before it can be reaped,
    so no child means nothing of the command is left, not even a process still exiting (an empty
    list of descendants is not enough: a killed `yes` may take a moment to exit, and a parent
    reaped mid-scan hides its children). Stop first so a fork bomb cannot outrun the loop."""
    give_up = time.monotonic() + _KILL_TREE_S
    while time.monotonic() < give_up:
        pids = _descendants(leader)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)  # children still exiting


def _start_command(req: dict[str, Any]) -> tuple[int, int, int, int]:
    """Fork and exec the command in a session of its own; (pid, stdin, stdout, stderr) pipes."""
    cmd = req["cmd"]
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
    env = {**os.environ, **req.get("env", {})}
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for src, dst in ((in_r, 0), (out_w, 1), (err_w, 2)):
                os.dup2(src, dst)
            os.closerange(3, 1 << 16)
            os.chdir(os.path.join(workspace, req.get("cwd") or ""))
            os.execvpe(argv[0], argv, env)
        except BaseException as e:
            os.write(2, f"cannot run {argv[0]!r}: {e}\n".encode())
        os._exit(127)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, in_w, out_r, err_r


@dataclasses.dataclass
class _Collected:
    """What the command left once the leader stopped watching it."""

    stdout: bytearray
    stderr: bytearray
    status: int | None = None  # its wait status, when it exited by itself
    timed_out: bool = False
    truncated: bool = False  # output passed the cap: the leader stopped there


def _collect(
    pid: int, in_w: int, out_r: int, err_r: int, stdin: bytes, cap: int, deadline: float
) -> _Collected:
    """Feed stdin, gather stdout and stderr up to `cap` bytes each, until the command is done,
    its deadline passes or its output passes the cap (a flood, `yes`, would otherwise hold the
    sandbox and a core until the deadline)."""
    got = _Collected(bytearray(), bytearray())
    bufs = {out_r: got.stdout, err_r: got.stderr}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending_in = memoryview(stdin)
    if pending_in:
        os.set_blocking(in_w, False)
        sel.register(in_w, selectors.EVENT_WRITE)
    else:
        os.close(in_w)
    exited_at = 0.0
    while sel.get_map() and not got.truncated:
        now = time.monotonic()
        if now >= deadline:
            got.timed_out = True
            break
        if got.status is not None and now - exited_at > _EXIT_GRACE_S:
            break  # a background child still holds the pipes; the command itself is done
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            fd = key.fd
            if fd == in_w:
                try:
                    pending_in = pending_in[os.write(in_w, pending_in[: 1 << 16]) :]
                except BrokenPipeError:
                    pending_in = pending_in[:0]
                if not pending_in:
                    sel.unregister(in_w)
                    os.close(in_w)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                sel.unregister(fd)
                continue
            room = cap - len(bufs[fd])
            bufs[fd] += chunk[: max(room, 0)]
            if len(chunk) > room:
                got.truncated = True
                break
        if got.status is None:  # after a flood too: it may have ended with its last write
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                got.status, exited_at = status, time.monotonic()
    return got


def _run_leader(req: dict[str, Any], stdin: bytes) -> bytes:
    """Runs in the leader: run the command, collect capped output, enforce the timeout and the
    cap. A command stopped at either is killed with its whole tree; past the cap it reports its
    own exit status if it had ended, else SIGKILL's."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    start = time.monotonic()
    pid, in_w, out_r, err_r = _start_command(req)
    deadline = start + float(req["timeout_s"])
    got = _collect(pid, in_w, out_r, err_r, stdin, int(req["max_output_bytes"]), deadline)
    status = got.status
    if got.timed_out or got.truncated:
        _kill_tree(os.getpid())  # reaps the command too
    if got.timed_out or (got.truncated and status is None):
        code = -signal.SIGKILL
    else:
        if status is None:
            _, status = os.waitpid(pid, 0)
        code = _exit_code(status)
    return wire.encode(
        {
            "id": req["id"],
            "exit_code": 128 - code if code < 0 else code,
            "timed_out": got.timed_out,
            "truncated": got.truncated,
            "duration_s": time.monotonic() - start,
        },
        (bytes(got.stdout), bytes(got.stderr)),
    )


# --- the Python interpreter ---------------------------------------------------------------------


class _Flood(BaseException):
    """Raised in `run_python` code whose output passes the cap, so a print loop stops there as a
    command's flood does (`_collect`), not at its timeout; a BaseException for the same reason as
    `_Timeout`."""


class _CappedText(io.TextIOBase):
    def __init__(self, cap: int) -> None:
        self.buf = bytearray()
        self.cap = cap
        self.truncated = False
        self.armed = True  # raise _Flood at the cap while the sandboxed code runs

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        data = s.encode(errors="replace")
        room = self.cap - len(self.buf)
        self.buf += data[: max(room, 0)]
        if len(data) > room:
            self.truncated = True
            if self.armed:
                raise _Flood
        return len(s)


def _on_alarm(_sig: int, _frame: Any) -> None:
    raise _Timeout


def _run_python(req: dict[str, Any], env: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
    out, err = _CappedText(int(req["max_output_bytes"])), _CappedText(int(req["max_output_bytes"]))
    me = os.getpid()
    start = time.monotonic()
    timed_out, code = False, 0
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(req["timeout_s"]))
    try:
        exec(compile(req["code"], "<sandbox>", "exec"), env)
    except _Timeout:
        timed_out, code = True, 124
    except _Flood:
        code = 137  # what a command stopped at the cap reports
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = 1
        err.armed = False  # the traceback is cut at the cap, not raised from
        traceback.print_exc(file=err)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # a stray `kill -ALRM 1` stays harmless
        sys.stdout, sys.stderr = saved
        if os.getpid() != me:  # the code forked; its children must not serve the pool
            os._exit(code)
    header = {
        "exit_code": code,
        "timed_out": timed_out,
        "truncated": out.truncated or err.truncated,
        "duration_s": time.monotonic() - start,
    }
    return header, (bytes(out.buf), bytes(err.buf))


# --- fork support: export the workspace and the interpreter state, import them elsewhere ------


def _export(
    env: dict[str, Any], baseline: dict[str, int], max_bytes: int
) -> tuple[dict[str, Any], tuple]:
    tar_buf = io.BytesIO()
    paths = []
    with tarfile.open(fileobj=tar_buf, mode="w") as tar:
        for root, dirs, files in os.walk(workspace):
            for name in dirs + files:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, workspace)
                paths.append(rel)
                tar.add(full, arcname=rel, recursive=False)
    state, dropped = {}, []
    for name, value in env.items():
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        if baseline.get(name) == id(value):
            continue  # unchanged since the template: the fork target has it already
        try:
            state[name] = pickle.dumps(value)
        except Exception:
            dropped.append(name)
    header = {"paths": paths, "dropped": sorted(dropped)}
    blobs = (tar_buf.getvalue(), pickle.dumps(state))
    size = sum(len(b) for b in blobs)
    if size > max_bytes:
        raise ValueError(f"the sandbox's files and state are {size} bytes, over {max_bytes}")
    return header, blobs


def _import(header: dict[str, Any], blobs: list[bytes], env: dict[str, Any]) -> None:
    keep = set(header["paths"])
    for root, dirs, files in os.walk(workspace, topdown=False):
        for name in files + dirs:
            full = os.path.join(root, name)
            if os.path.relpath(full, workspace) not in keep:
                if os.path.isdir(full) and not os.path.islink(full):
                    os.rmdir(full)
                else:
                    os.unlink(full)
    with tarfile.open(fileobj=io.BytesIO(blobs[0]), mode="r") as tar:
        # "tar" rather than "data": symlinks to absolute paths (venvs have them) are fine here,
        # they resolve inside this sandbox.
        if hasattr(tarfile, "tar_filter"):
            tar.extractall(workspace, filter="tar")
        else:  # a Python before the extraction filters (an image's): the same, minus the check
            tar.extractall(workspace)
    # Unpickling runs inside this sandbox only: the data came from a sibling sandbox.
    for name, raw in pickle.loads(blobs[1]).items():
        env[name] = pickle.loads(raw)


# --- the serving loop ----------------------------------------------------------------------------


def _exit_code(status: int) -> int:
    """`os.waitstatus_to_exitcode`, which an image's Python may predate (3.9)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def serve(sock: socket.socket, env: dict[str, Any], where: str, has_python: bool) -> None:
    """Serve the pool on `sock` until it hangs up; `where` is the workspace."""
    global workspace, python_ok
    workspace, python_ok = where, has_python
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    baseline = {name: id(value) for name, value in env.items()}
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    leaders: dict[int, tuple[int, bytearray]] = {}  # result pipe -> (leader pid, bytes so far)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is sock:
                try:
                    req, blobs = wire.recv(sock)
                except (EOFError, OSError):
                    os._exit(0)  # the pool is gone: the sandbox goes with it
                if req.get("op") == "exec":
                    r, w = os.pipe()
                    leader = os.fork()
                    if leader == 0:
                        sock.close()
                        os.close(r)
                        try:
                            frame = _run_leader(req, blobs[0] if blobs else b"")
                        except BaseException as e:
                            frame = wire.encode({"id": req["id"], "error": repr(e)})
                        with contextlib.suppress(OSError):
                            _write_all(w, frame)
                        os._exit(0)
                    os.close(w)
                    os.set_blocking(r, False)
                    leaders[r] = (leader, bytearray())
                    sel.register(r, selectors.EVENT_READ)
                else:
                    header, out = _handle(req, blobs, env, baseline)
                    wire.send(sock, {"id": req.get("id"), **header}, out)
            else:
                fd = key.fd
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    leaders[fd][1].extend(chunk)
                    continue
                sel.unregister(fd)
                os.close(fd)
                leader, result = leaders.pop(fd)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(leader, 0)  # it is exiting: no trace of it once it has answered
                if result:
                    sock.sendall(result)
        with contextlib.suppress(ChildProcessError):  # reap leaders and adopted orphans
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _handle(
    req: dict[str, Any], blobs: list[bytes], env: dict[str, Any], baseline: dict[str, int]
) -> tuple[dict[str, Any], tuple]:
    op = req.get("op")
    try:
        if op == "python":
            if not python_ok:
                raise ValueError("this sandbox's image has no Python: run_python needs one")
            return _run_python(req, env)
        if op == "read":
            return {}, (_read_file(str(req["path"]), int(req["max_bytes"])),)
        if op == "write":
            _write_file(str(req["path"]), blobs[0])
            return {}, ()
        if op == "export":
            return _export(env, baseline, int(req["max_bytes"]))
        if op == "import":
            _import(req, blobs, env)
            return {}, ()
        return {"error": f"unknown op {op!r}"}, ()
    except (OSError, ValueError, KeyError, tarfile.TarError) as e:
        return {"error": _describe(e)}, ()


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return str(e)
