"""Sandboxes rooted in container images: the image's own tree, Env, WorkingDir and User; a group
forked from one zygote on the image's own Python; writes private and bounded; everything the
host-root sandboxes promise (no network, no host, no capabilities, bounded pids and memory)
still held; a killed run leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.conftest import BuiltImages
from tests.processes import our_processes, wait_for_no_new_processes
from venusrl.envs import SandboxPool, SandboxStartError, TemplateSpec
from venusrl.envs.cgroups import Cgroup, detect_version
from venusrl.envs.orphans import CGROUP_BASE, RUNTIME_BASE

from .conftest import requires_root

pytestmark = requires_root
MiB = 1 << 20
T = TypeVar("T")


def with_pool(
    images: BuiltImages, body: Callable[[SandboxPool], Awaitable[T]], share_pages: bool = True
) -> T:
    async def main() -> T:
        pool = SandboxPool(4 << 30, share_pages=share_pages, images=images.store())
        async with pool:
            return await body(pool)

    return asyncio.run(main())


def test_an_image_sandbox_runs_in_the_image_with_its_env_workdir_and_user(
    test_images: BuiltImages,
) -> None:
    async def body(pool: SandboxPool) -> None:
        busybox = await pool.create(TemplateSpec(name="bb", image=test_images.busybox))
        r = await busybox.exec(
            "id -u; id -g; pwd; echo $HOME; cat /etc/hostname; ls /", timeout_s=10
        )
        uid, gid, cwd, home, hostname, *tops = r.stdout.decode().split()
        assert (uid, gid, cwd, home, hostname) == (
            "1000",
            "1000",
            "/home/agent",
            "/home/agent",
            "sandbox",
        )
        assert "usr" not in tops and "bin" in tops  # busybox's own root: no host /usr
        python = await pool.create(TemplateSpec(name="py", image=test_images.python))
        r = await python.exec(
            'id -u; pwd; echo "$PROBE"; python3 -c "import sys; print(sys.executable)"',
            timeout_s=10,
        )
        assert r.stdout.decode().split() == ["0", "/work", "1", "/usr/bin/python3"]
        # What `docker run IMAGE` runs: the test image's Cmd is /bin/sh; with arguments, them.
        assert (
            await python.run_image(["echo", "from", "the", "image"])
        ).stdout == b"from the image\n"
        assert (await python.run_image()).exit_code == 0  # sh, stdin empty: exits at once
        await python.write_file("notes/a.txt", b"relative to the working directory\n")
        assert (await python.exec("cat /work/notes/a.txt")).stdout.startswith(b"relative")
        other = await pool.create(
            TemplateSpec(name="as-agent", image=test_images.python, user="agent", workdir="/tmp/w")
        )
        r = await other.exec("id -un; pwd; touch /etc/x", timeout_s=10)
        assert r.stdout.decode().split() == ["agent", "/tmp/w"] and r.exit_code != 0

    with_pool(test_images, body)


SETUP = "import sys\nHEAP = [str(i) * 4 for i in range(600_000)]\n"  # ~60 MB of objects


def test_a_group_forks_from_a_zygote_on_the_images_own_python_and_shares_its_pages(
    test_images: BuiltImages,
) -> None:
    spec = TemplateSpec(
        name="heap", image=test_images.python, setup=SETUP, declared_memory_bytes=1 << 30
    )

    async def members(pool: SandboxPool) -> list[int]:
        await pool.prepare_template(spec)
        group = await pool.create_group("heap", k=3, setup="TASK = 'mine'")
        out = []
        for sb in group:
            r = await sb.run_python("print(sys.executable, sys.version_info[:2], len(HEAP), TASK)")
            assert r.stdout.decode().split()[0] == "/usr/bin/python3", r.text()
            assert "600000 mine" in r.stdout.decode()
            out.append(sb.usage().physical_bytes)
        return out

    shared = with_pool(test_images, members)
    cold = with_pool(test_images, members, share_pages=False)
    # Each cold member built the heap itself; a forked one holds only its own few pages.
    assert max(shared) * 4 <= min(cold), (shared, cold)


def test_an_image_without_a_python_starts_members_from_a_host_zygote_and_refuses_run_python(
    test_images: BuiltImages,
) -> None:
    async def body(pool: SandboxPool) -> None:
        spec = TemplateSpec(name="bb", image=test_images.busybox, files={"seed.txt": b"seed\n"})
        group = await pool.create_group(spec, k=2, files={"task.txt": b"task\n"})
        r = await group[0].exec("cat seed.txt task.txt; ls -ln task.txt", timeout_s=10)
        assert r.stdout.decode().startswith("seed\ntask\n")
        assert re.search(r"\b1000\s+1000\b", r.stdout.decode())  # owned by the image's User
        with pytest.raises(Exception, match="has no Python"):
            await group[0].run_python("print(1)")
        with pytest.raises(SandboxStartError, match="has no Python"):
            await pool.prepare_template(
                TemplateSpec(name="bb2", image=test_images.busybox, setup="x = 1")
            )

    with_pool(test_images, body)


def test_writes_are_private_to_the_sandbox_bounded_and_never_reach_the_layer_cache(
    test_images: BuiltImages,
) -> None:
    spec = TemplateSpec(name="w", image=test_images.python, workspace_bytes=8 * MiB)

    async def body(pool: SandboxPool) -> None:
        one, two = await pool.create_group(spec, k=2)
        r = await one.exec(
            "echo hacked > /usr/bin/python3 && echo x >> /etc/passwd && echo ok", timeout_s=10
        )
        assert r.stdout == b"ok\n", r.text()
        assert (await two.exec("python3 -c 'print(1)'")).stdout == b"1\n"
        assert b"hacked" not in (await two.exec("cat /etc/passwd")).stdout
        image = await pool.images.get(test_images.python)
        assert all(
            b"hacked" not in p.read_bytes()
            for p in (layer / "usr/bin/python3.11" for layer in image.layers)
            if p.exists()
        )
        r = await one.exec("dd if=/dev/zero of=/work/big bs=1M count=16", timeout_s=10)
        assert r.exit_code != 0 and b"No space left" in r.stderr

    with_pool(test_images, body)


# Run as a template's setup: root of the sandboxes' user namespace, with every capability there.
TAMPER = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
layer = b"/.venusrl/layers/0"
MS_REMOUNT, MS_BIND, MS_RDONLY = 32, 4096, 1
refused = []
for flags in (MS_REMOUNT | MS_BIND, MS_REMOUNT):
    if libc.mount(None, layer, None, flags, None) == 0:
        raise SystemExit("remounted a shared layer read-write")
    refused.append(errno.errorcode[ctypes.get_errno()])
if libc.umount2(layer, 2) == 0:  # MNT_DETACH
    raise SystemExit("unmounted a shared layer")
try:
    open("/.venusrl/layers/0/usr/bin/tampered", "w")
    raise SystemExit("wrote into a shared layer")
except OSError:
    pass
REFUSED = refused
"""


def test_a_templates_setup_cannot_make_a_shared_layer_writable(test_images: BuiltImages) -> None:
    spec = TemplateSpec(name="tamper", image=test_images.python, setup=TAMPER)

    async def body(pool: SandboxPool) -> None:
        await pool.prepare_template(spec)
        (sb,) = await pool.create_group("tamper", k=1)
        r = await sb.run_python("print(REFUSED)")
        assert "EPERM" in r.stdout.decode(), r.text()
        image = await pool.images.get(test_images.python)
        assert not any((layer / "usr/bin/tampered").exists() for layer in image.layers)

    with_pool(test_images, body)


def test_a_setup_that_writes_without_end_neither_blocks_nor_fills_a_disk_and_is_quoted(
    test_images: BuiltImages,
) -> None:
    noisy = (
        "import sys\n"
        "for i in range(200_000):\n    print('noise', i, file=sys.stderr)\n"
        "print('the last words', file=sys.stderr)\n"
        "raise RuntimeError('boom')\n"
    )
    spec = TemplateSpec(name="noisy", image=test_images.python, setup=noisy, setup_timeout_s=60)

    async def body(pool: SandboxPool) -> None:
        with pytest.raises(SandboxStartError) as info:
            await pool.prepare_template(spec)
        said = str(info.value)
        assert "RuntimeError: boom" in said and "the last words" in said
        assert len(said) < 8000  # the tail, not megabytes of noise
        written = sum(p.stat().st_size for p in RUNTIME_BASE.rglob("*") if p.is_file())
        assert written < 4 * MiB, written

    with_pool(test_images, body)


def test_the_hostile_suite_holds_inside_an_image_sandbox(test_images: BuiltImages) -> None:
    before = our_processes()
    spec = TemplateSpec(
        name="hostile", image=test_images.python, max_pids=64, declared_memory_bytes=256 * MiB
    )

    async def body(pool: SandboxPool) -> None:
        sb, hog = await pool.create_group(spec, k=2)
        checks = await sb.exec(
            "cat /proc/self/status | grep -E '^Cap(Eff|Prm|Bnd)'; "
            "ls /.venusrl; ls /proc | grep -c '^[0-9]'; "
            'python3 -c "import socket; s = socket.socket(); s.settimeout(2);'
            " s.connect(('10.0.2.2', 80))\" 2>&1 | tail -1; "
            "cat /sys/class/net/lo/operstate 2>/dev/null || echo no-sys; "
            "unshare -r true 2>&1 || echo no-unshare; "
            "ls /root/.pyenv /work/main 2>&1 | head -2",
            timeout_s=20,
        )
        out = checks.stdout.decode()
        assert out.count("0000000000000000") == 3, out  # no capability at all, uid 0 or not
        assert "Network is unreachable" in out and "no-unshare" in out
        assert "/root/.pyenv" in out and "No such file" in out  # nothing of the host
        assert len([line for line in out.splitlines() if line.isdigit() and int(line) < 8]) == 1
        r = await sb.exec(
            [
                "python3",
                "-c",
                "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
            ],
            timeout_s=2,
        )
        assert r.timed_out and sb.usage().pids <= 64
        r = await hog.exec(["python3", "-c", "x = bytearray(512 << 20)"], timeout_s=20)
        assert r.oom_killed and (await hog.exec("echo alive")).stdout == b"alive\n"
        r = await sb.exec(["python3", "-c", "print('x' * 50_000_000)"], max_output_bytes=1000)
        assert r.truncated and r.stdout == b"x" * 1000

    with_pool(test_images, body)
    assert wait_for_no_new_processes(before, timeout_s=10) == set()


def test_templates_of_tasks_images_are_prepared_once_on_demand_and_the_idle_ones_dropped(
    test_images: BuiltImages,
) -> None:
    async def body(pool: SandboxPool) -> None:
        specs = [
            TemplateSpec(name=f"task{i}", image=test_images.busybox, workdir=f"/t{i}")
            for i in range(6)
        ]
        groups = [await pool.open_group(specs[0]), await pool.open_group(specs[0])]
        assert len(pool._warm.templates) == 1  # one template for two groups of one image
        for spec in specs[1:]:
            groups.append(await pool.open_group(spec))
        for group in groups:
            await group.close()
        assert len(pool._warm.templates) == 4  # the newest idle ones stay warm
        assert pool.images._holders[test_images.busybox] == 4
        sb = await pool.create(specs[0])  # dropped, so prepared again
        assert (await sb.exec("pwd")).stdout == b"/t0\n"

    with_pool(test_images, body)


def test_a_config_user_the_image_lacks_is_refused_when_the_template_is_prepared(
    test_images: BuiltImages,
) -> None:
    async def body(pool: SandboxPool) -> None:
        with pytest.raises(SandboxStartError, match=r"template 'ghost'.*user 'ghost'.*/etc/passwd"):
            await pool.prepare_template(
                TemplateSpec(name="ghost", image=test_images.busybox, user="ghost")
            )

    with_pool(test_images, body)


KILLED_RUN = """
import asyncio, sys
from venusrl.envs import SandboxPool, TemplateSpec
from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.store import ImageStore
from pathlib import Path

async def main():
    pool = SandboxPool(8 << 30, images=ImageStore(Path(sys.argv[1]), 8 << 30, IMAGE_ID_BASE))
    await pool.start()
    small = dict(declared_memory_bytes=256 << 20, expected_memory_bytes=32 << 20)
    group = await pool.create_group(TemplateSpec(name="py", image=sys.argv[2], **small), k=2)
    await group[0].exec("sleep 600 >/dev/null 2>&1 &", timeout_s=5)
    await pool.create_group(TemplateSpec(name="bb", image=sys.argv[3], **small), k=1)
    await pool.create("python")
    print(pool.name, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_kill_9_of_the_run_leaves_no_sandbox_mount_or_cgroup_behind(
    test_images: BuiltImages,
) -> None:
    before = our_processes()
    run = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_RUN,
            str(test_images.cache),
            test_images.python,
            test_images.busybox,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    hung = threading.Timer(60, run.kill)  # a run that hangs fails this test, not the suite
    hung.start()
    assert run.stdout is not None
    name = run.stdout.readline().strip()
    hung.cancel()
    assert name.startswith("pool-"), name  # (the run died before it had sandboxes)
    cgroup = Cgroup(f"{CGROUP_BASE}/{name}", detect_version())
    assert len(cgroup.all_pids()) >= 6  # zygotes, members, the sleep
    run.send_signal(signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 15
    while (cgroup.exists() or (RUNTIME_BASE / name).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cgroup.exists() and not (RUNTIME_BASE / name).exists()
    mounts = Path("/proc/self/mounts").read_text()
    assert name not in mounts and str(test_images.cache) not in mounts
    assert wait_for_no_new_processes(before, timeout_s=10) == set()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in cgroup.all_pids())
