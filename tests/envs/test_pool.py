"""The pool: lifecycle, page sharing within a group, admission, preemption and accounting."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.processes import ORPHAN_MAKER, our_processes, wait_for_no_new_processes
from venusrl.envs import (
    AdmissionTimeout,
    SandboxError,
    SandboxExpired,
    SandboxPool,
    SandboxPreempted,
    TemplateSpec,
)
from venusrl.envs.cgroups import Cgroup, detect_version
from venusrl.envs.orphans import CGROUP_BASE, RUNTIME_BASE

from .conftest import requires_root

pytestmark = requires_root
MiB = 1 << 20


def host_rss_bytes(cgroup: Cgroup) -> int:
    total = 0
    for pid in cgroup.pids():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def leftovers(pool_name: str) -> list[str]:
    found = [str(d) for d in Cgroup(f"{CGROUP_BASE}/{pool_name}", detect_version()).dirs()]
    found.append(str(RUNTIME_BASE / pool_name))
    mounts = Path("/proc/self/mounts").read_text()
    return [p for p in found if Path(p).exists()] + [
        line for line in mounts.splitlines() if pool_name in line
    ]


# --- lifecycle -----------------------------------------------------------------------------------


def test_close_is_idempotent_and_leaves_no_process_cgroup_mount_or_directory() -> None:
    before = our_processes()

    async def main() -> str:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            group = await pool.create_group("python", k=3)
            sb = group[0]
            await sb.exec("sleep 100 >/dev/null 2>&1 &")
            cgroup_dirs = sb.cgroup.dirs()
            await sb.close()
            await sb.close()
            assert not any(d.exists() for d in cgroup_dirs)
            with pytest.raises(SandboxError, match="closed"):
                await sb.exec("true")
            await group.close()
            name = pool.name
        await pool.close()
        return name

    name = asyncio.run(main())
    assert leftovers(name) == []
    assert wait_for_no_new_processes(before, timeout_s=5) == set()


def test_100_concurrent_execs_over_32_sandboxes_complete() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=8 << 30) as pool:
            groups = await asyncio.gather(*(pool.create_group("python", k=8) for _ in range(4)))
            sandboxes = [sb for g in groups for sb in g]
            assert len(sandboxes) == 32
            results = await asyncio.gather(
                *(
                    sandboxes[i % 32].exec(["python", "-c", f"print({i} * 2)"], timeout_s=60)
                    for i in range(100)
                )
            )
            assert [r.stdout for r in results] == [f"{i * 2}\n".encode() for i in range(100)]

    asyncio.run(main())


@pytest.mark.parametrize("died_while_killing", [False, True])
def test_orphans_of_a_killed_pool_are_reaped_by_the_next_pool(died_while_killing: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith("pool-")
    orphan = Cgroup(f"{CGROUP_BASE}/{name}", detect_version())
    if died_while_killing:  # it froze a sandbox to kill it, and was killed before it thawed it
        sandbox = next(d.name for d in orphan.dirs()[0].iterdir() if d.name.startswith("sb"))
        orphan.child(sandbox).freeze(True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30):
            assert orphan.all_pids() == []

    asyncio.run(main())
    assert leftovers(name) == []


def test_sandbox_past_its_ttl_is_killed_with_a_named_outcome() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30, ttl_s=0.5) as pool:
            sb = await pool.create("python")
            await asyncio.sleep(1.0)
            with pytest.raises(SandboxExpired):
                await sb.exec("true")
            assert pool.records[0].outcome == "expired"

    asyncio.run(main())


# --- sharing -------------------------------------------------------------------------------------

BIG = TemplateSpec(
    name="big",
    setup="import numpy as np\nworking_set = np.ones(200 * 2**20 // 8)\n",
    declared_memory_bytes=1 << 30,
)


def test_group_members_share_the_template_pages_but_not_their_writes() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=4 << 30) as pool:
            await pool.prepare_template(BIG)
            a, b = await pool.create_group("big", k=2, files={"task.txt": b"shared"})
            await a.write_file("task.txt", b"mine")
            await a.exec("echo a > /tmp/a && echo a > new.txt")
            assert await b.read_file("task.txt") == b"shared"
            assert (await b.exec("cat /tmp/a new.txt")).exit_code != 0
            assert await a.read_file("task.txt") == b"mine"
            await a.run_python("working_set[:10] = 2")
            assert (await b.run_python("print(working_set[:10].sum())")).stdout == b"10.0\n"
            # Idle member: charged a few MB, though its resident set holds the whole template.
            usage = b.usage()
            assert usage.physical_bytes < 24 * MiB, usage
            assert host_rss_bytes(b.cgroup) > 200 * MiB

    asyncio.run(main())


def test_cold_sandboxes_each_pay_for_their_own_template() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=4 << 30, share_pages=False) as pool:
            await pool.prepare_template(BIG)
            a, b = await pool.create_group("big", k=2)
            assert a.usage().physical_bytes > 200 * MiB
            assert b.usage().physical_bytes > 200 * MiB

    asyncio.run(main())


def test_fork_carries_files_and_interpreter_state_then_diverges() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            parent = await pool.create("python", files={"seed.txt": b"0"})
            await parent.write_file("work/a.txt", b"from parent")
            await parent.exec("rm seed.txt")
            await parent.run_python("counter = 41\nimport threading\nlock = threading.Lock()")
            child = await parent.fork()
            assert await child.read_file("work/a.txt") == b"from parent"
            assert (await child.exec(["test", "-e", "seed.txt"])).exit_code == 1
            assert (await child.run_python("counter += 1; print(counter)")).stdout == b"42\n"
            assert child.dropped_state == ["lock"]
            await child.write_file("work/a.txt", b"from child")
            assert await parent.read_file("work/a.txt") == b"from parent"
            assert (await parent.run_python("print(counter)")).stdout == b"41\n"

    asyncio.run(main())


def test_failing_template_setup_is_a_clear_error() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            with pytest.raises(SandboxError, match="ZeroDivisionError"):
                await pool.prepare_template(TemplateSpec(name="bad", setup="1 / 0"))
            with pytest.raises(SandboxError, match="unknown template 'nope'"):
                await pool.create("nope")
            await pool.prepare_template(TemplateSpec(name="ok"))
            with pytest.raises(SandboxError, match="NameError"):
                await pool.create("ok", setup="undefined_name")
            sb = await pool.create("ok")  # the pool goes on
            assert (await sb.exec("echo fine")).stdout == b"fine\n"

    asyncio.run(main())


def test_a_template_refused_for_its_files_can_be_prepared_again_once_they_are_fixed() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            refused: list[tuple[dict[str, Any], str]] = [
                ({"a.txt": "text"}, "must be bytes"),
                ({"../a.txt": b"x"}, "inside the workspace"),
                ({"a": b"x", "a/b": b"y"}, "'a/b': cannot be written"),
            ]
            for files, problem in refused:
                with pytest.raises(SandboxError, match=problem):
                    await pool.prepare_template(TemplateSpec(name="t", files=files))
            await pool.prepare_template(TemplateSpec(name="t", files={"a.txt": b"fixed"}))
            sb = await pool.create("t")
            assert await sb.read_file("a.txt") == b"fixed"
            await sb.close()

    asyncio.run(main())


# --- admission -----------------------------------------------------------------------------------


def test_quota_pool_admits_exactly_budget_over_declared() -> None:
    spec = TemplateSpec(name="q", declared_memory_bytes=256 * MiB)

    async def main() -> None:
        async with SandboxPool(
            memory_budget_bytes=1 << 30, admission="quota", admission_timeout_s=1.0
        ) as pool:
            await pool.prepare_template(spec)
            admitted = [await pool.create("q") for _ in range(4)]
            with pytest.raises(AdmissionTimeout, match="no room"):
                await pool.create("q")
            await admitted[0].close()
            await pool.create("q")  # room again
            await pool.prepare_template(TemplateSpec(name="huge", declared_memory_bytes=2 << 30))
            with pytest.raises(SandboxError, match="more than this pool can ever admit"):
                await pool.create("huge")

    asyncio.run(main())


GROWER = TemplateSpec(name="grow", declared_memory_bytes=768 * MiB, expected_memory_bytes=64 * MiB)


def test_footprint_pool_preempts_the_lowest_priority_before_the_kernel_oom_kills() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30, poll_interval_s=0.01) as pool:
            await pool.prepare_template(GROWER)
            low = await pool.create("grow", priority=0)
            high = await pool.create("grow", priority=5)
            hold = (
                "import time\nx = bytearray({n} << 20)\nfor i in range(0, len(x), 4096): x[i] = 1"
            )
            assert (await high.run_python(hold.format(n=300))).ok
            with pytest.raises(SandboxPreempted):
                await low.run_python(hold.format(n=700) + "\ntime.sleep(5)", timeout_s=10)
            assert (await high.exec("echo alive")).stdout == b"alive\n"
            stats = pool.stats()
            assert stats.preemptions == 1 and stats.oom_kills == 0
            assert [r.outcome for r in pool.records] == ["preempted", "running"]

    asyncio.run(main())


def test_a_group_re_ranked_to_high_priority_is_not_the_one_preempted() -> None:
    hold = "import time\nx = bytearray({n} << 20)\nfor i in range(0, len(x), 4096): x[i] = 1"

    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30, poll_interval_s=0.01) as pool:
            await pool.prepare_template(GROWER)
            grower = await (await pool.open_group("grow")).add()
            # Opened as best effort and started last: among equals, the first victim.
            group = await pool.open_group("grow")
            member = await group.add()
            group.set_priority(5)  # the coordinator re-ranked its group: it is needed now
            assert (await member.run_python(hold.format(n=300))).ok
            with pytest.raises(SandboxPreempted):
                await grower.run_python(hold.format(n=700) + "\ntime.sleep(5)", timeout_s=10)
            assert (await member.exec("echo alive")).stdout == b"alive\n"
            assert [r.outcome for r in pool.records] == ["preempted", "running"]

    asyncio.run(main())


def test_accounting_reports_the_figures_behind_a_cost_claim() -> None:
    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30) as pool:
            group = await pool.create_group("python", k=2)
            await asyncio.sleep(0.3)
            await group.close()
            stats = pool.stats()
            assert stats.sandboxes_created == 2 and stats.sandboxes_running == 0
            assert 0.3 * 2 <= stats.sandbox_seconds <= stats.wall_s * 2
            assert 0 < stats.physical_gb_seconds < stats.node_gb_seconds
            assert 0 < stats.mean_create_latency_s < 5
            assert stats.mean_admission_wait_s >= 0
            for rec in pool.records:
                assert rec.outcome == "closed" and rec.peak_bytes > 0 and rec.byte_seconds > 0

    asyncio.run(main())


def test_bad_pool_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="admission"):
        SandboxPool(memory_budget_bytes=1 << 30, admission="lottery")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        SandboxPool(memory_budget_bytes=10)
    with pytest.raises(ValueError, match="template name"):
        TemplateSpec(name="../x")

    async def main() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30) as pool:
            with pytest.raises(SandboxError, match="k must be"):
                await pool.create_group("python", k=0)
            sb = await pool.create("python")
            with pytest.raises(SandboxError, match="cmd must be"):
                await sb.exec([])  # type: ignore[arg-type]
            with pytest.raises(SandboxError, match="timeout_s"):
                await sb.exec("true", timeout_s=-1)

    asyncio.run(main())
