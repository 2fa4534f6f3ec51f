"""Grading an SWE episode as SWE-bench does: in a fresh sandbox of the task's image, the task's
start state, then the agent's diff, then the test patch (its files first reset to the start
state, so editing or deleting tests earns nothing), then the tests; resolved when every
`FAIL_TO_PASS` and every `PASS_TO_PASS` test passes.

Everything here speaks the sandbox verbs (`exec`), so the same code grades an episode, checks a
task file (`validate`) and runs in a reward worker. Patches go through /tmp, never the
repository, so they are no part of any diff.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from venusrl.envs.environment import SandboxVerbs
from venusrl.envs.swe.logs import PARSERS, PASSED
from venusrl.envs.swe.tasks import SweTask, patch_files

MAX_DIFF_BYTES = 4 << 20
MAX_LOG_BYTES = 32 << 20
_GIT_ID = "-c user.name=venusrl -c user.email=venusrl@localhost"


@dataclass(frozen=True)
class Grade:
    resolved: bool
    applied: bool  # the agent's diff applied to the start state
    fail_to_pass: tuple[int, int]  # (passed, listed)
    pass_to_pass: tuple[int, int]
    not_passing: tuple[str, ...] = ()  # listed tests that did not pass (the first few)
    error: str = ""  # why it could not be graded further
    log_tail: str = ""
    duration_s: float = 0.0


class GradingError(Exception):
    """The task itself cannot be set up (its start patch or test patch does not apply to its
    image): the task's fault, not the agent's."""


async def _sh(
    sandbox: SandboxVerbs, script: str, timeout_s: float, stdin: bytes = b"", cap: int = 1 << 20
) -> tuple[int, str]:
    # bash where the image has it (a test command may need it), sh otherwise
    wrapped = (
        f"if command -v bash >/dev/null; then exec bash -c {shlex.quote(script)}; fi; {script}"
    )
    r = await sandbox.exec(wrapped, timeout_s=timeout_s, max_output_bytes=cap, stdin=stdin)
    return (124 if r.timed_out else r.exit_code), r.text()


async def apply_patch(sandbox: SandboxVerbs, patch: str, name: str, reverse: bool = False) -> str:
    """Apply `patch` in the repository (git apply, then patch's fuzz, as SWE-bench tries);
    "" when it applied, else what failed."""
    if not patch.strip():
        return ""
    path = f"/tmp/venusrl-{name}.diff"
    flag = "-R " if reverse else ""
    script = (
        f"cat > {path} && (git apply --whitespace=nowarn {flag}{path} 2>/tmp/venusrl-apply.err"
        f" || patch --batch --fuzz=5 -p1 {flag}-i {path} >>/tmp/venusrl-apply.err 2>&1"
        f" || {{ cat /tmp/venusrl-apply.err; exit 1; }})"
    )
    code, out = await _sh(sandbox, script, 120.0, stdin=patch.encode())
    return "" if code == 0 else (out.strip() or f"exit {code}")[-2000:]


async def start_state(sandbox: SandboxVerbs, task: SweTask) -> None:
    """The state an episode starts from: the image as it is, or with the task's start patch
    committed (SWE-smith's planted bug), so that a diff against HEAD is the agent's alone."""
    if not task.setup_patch:
        return
    problem = await apply_patch(sandbox, task.setup_patch, "setup")
    if problem:
        raise GradingError(f"{task.instance_id}: the start patch does not apply: {problem}")
    code, out = await _sh(sandbox, f"git add -A && git {_GIT_ID} commit -qm start", 60.0)
    if code != 0:
        raise GradingError(f"{task.instance_id}: committing the start state failed: {out}")


async def episode_diff(sandbox: SandboxVerbs) -> str:
    """The agent's changes to the repository as a git diff (new files included)."""
    code, out = await _sh(
        sandbox,
        "git add -A >/dev/null 2>&1 && git diff --cached --binary HEAD",
        60.0,
        cap=MAX_DIFF_BYTES,
    )
    return out if code == 0 else ""


async def run_tests(
    sandbox: SandboxVerbs, task: SweTask, timeout_s: float
) -> tuple[dict[str, str], str]:
    """Reset the test patch's files, apply it, run the task's tests: each test's status, and
    the log."""
    resets = " ".join(
        f"{{ git checkout -q HEAD -- {shlex.quote(f)} 2>/dev/null || rm -f {shlex.quote(f)}; }};"
        for f in patch_files(task.test_patch)
    )
    if resets:
        await _sh(sandbox, resets, 60.0)
    problem = await apply_patch(sandbox, task.test_patch, "tests")
    if problem:
        raise GradingError(f"{task.instance_id}: the test patch does not apply: {problem}")
    cmd = task.test_cmd.replace("{tests}", task.test_targets())
    await _sh(sandbox, f"{cmd} > /tmp/venusrl-tests.log 2>&1", timeout_s)
    _, log = await _sh(sandbox, "cat /tmp/venusrl-tests.log", 60.0, cap=MAX_LOG_BYTES)
    return PARSERS[task.log_parser](log), log


def judge(task: SweTask, statuses: dict[str, str], applied: bool, log: str, took: float) -> Grade:
    missing = [t for t in (*task.fail_to_pass, *task.pass_to_pass) if statuses.get(t) != PASSED]
    f2p = sum(statuses.get(t) == PASSED for t in task.fail_to_pass)
    p2p = sum(statuses.get(t) == PASSED for t in task.pass_to_pass)
    return Grade(
        resolved=applied and not missing,
        applied=applied,
        fail_to_pass=(f2p, len(task.fail_to_pass)),
        pass_to_pass=(p2p, len(task.pass_to_pass)),
        not_passing=tuple(missing[:10]),
        log_tail=log[-3000:],
        duration_s=took,
    )


async def grade(sandbox: SandboxVerbs, task: SweTask, diff: str, timeout_s: float) -> Grade:
    """Grade `diff` in `sandbox`, a fresh sandbox of the task's image."""
    start = time.monotonic()
    await start_state(sandbox, task)
    problem = await apply_patch(sandbox, diff, "agent")
    if problem:
        none = (0, len(task.fail_to_pass))
        return Grade(
            False,
            False,
            none,
            (0, len(task.pass_to_pass)),
            error=f"the diff does not apply: {problem}",
        )
    statuses, log = await run_tests(sandbox, task, timeout_s)
    return judge(task, statuses, True, log, time.monotonic() - start)
