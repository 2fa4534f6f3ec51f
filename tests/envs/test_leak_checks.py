"""The leak checks count the processes the test started, not the sandboxes of other runs on the
machine (a killed run's orphans included), which come and go during the test."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from tests.processes import ORPHAN_MAKER, our_processes, pool_processes
from venusrl.envs import SandboxPool

from .conftest import requires_root

pytestmark = requires_root


def test_another_runs_orphans_are_not_ours_and_our_sandboxes_are_by_their_pool() -> None:
    run = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None and run.stdout.readline().startswith("pool-")
    theirs = pool_processes({run.pid})
    assert theirs  # its zygote and its sandbox's processes, in its pool's cgroups
    run.send_signal(signal.SIGKILL)  # as another run's kill -9 test does
    run.wait()
    # Orphaned now (no longer under us), still in the cgroups named after their pool's process
    # until a pool reaps them; or gone already: the kernel may end a sandbox's pid namespace with
    # the zygote, before or after this looks. Whatever outlives the kill is not counted ours.
    orphans = pool_processes({run.pid})
    assert orphans <= theirs and not orphans & our_processes()

    async def ours() -> None:
        async with SandboxPool(memory_budget_bytes=1 << 30) as pool:  # reaps the dead pool's
            sb = await pool.create("python")
            await sb.exec("true")
            # Counted by the pool's cgroup, not by parentage: still ours once orphaned.
            mine = set(sb.cgroup.pids())
            assert mine and mine <= pool_processes({os.getpid()}) and mine <= our_processes()

    asyncio.run(ours())
    assert pool_processes({run.pid}) == set()
