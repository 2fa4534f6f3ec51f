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
from typing import Any, Protocol

from venusrl.envs import wire
from venusrl.envs.cgroups import Cgroup
from venusrl.envs.types import (
    ExecResult,
    InfraFailure,
    SandboxCrashed,
    SandboxError,
    SandboxUsage,
)
from venusrl.images.oci import ImageConfig

Reply = tuple[dict[str, Any], list[bytes]]
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


class SandboxOwner(Protocol):
    """What a sandbox asks of the pool that made it."""

    async def fork_sandbox(self, parent: Sandbox) -> Sandbox:
        """A new sandbox with `parent`'s files and interpreter state (`Sandbox.fork`)."""
        ...

    async def fresh_sandbox(self, sibling: Sandbox) -> Sandbox:
        """A new sandbox as `sibling` started: its group's, in its initial state."""
        ...

    async def kill_sandbox(self, sb: Sandbox, error: InfraFailure) -> None:
        """Take `sb` down now (it stopped answering); its callers see `error`."""
        ...

    async def release_sandbox(self, sb: Sandbox) -> None:
        """`sb` was closed: kill what is left of it and free what it held."""
        ...


class Sandbox:
    def __init__(
        self,
        owner: SandboxOwner,
        sandbox_id: str,
        template: str,
        cgroup: Cgroup,
        sock: socket.socket,
    ) -> None:
        """Made by a pool (`connect`), not by hand."""
        self.id = sandbox_id
        self.template = template
        self.cgroup = cgroup
        self.dropped_state: list[str] = []  # after `fork`: the globals that could not be carried
        self.image: ImageConfig | None = None  # what the image's config says, for an image root
        self._owner = owner
        self._sock = sock
        self._ids = itertools.count()
        # request id -> (reply future, the most reply bytes that request can legitimately get)
        self._waiting: dict[int, tuple[asyncio.Future[Reply], int]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._dead: InfraFailure | None = None
        self._closed = False
        # run_python and the file verbs run in the member's serving loop, so a command sent while
        # one runs would only be read after it: commands wait for them here, and their deadlines
        # start when the member can actually see them.
        self._member_busy = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        owner: SandboxOwner,
        sandbox_id: str,
        template: str,
        cgroup: Cgroup,
        sock: socket.socket,
        timeout_s: float,
    ) -> Sandbox:
        """The handle on a started member, once it said it is ready on `sock`."""
        sb = cls(owner, sandbox_id, template, cgroup, sock)
        reader, sb._writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        hello, _ = await asyncio.wait_for(wire.read(reader, 0), timeout_s)
        if not hello.get("ready"):
            raise SandboxCrashed(str(hello.get("error", hello)))
        sb._reader = asyncio.create_task(sb._read_replies(reader))
        return sb

    def _reply_limit(self, header: dict[str, Any]) -> int:
        waiting = self._waiting.get(header.get("id", -1)) if _is_id(header.get("id")) else None
        return 0 if waiting is None else waiting[1]

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        """Everything the member sends is untrusted: a malformed or oversized frame, or blobs for a
        request nobody made, end the sandbox as crashed instead of hanging or flooding the pool."""
        try:
            while True:
                header, blobs = await wire.read(reader, self._reply_limit)
                rid = header.get("id")
                waiting = self._waiting.pop(rid, None) if isinstance(rid, int) else None
                if waiting is not None and not waiting[0].done():
                    waiting[0].set_result((header, blobs))
        except Exception as e:
            self._fail(SandboxCrashed(f"sandbox {self.id} stopped answering properly: {e!r}"))

    def _fail(self, error: InfraFailure) -> None:
        if self._dead is None:
            self._dead = error
        for fut, _ in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._dead)
                fut.exception()  # its caller may have left already (send failed): don't log it
        self._waiting.clear()

    async def _request(
        self,
        header: dict[str, Any],
        blobs: Sequence[bytes],
        timeout_s: float,
        max_reply_bytes: int,
    ) -> Reply:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._dead is not None:
            raise self._dead
        assert self._writer is not None
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (fut, max_reply_bytes)
        writer = self._writer

        async def send_and_wait() -> Reply:
            writer.write(wire.encode({**header, "id": rid}, tuple(blobs)))
            await writer.drain()
            return await fut

        try:
            reply, out = await asyncio.wait_for(send_and_wait(), timeout_s)
        except TimeoutError:
            self._waiting.pop(rid, None)
            await self._owner.kill_sandbox(
                self, SandboxCrashed(f"sandbox {self.id} did not answer")
            )
            raise self._dead or SandboxCrashed(f"sandbox {self.id} did not answer") from None
        except ConnectionError as e:
            self._fail(SandboxCrashed(f"sandbox {self.id} connection lost: {e!r}"))
            raise self._dead from None  # type: ignore[misc]
        if "error" in reply:
            raise SandboxError(f"sandbox {self.id}: {str(reply['error'])[:2000]}")
        return reply, out

    async def _blocking_request(
        self, header: dict[str, Any], blobs: Sequence[bytes], timeout_s: float, max_reply: int
    ) -> Reply:
        async with self._member_busy:
            return await self._request(header, blobs, timeout_s, max_reply)

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
        """Run a shell string (`/bin/sh -c`) or an argv list; `cwd` is relative to the workspace.
        At `timeout_s`, or when stdout or stderr passes `max_output_bytes`, the command is killed
        with its whole tree (a flood costs seconds, not the timeout): `timed_out` or `truncated`
        says which, and the exit code is 137 unless the command had already ended. Redirect
        output to a file when a long one's exit code matters."""
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
            "cwd": check_path(cwd) if cwd else None,
            "env": dict(env or {}),
        }
        async with self._member_busy:  # wait until the member reads requests again
            ooms = self.cgroup.oom_kills()
        reply = await self._request(
            header, (stdin,), timeout_s + _REPLY_GRACE_S + len(stdin) / 1e8, 2 * max_output_bytes
        )
        return self._result(reply, ooms)

    async def run_image(
        self,
        args: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        """Run what `docker run IMAGE [ARGS]` runs: the image's Entrypoint, then `args` or, with
        none, its Cmd (an image sandbox only)."""
        if self.image is None:
            raise SandboxError(f"sandbox {self.id} is not rooted in an image")
        command = self.image.command(None if args is None else list(args))
        if not command:
            raise SandboxError(f"sandbox {self.id}: its image has no Entrypoint or Cmd to run")
        return await self.exec(command, timeout_s, max_output_bytes)

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
            reply = await self._blocking_request(
                header, (), timeout_s + _REPLY_GRACE_S, 2 * max_output_bytes
            )
        except SandboxCrashed as e:
            if self.cgroup.oom_kills() > ooms:
                raise SandboxCrashed(f"sandbox {self.id} ran out of memory in run_python") from e
            raise
        return self._result(reply, None)

    async def write_file(self, path: str, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray):
            raise SandboxError(f"data must be bytes, got {type(data).__name__}")
        if len(data) > MAX_FILE_BYTES:
            raise SandboxError(f"{path}: {len(data)} bytes is over the limit of {MAX_FILE_BYTES}")
        header = {"op": "write", "path": check_path(path)}
        await self._blocking_request(header, (bytes(data),), _FILE_TIMEOUT_S, 0)

    async def read_file(self, path: str, max_bytes: int = 16 << 20) -> bytes:
        if not 0 <= max_bytes <= MAX_FILE_BYTES:
            raise SandboxError(f"max_bytes must be in [0, {MAX_FILE_BYTES}], got {max_bytes}")
        header = {"op": "read", "path": check_path(path), "max_bytes": max_bytes}
        _, blobs = await self._blocking_request(header, (), _FILE_TIMEOUT_S, max_bytes)
        if len(blobs) != 1:
            raise self._malformed("read")
        return blobs[0]

    async def fork(self) -> Sandbox:
        """A new sandbox with this one's files and interpreter state (the picklable globals that
        changed since the template; others are listed in `child.dropped_state`), forked from the
        same warm template. Running processes are not carried over. Admitted like any create."""
        return await self._owner.fork_sandbox(self)

    async def fresh(self) -> Sandbox:
        """A new sandbox of this one's template and group as it started, none of this one's
        changes in it (where an episode is graded: SWE tests run in a clean copy of the
        task's image). Admitted like any create."""
        return await self._owner.fresh_sandbox(self)

    async def export_state(self, max_bytes: int) -> Reply:
        """The workspace as a tar and the changed picklable globals, for `fork`."""
        request = {"op": "export", "max_bytes": max_bytes}
        reply = await self._blocking_request(request, (), _FILE_TIMEOUT_S, max_bytes)
        header, blobs = reply
        paths, dropped = header.get("paths"), header.get("dropped")
        if len(blobs) != 2 or not isinstance(paths, list) or not isinstance(dropped, list):
            raise self._malformed("export")
        return reply

    async def import_state(self, header: dict[str, Any], blobs: list[bytes]) -> None:
        request = {"op": "import", "paths": header["paths"]}
        await self._blocking_request(request, blobs, _FILE_TIMEOUT_S, 0)

    def usage(self) -> SandboxUsage:
        """Measured physical bytes: what the sandbox's own memory cgroup is charged. Pages shared
        with its template are charged to the template, once."""
        return SandboxUsage(
            physical_bytes=self.cgroup.memory_bytes(),
            peak_physical_bytes=self.cgroup.peak_memory_bytes(),
            pids=len(self.cgroup.pids()),
        )

    def _malformed(self, what: str) -> SandboxCrashed:
        error = SandboxCrashed(f"sandbox {self.id} sent a malformed {what} reply")
        self._fail(error)
        return error

    def _result(self, reply: Reply, ooms_before: int | None) -> ExecResult:
        header, blobs = reply
        try:
            out, err = blobs
            code = int(header["exit_code"])
            timed_out = header["timed_out"] is True
            result = ExecResult(
                exit_code=code,
                stdout=out,
                stderr=err,
                timed_out=timed_out,
                truncated=header["truncated"] is True,
                # killed by the kernel for memory, not by our timeout
                oom_killed=ooms_before is not None
                and code == SIGKILL_EXIT
                and not timed_out
                and self.cgroup.oom_kills() > ooms_before,
                duration_s=float(header["duration_s"]),
            )
        except (KeyError, TypeError, ValueError):
            raise self._malformed("exec") from None
        return result

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None

    async def close(self) -> None:
        """Kill every process of the sandbox and release it; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._owner.release_sandbox(self)

    def disconnect(self, error: InfraFailure | None = None) -> None:
        """The owner's: fail the calls in flight and every later one with `error` (or as closed;
        the first error given stays), and drop the connection to the member."""
        self._fail(error or SandboxCrashed(f"sandbox {self.id} was closed"))
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


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
