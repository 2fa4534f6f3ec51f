"""The pool's handle on one sandbox: the verbs, over the member's socket.

Every request is bounded: an `exec` gets its own timeout plus a grace for the member to report; a
member that does not answer within that is declared crashed and killed, and the call raises
`SandboxCrashed`. Replies are matched to requests by id, so calls on one sandbox can overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from venusrl.envs import wire
from venusrl.envs.cgroups import Cgroup
from venusrl.envs.types import (
    ExecResult,
    InfraFailure,
    SandboxCrashed,
    SandboxError,
    SandboxUsage,
)

if TYPE_CHECKING:
    from venusrl.envs.pool import SandboxPool

_REPLY_GRACE_S = 5.0
_FILE_TIMEOUT_S = 60.0
MAX_FILE_BYTES = 64 << 20
SIGKILL_EXIT = 128 + 9


def check_path(path: str) -> str:
    """Reject what can never be inside the workspace before it reaches the sandbox (which checks
    again, refusing symlinks on the way)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"path must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        raise SandboxError(f"path must be relative to the workspace, got {path!r}")
    if ".." in path.split("/"):
        raise SandboxError(f"path must stay inside the workspace, got {path!r}")
    return path


class Sandbox:
    def __init__(
        self,
        pool: SandboxPool,
        sandbox_id: str,
        template: str,
        priority: int,
        cgroup: Cgroup,
        sock: socket.socket,
    ) -> None:
        self.id = sandbox_id
        self.template = template
        self.priority = priority
        self.cgroup = cgroup
        self._pool = pool
        self._sock = sock
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[tuple[dict[str, Any], list[bytes]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._dead: InfraFailure | None = None
        self._closed = False
        self._max_reply_bytes = 2 * MAX_FILE_BYTES

    async def _connect(self, timeout_s: float) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=1 << 20)
        hello, _ = await asyncio.wait_for(wire.read(reader, 0), timeout_s)
        if not hello.get("ready"):
            raise SandboxCrashed(str(hello.get("error", hello)))
        self._reader = asyncio.create_task(self._read_replies(reader))

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, blobs = await wire.read(reader, self._max_reply_bytes)
                fut = self._waiting.pop(header.get("id", -1), None)
                if fut is not None and not fut.done():
                    fut.set_result((header, blobs))
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as e:
            self._fail(SandboxCrashed(f"sandbox {self.id} stopped answering: {e!r}"))

    def _fail(self, error: InfraFailure) -> None:
        if self._dead is None:
            self._dead = error
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._dead)
        self._waiting.clear()

    async def _request(
        self, header: dict[str, Any], blobs: Sequence[bytes], timeout_s: float
    ) -> tuple[dict[str, Any], list[bytes]]:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._dead is not None:
            raise self._dead
        assert self._writer is not None
        rid = next(self._ids)
        fut: asyncio.Future[tuple[dict[str, Any], list[bytes]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[rid] = fut
        self._writer.write(wire.encode({**header, "id": rid}, tuple(blobs)))
        try:
            await self._writer.drain()
            reply, out = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._waiting.pop(rid, None)
            await self._pool._kill(self, SandboxCrashed(f"sandbox {self.id} did not answer"))
            raise self._dead or SandboxCrashed(f"sandbox {self.id} did not answer") from None
        except ConnectionError as e:
            self._fail(SandboxCrashed(f"sandbox {self.id} connection lost: {e!r}"))
            raise self._dead from None  # type: ignore[misc]
        if "error" in reply:
            raise SandboxError(f"sandbox {self.id}: {reply['error']}")
        return reply, out

    # --- the verbs -------------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str | Sequence[str],
        timeout_s: float = 30.0,
        max_output_bytes: int = 1 << 20,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes = b"",
    ) -> ExecResult:
        """Run a shell string (`/bin/sh -c`) or an argv list; `cwd` is relative to the workspace."""
        if isinstance(cmd, str):
            wire_cmd: str | list[str] = cmd
        elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
            wire_cmd = list(cmd)
        else:
            raise SandboxError(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
        _check_limits(timeout_s, max_output_bytes)
        header = {
            "op": "exec",
            "cmd": wire_cmd,
            "timeout_s": timeout_s,
            "max_output_bytes": max_output_bytes,
            "cwd": f"/workspace/{check_path(cwd)}" if cwd else None,
            "env": dict(env or {}),
        }
        ooms = self.cgroup.oom_kills()
        reply, (out, err) = await self._request(
            header, (stdin,), timeout_s + _REPLY_GRACE_S + len(stdin) / 1e8
        )
        oom = reply["exit_code"] == SIGKILL_EXIT and self.cgroup.oom_kills() > ooms
        return _result(reply, out, err, oom)

    async def run_python(
        self, code: str, timeout_s: float = 30.0, max_output_bytes: int = 1 << 20
    ) -> ExecResult:
        """Run `code` in the sandbox's persistent interpreter (the template's globals, and what
        earlier calls left there). An exception gives exit code 1 and its traceback on stderr; at
        the deadline the code is interrupted (exit code 124, `timed_out`); code that cannot be
        interrupted (stuck in C) is killed with its sandbox after a grace period."""
        if not isinstance(code, str):
            raise SandboxError(f"code must be a string, got {type(code).__name__}")
        _check_limits(timeout_s, max_output_bytes)
        header = {"op": "python", "code": code, "timeout_s": timeout_s}
        header["max_output_bytes"] = max_output_bytes
        ooms = self.cgroup.oom_kills()
        try:
            reply, (out, err) = await self._request(header, (), timeout_s + _REPLY_GRACE_S)
        except SandboxCrashed as e:
            if self.cgroup.oom_kills() > ooms:
                raise SandboxCrashed(f"sandbox {self.id} ran out of memory in run_python") from e
            raise
        return _result(reply, out, err, False)

    async def write_file(self, path: str, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray):
            raise SandboxError(f"data must be bytes, got {type(data).__name__}")
        if len(data) > MAX_FILE_BYTES:
            raise SandboxError(f"{path}: {len(data)} bytes is over the limit of {MAX_FILE_BYTES}")
        await self._request({"op": "write", "path": check_path(path)}, (bytes(data),), 60)

    async def read_file(self, path: str, max_bytes: int = 16 << 20) -> bytes:
        if not 0 <= max_bytes <= MAX_FILE_BYTES:
            raise SandboxError(f"max_bytes must be in [0, {MAX_FILE_BYTES}], got {max_bytes}")
        header = {"op": "read", "path": check_path(path), "max_bytes": max_bytes}
        _, (data,) = await self._request(header, (), _FILE_TIMEOUT_S)
        return data

    async def fork(self) -> Sandbox:
        """A new sandbox with this one's files and interpreter state (the picklable globals that
        changed since the template; others are listed in `child.dropped_state`), forked from the
        same warm template. Running processes are not carried over. Admitted like any create."""
        return await self._pool._fork(self)

    async def export_state(self) -> tuple[dict[str, Any], list[bytes]]:
        return await self._request({"op": "export"}, (), _FILE_TIMEOUT_S)

    async def import_state(self, header: dict[str, Any], blobs: list[bytes]) -> None:
        await self._request({"op": "import", "paths": header["paths"]}, blobs, _FILE_TIMEOUT_S)

    def usage(self) -> SandboxUsage:
        """Measured physical bytes: what the sandbox's own memory cgroup is charged. Pages shared
        with its template are charged to the template, once."""
        return SandboxUsage(
            physical_bytes=self.cgroup.memory_bytes(),
            peak_physical_bytes=self.cgroup.peak_memory_bytes(),
            pids=len(self.cgroup.pids()),
        )

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None

    async def close(self) -> None:
        """Kill every process of the sandbox and release it; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._pool._release(self)

    def _shutdown_channel(self) -> None:
        self._fail(SandboxCrashed(f"sandbox {self.id} was closed"))
        if self._reader is not None:
            self._reader.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            with contextlib.suppress(OSError):
                self._sock.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _check_limits(timeout_s: float, max_output_bytes: int) -> None:
    if not 0 < timeout_s <= 24 * 3600:
        raise SandboxError(f"timeout_s must be in (0, 86400], got {timeout_s}")
    if not 0 <= max_output_bytes <= MAX_FILE_BYTES:
        raise SandboxError(
            f"max_output_bytes must be in [0, {MAX_FILE_BYTES}], got {max_output_bytes}"
        )


def _result(reply: dict[str, Any], out: bytes, err: bytes, oom: bool) -> ExecResult:
    return ExecResult(
        exit_code=int(reply["exit_code"]),
        stdout=out,
        stderr=err,
        timed_out=bool(reply["timed_out"]),
        truncated=bool(reply["truncated"]),
        oom_killed=oom,
        duration_s=float(reply["duration_s"]),
    )
