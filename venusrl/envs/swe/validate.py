"""Checking a task file before training on it, as SWE-Gym's and R2E-Gym's users do: for each
row, the image loads; without the gold patch every `FAIL_TO_PASS` test fails and every
`PASS_TO_PASS` test passes; with it, all of them pass. Both runs are graded as an episode is
(`grading`), each in a fresh sandbox of the task's image.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from venusrl.envs.service import SandboxService
from venusrl.envs.swe.grading import GradingError, apply_patch, run_tests, start_state
from venusrl.envs.swe.logs import PASSED
from venusrl.envs.swe.tasks import SweTask, swe_template
from venusrl.envs.types import SandboxError


@dataclass
class RowCheck:
    row: int
    instance_id: str
    image: bool = False  # it loaded and a sandbox started in it
    # (count as wanted, listed): FAIL_TO_PASS failing without the gold patch, passing with it;
    # PASS_TO_PASS passing both ways. None where that run did not happen.
    fail_before: tuple[int, int] | None = None
    pass_after: tuple[int, int] | None = None
    p2p_before: tuple[int, int] | None = None
    p2p_after: tuple[int, int] | None = None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return not self.problems


async def _run(pool: SandboxService, task: SweTask, gold: bool, timeout_s: float) -> dict[str, str]:
    group = await pool.open_group(swe_template(task))
    try:
        sandbox = await group.add()
        await start_state(sandbox, task)
        if gold:
            # SWE-smith's rows carry the bug; their fix is taking it back.
            reverse = not task.gold_patch and bool(task.setup_patch)
            problem = await apply_patch(
                sandbox, task.gold_patch or task.setup_patch, "gold", reverse
            )
            if problem:
                raise GradingError(f"the gold patch does not apply: {problem}")
        statuses, _, finished = await run_tests(sandbox, task, timeout_s)
        if not finished:
            raise GradingError(f"the tests ran past {timeout_s:g} s")
        return statuses
    finally:
        await group.close()


def _count(tests: Sequence[str], statuses: dict[str, str], passing: bool) -> tuple[int, int]:
    return sum((statuses.get(t) == PASSED) == passing for t in tests), len(tests)


def _wrong(what: str, tests: Sequence[str], statuses: dict[str, str], passing: bool) -> list[str]:
    """What is wrong with `tests` when they should be passing (or failing): "" when nothing."""
    wrong = [t for t in tests if (statuses.get(t) == PASSED) != passing]
    if not wrong:
        return []
    more = f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return [f"{len(wrong)}/{len(tests)} {what}: {wrong[0]}{more}"]


def _judge(
    task: SweTask, statuses: dict[str, str], fixed: bool
) -> tuple[tuple[int, int], tuple[int, int], list[str]]:
    """(FAIL_TO_PASS as they should be, PASS_TO_PASS passing, what is wrong) for a run without
    the fix (FAIL_TO_PASS should fail) or with it (they should pass)."""
    when = "with the fix" if fixed else "without the fix"
    f2p = _count(task.fail_to_pass, statuses, passing=fixed)
    p2p = _count(task.pass_to_pass, statuses, passing=True)
    wrong = _wrong(
        f"FAIL_TO_PASS {'fail' if fixed else 'pass'} {when}", task.fail_to_pass, statuses, fixed
    )
    wrong += _wrong(f"PASS_TO_PASS fail {when}", task.pass_to_pass, statuses, passing=True)
    return f2p, p2p, wrong


async def check_row(pool: SandboxService, row: int, task: SweTask, timeout_s: float) -> RowCheck:
    check = RowCheck(row, task.instance_id)
    start = time.monotonic()
    try:
        before = await _run(pool, task, gold=False, timeout_s=timeout_s)
        check.image = True
        check.fail_before, check.p2p_before, wrong = _judge(task, before, fixed=False)
        check.problems += wrong
        if not task.gold_patch and not task.setup_patch:
            check.problems.append("no gold patch: the fix cannot be checked")
        else:
            after = await _run(pool, task, gold=True, timeout_s=timeout_s)
            check.pass_after, check.p2p_after, wrong = _judge(task, after, fixed=True)
            check.problems += wrong
    except (SandboxError, GradingError) as e:
        check.problems.append(str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
    check.seconds = time.monotonic() - start
    return check


async def validate(
    pool: SandboxService, tasks: Sequence[SweTask], jobs: int = 2, timeout_s: float = 900.0
) -> list[RowCheck]:
    """Every row checked, `jobs` at a time, in file order."""
    slots = asyncio.Semaphore(jobs)

    async def one(row: int, task: SweTask) -> RowCheck:
        async with slots:
            return await check_row(pool, row, task, timeout_s)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks, 1))))
