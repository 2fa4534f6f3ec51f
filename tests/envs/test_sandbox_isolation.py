"""What sandboxed code can and cannot reach, and what abuse does to the host (nothing)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import venusrl
from tests.processes import our_processes, wait_for_no_new_processes
from venusrl.envs import Sandbox, SandboxCrashed, SandboxError, SandboxPool, TemplateSpec
from venusrl.envs.syscalls import seccomp_available

from .conftest import requires_root

pytestmark = requires_root
MiB = 1 << 20
PROJECT = Path(venusrl.__file__).resolve().parents[1]


def in_sandbox(
    scenario: Callable[[Sandbox], Awaitable[None]], spec: TemplateSpec | None = None
) -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=4 << 30) as pool:
            name = "python"
            if spec is not None:
                await pool.prepare_template(spec)
                name = spec.name
            sb = await pool.create(name)
            await scenario(sb)
            await sb.close()

    asyncio.run(main())


# --- isolation -----------------------------------------------------------------------------------


def test_sandbox_sees_no_host_secrets_or_project_files() -> None:
    async def check(sb: Sandbox) -> None:
        for secret in ("/etc/shadow", "/etc/ssh", "/home", "/root/.bash_history", "/root/.ssh"):
            assert (await sb.exec(["test", "-e", secret])).exit_code == 1, secret
        assert (await sb.exec(["ls", "-A", "/root"])).stdout.split() <= [b".pyenv"]
        listing = await sb.exec(["ls", "-a", str(PROJECT)])
        assert set(listing.stdout.decode().split()) <= {".", "..", ".venv"}
        assert (await sb.exec(["test", "-e", str(PROJECT / "pyproject.toml")])).exit_code == 1
        r = await sb.exec("cat /etc/hostname; ls /etc")
        assert r.stdout.split()[0] == b"sandbox"
        assert b"shadow" not in r.stdout and b"ssh" not in r.stdout

    in_sandbox(check)


def test_proc_shows_only_the_sandbox_processes() -> None:
    async def check(sb: Sandbox) -> None:
        r = await sb.exec("ls /proc | grep -E '^[0-9]+$'")
        pids = {int(p) for p in r.stdout.split()}
        assert 1 in pids  # the sandbox's own init
        assert len(pids) <= 5  # init, the exec leader, sh, ls, grep
        assert (await sb.exec(["test", "-e", f"/proc/{os.getpid()}"])).exit_code

    in_sandbox(check)


def test_no_network_not_even_the_host_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2)\n"
        "        print('connected', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )

    async def check(sb: Sandbox) -> None:
        r = await sb.exec(["python", "-c", code], timeout_s=10)
        assert r.exit_code == 0, r.stderr
        assert b"connected" not in r.stdout
        assert r.stdout.count(b"refused") == 2
        r = await sb.run_python(code)
        assert b"connected" not in r.stdout

    try:
        in_sandbox(check)
    finally:
        server.close()


def test_sandbox_code_runs_unprivileged_with_no_capabilities() -> None:
    async def check(sb: Sandbox) -> None:
        r = await sb.exec("id -u; grep -E '^(Cap[A-Za-z]+|NoNewPrivs|Seccomp):' /proc/self/status")
        lines = r.stdout.decode().split("\n")
        assert lines[0] == "1000"
        status = dict(line.split(":\t") for line in lines[1:] if line)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[cap], 16) == 0, (cap, status[cap])
        assert status["NoNewPrivs"] == "1"
        if seccomp_available():
            assert status["Seccomp"] == "2"
            r = await sb.exec(["unshare", "-U", "true"])
            assert r.exit_code != 0
        r = await sb.run_python("import os; print(os.getuid(), os.geteuid())")
        assert r.stdout == b"1000 1000\n"

    in_sandbox(check)


def test_writes_stay_in_the_sandbox_own_workspace_and_tmp() -> None:
    async def check(sb: Sandbox) -> None:
        for path in ("/usr/x", "/x", "/etc/x", "/proc/x"):
            assert (await sb.exec(["touch", path])).exit_code != 0, path
        r = await sb.exec("echo a > /workspace/a && echo b > /tmp/b && cat a /tmp/b")
        assert r.stdout == b"a\nb\n"

    in_sandbox(check)


def test_file_api_refuses_paths_that_leave_the_workspace() -> None:
    async def check(sb: Sandbox) -> None:
        for bad in ("../x", "/etc/passwd", "a/../../x", "", "a\0b"):
            with pytest.raises(SandboxError):
                await sb.read_file(bad)
            with pytest.raises(SandboxError):
                await sb.write_file(bad, b"x")
        await sb.exec("ln -s / root && mkdir d && ln -s /etc d/etc && ln -s /etc/hostname h")
        for through_link in ("root/etc/hostname", "d/etc/hostname", "h", "root/tmp/x"):
            with pytest.raises(SandboxError):
                await sb.read_file(through_link)
            with pytest.raises(SandboxError):
                await sb.write_file(through_link, b"x")
        await sb.write_file("notes/a.txt", b"kept")
        assert await sb.read_file("notes/a.txt") == b"kept"
        assert (await sb.exec("cat notes/a.txt")).stdout == b"kept"

    in_sandbox(check)


# --- abuse ---------------------------------------------------------------------------------------

HOG = TemplateSpec(name="hog", setup="import os\n", declared_memory_bytes=128 * MiB)


def test_memory_hog_is_oom_killed_and_reported_while_its_siblings_live() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(HOG)
            hog, sibling = await pool.create_group("hog", k=2)
            r = await hog.exec(["python", "-c", "x = bytearray(512 << 20); print(len(x))"])
            assert r.oom_killed and r.exit_code == 137 and r.stdout == b""
            assert "out of memory" in r.text()
            assert (await hog.exec("echo alive")).stdout == b"alive\n"  # the sandbox lives on
            assert (await sibling.exec("echo alive")).stdout == b"alive\n"
            assert pool.stats().oom_kills >= 1

    asyncio.run(main())


@pytest.mark.parametrize(
    "bomb",
    [
        # `exec`: the shell needs no new pid to go on waiting, so only the deadline ends it.
        ["/bin/sh", "-c", "f() { f | f & }; f; exec sleep 30"],
        ["python", "-c", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"],
    ],
    ids=["shell", "python"],
)
def test_fork_bomb_is_stopped_and_the_host_pid_count_recovers(bomb: list[str]) -> None:
    spec = TemplateSpec(name="bomb", declared_memory_bytes=512 * MiB, max_pids=64)
    before = our_processes()

    async def check(sb: Sandbox) -> None:
        r = await sb.exec(bomb, timeout_s=3)
        # Ended by the deadline, or by the pid limit: a shell that cannot fork for its own next
        # command exits ("Cannot fork"), which a loaded machine makes it meet first.
        assert r.timed_out or (r.exit_code != 0 and b"fork" in r.stderr.lower())
        assert sb.usage().pids <= 64
        assert (await sb.exec("echo ok")).stdout == b"ok\n"  # the timeout cleaned up after it

    in_sandbox(check, spec)
    assert wait_for_no_new_processes(before, timeout_s=10) == set()


def test_output_flood_is_truncated() -> None:
    async def check(sb: Sandbox) -> None:
        r = await sb.exec(["python", "-c", "print('x' * 50_000_000)"], max_output_bytes=1000)
        assert r.truncated and r.exit_code == 137 and not r.timed_out  # stopped at the cap
        assert r.stdout == b"x" * 1000
        r = await sb.run_python("print('y' * 10_000_000)", max_output_bytes=1000)
        assert r.truncated and r.stdout == b"y" * 1000

    in_sandbox(check)


LIST_PROCS = "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
# A flood's command may run this long; stopped at its output cap, it ends in a fraction of it
# (a bound relative to the timeout, not seconds that a loaded machine may exceed).
FLOOD_TIMEOUT_S = 60


def test_output_flood_stops_the_command_at_the_cap() -> None:
    async def check(sb: Sandbox) -> None:
        t0 = time.monotonic()
        cmd = "(yes >/dev/null &); yes >&2"
        r = await sb.exec(cmd, timeout_s=FLOOD_TIMEOUT_S, max_output_bytes=64 << 10)
        # Not the timeout: the flood and its background sibling were killed.
        assert time.monotonic() - t0 < FLOOD_TIMEOUT_S / 4
        assert r.truncated and not r.timed_out and r.exit_code == 137
        assert r.stderr == b"y\n" * (32 << 10) and r.stdout == b""
        assert (await sb.run_python(LIST_PROCS)).stdout == b"[1]\n"  # no core left spinning
        assert (await sb.exec("echo usable")).stdout == b"usable\n"

    in_sandbox(check)


def test_output_flood_stops_python_code_at_the_cap() -> None:
    async def check(sb: Sandbox) -> None:
        t0 = time.monotonic()
        flood = "n = 0\nwhile True:\n    try: print('y' * 100); n += 1\n    except Exception: pass"
        r = await sb.run_python(flood, timeout_s=FLOOD_TIMEOUT_S, max_output_bytes=64 << 10)
        assert time.monotonic() - t0 < FLOOD_TIMEOUT_S / 4  # not the timeout
        assert r.truncated and not r.timed_out and r.exit_code == 137
        assert len(r.stdout) == 64 << 10
        assert (await sb.run_python("print(n)")).stdout == b"648\n"  # stopped where it passed
        r = await sb.run_python("raise ValueError('x' * 100_000)", max_output_bytes=1000)
        assert r.exit_code == 1 and r.truncated and len(r.stderr) == 1000  # a traceback is cut

    in_sandbox(check)


def test_timeout_kills_background_setsid_and_double_forked_children() -> None:

    async def check(sb: Sandbox) -> None:
        t0 = time.monotonic()
        r = await sb.exec(
            "sleep 300 & setsid sleep 301 & (sleep 302 &) ; nohup sleep 303 >/dev/null & sleep 304",
            timeout_s=1,
        )
        assert r.timed_out and time.monotonic() - t0 < 300 / 4  # killed, not waited for
        r = await sb.run_python(LIST_PROCS)
        assert r.stdout == b"[1]\n"  # only the sandbox's init is left

    in_sandbox(check)


def test_background_process_of_a_finished_command_keeps_running() -> None:
    async def check(sb: Sandbox) -> None:
        r = await sb.exec("sleep 30 >/dev/null 2>&1 & echo started", timeout_s=5)
        assert r.ok and r.stdout == b"started\n"
        r = await sb.exec("ls /proc | grep -cE '^[0-9]+$'")
        assert int(r.stdout) >= 4  # init, sleep, leader, sh (+ ls, grep)

    in_sandbox(check)


def test_run_python_timeout_interrupts_the_code_and_the_interpreter_survives() -> None:
    async def check(sb: Sandbox) -> None:
        r = await sb.run_python("x = 1\nwhile True:\n    try: pass\n    except Exception: pass", 1)
        assert r.timed_out and r.exit_code == 124
        assert (await sb.run_python("print(x)")).stdout == b"1\n"
        r = await sb.run_python("raise ValueError('boom')")
        assert r.exit_code == 1 and b"ValueError: boom" in r.stderr

    in_sandbox(check)


def test_disk_fill_ends_in_a_clear_error() -> None:
    spec = TemplateSpec(name="small", workspace_bytes=8 * MiB, tmp_bytes=4 * MiB)

    async def check(sb: Sandbox) -> None:
        r = await sb.exec("head -c 20000000 /dev/zero > big")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr
        r = await sb.exec("head -c 20000000 /dev/zero > /tmp/big")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr
        await sb.exec("rm big")
        with pytest.raises(SandboxError, match="No space left"):
            await sb.write_file("big", b"\0" * (12 * MiB))

    in_sandbox(check, spec)


# --- a hostile sandbox against the pool ----------------------------------------------------------

FIND_SOCKET = (  # listdir's own descriptor is gone by the time it is read: skip what is gone
    "import os, struct\n"
    "def link(f):\n"
    "    try:\n"
    "        return os.readlink(f'/proc/self/fd/{f}')\n"
    "    except FileNotFoundError:\n"
    "        return ''\n"
    "fd = next(int(f) for f in os.listdir('/proc/self/fd') if link(f).startswith('socket:'))\n"
)


@pytest.mark.parametrize(
    "frame",
    [
        "struct.pack('>I', 200000) + b'[' * 200000",  # nesting deep enough to break a parser
        "struct.pack('>I', 2) + b'[]'",  # not an object
        "struct.pack('>I', 24) + b'{\"id\": 0, \"blobs\": [1]}' + b'x'",  # blobs for a finished id
        "struct.pack('>I', 30) + b'{\"id\": 5, \"blobs\": [99999999]}'",  # unasked-for blobs
    ],
    ids=["deep", "not-object", "stale-id", "huge"],
)
def test_forged_replies_end_the_sandbox_as_crashed_not_the_pool(frame: str) -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            sb = await pool.create("python")
            assert (await sb.exec("true")).ok  # request id 0 is answered and done
            t0 = time.monotonic()
            with pytest.raises(SandboxCrashed):
                await sb.run_python(
                    FIND_SOCKET + f"os.write(fd, {frame})\nimport time\ntime.sleep(3)", timeout_s=30
                )
            assert time.monotonic() - t0 < 10
            assert not sb.alive
            other = await pool.create("python")  # the pool goes on
            assert (await other.exec("echo ok")).stdout == b"ok\n"

    asyncio.run(main())


def test_sandboxed_code_cannot_read_the_init_nor_the_pool_environment() -> None:
    os.environ["VENUSRL_TEST_SECRET"] = "hunter2"
    try:

        async def check(sb: Sandbox) -> None:
            r = await sb.exec("cat /proc/1/environ /proc/1/mem; env")
            assert b"hunter2" not in r.stdout + r.stderr
            assert b"Permission denied" in r.stderr
            r = await sb.run_python("import os; print(dict(os.environ))")
            assert b"hunter2" not in r.stdout

        in_sandbox(check)
    finally:
        del os.environ["VENUSRL_TEST_SECRET"]


def test_a_fifo_in_the_workspace_does_not_hang_the_file_api() -> None:
    async def check(sb: Sandbox) -> None:
        await sb.exec("mkfifo pipe")
        for call in (sb.read_file("pipe"), sb.write_file("pipe", b"x")):
            with pytest.raises(SandboxError):
                await asyncio.wait_for(call, 5)
        assert (await sb.exec("echo alive")).stdout == b"alive\n"

    in_sandbox(check)


def test_a_command_sent_during_a_long_python_call_waits_instead_of_killing_the_sandbox() -> None:
    async def check(sb: Sandbox) -> None:
        slow = sb.run_python("import time; time.sleep(4); print('slow')", timeout_s=10)
        fast = sb.exec("echo fast", timeout_s=1)
        r_slow, r_fast = await asyncio.gather(slow, fast)
        assert r_slow.stdout == b"slow\n" and r_fast.stdout == b"fast\n"

    in_sandbox(check)
