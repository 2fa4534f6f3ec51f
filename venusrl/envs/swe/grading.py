"""Grading an SWE episode as SWE-bench does: in a fresh sandbox of the task's image, the task's
start state, then the agent's diff, then the test patch (the files it touches and the files the
listed tests live in first reset to the start state, so editing or deleting tests earns
nothing), then the tests; resolved when every `FAIL_TO_PASS` and every `PASS_TO_PASS` test
passes and the run ended by itself.

Beyond SWE-bench, for RL (a policy finds what a benchmark's authors never try): the agent's
changes to the test harness (conftest.py, pytest/tox configuration, the repository's own test
runners, sitecustomize) are left out of its diff before it is applied (the grade counts them),
a test reported with two statuses counts as failed (a printed fake "PASSED" line cannot win),
and a start state of the task's own (SWE-smith's planted bug) is a commit with no history, so
`git log` shows the agent nothing of the fix.

Everything here speaks the sandbox verbs (`exec`), so the same code grades an episode and checks
a task file (`validate`). Patches go through /tmp, never the repository.
"""

from __future__ import annotations

import posixpath
import shlex
import time
from dataclasses import dataclass

from venusrl.envs.environment import SandboxVerbs
from venusrl.envs.swe.logs import PARSERS, PASSED
from venusrl.envs.swe.tasks import SweTask, patch_files, split_patch, test_files

MAX_DIFF_BYTES = 8 << 20
MAX_LOG_BYTES = 32 << 20
# -c safe.directory: the repository may belong to another user than the sandbox's (as it does in
# SWE-bench's images once copied), which git would refuse to read.
_GIT = "git -c safe.directory='*' -c user.name=venusrl -c user.email=venusrl@localhost"
# What a test run reads besides the tests: the agent's changes to these are not applied.
HARNESS_NAMES = frozenset(
    {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py"}
    | {"sitecustomize.py", "usercustomize.py", "run_tests.sh", "runtests.py", ".coveragerc"}
)
HARNESS_PATHS = frozenset({"bin/test", "tests/runtests.py"})


@dataclass(frozen=True)
class Grade:
    resolved: bool
    applied: bool  # the agent's diff applied to the start state
    fail_to_pass: tuple[int, int]  # (passed, listed)
    pass_to_pass: tuple[int, int]
    not_passing: tuple[str, ...] = ()  # listed tests that did not pass (the first few)
    left_out: tuple[str, ...] = ()  # files of the diff not applied: the test harness's
    error: str = ""  # why it stopped short (a diff that does not apply, a test run cut)
    log_tail: str = ""
    duration_s: float = 0.0


class GradingError(Exception):
    """The task itself cannot be set up (its start patch does not apply to its image): the
    task's fault, not the agent's."""


async def _sh(
    sandbox: SandboxVerbs, script: str, timeout_s: float, stdin: bytes = b"", cap: int = 1 << 20
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `script` under bash where the image has it (a test
    command may need it), sh otherwise; 124 past `timeout_s`."""
    # The newline: sh parses a whole line before running it, so bash syntax after a `;` would
    # fail in sh before the exec could happen.
    wrapped = (
        f"if command -v bash >/dev/null; then exec bash -c {shlex.quote(script)}; fi\n{script}"
    )
    r = await sandbox.exec(wrapped, timeout_s=timeout_s, max_output_bytes=cap, stdin=stdin)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    return (124 if r.timed_out else 137 if r.truncated else r.exit_code), out, err


async def apply_patch(sandbox: SandboxVerbs, patch: str, name: str, reverse: bool = False) -> str:
    """Apply `patch` in the repository (git apply, then patch's fuzz, as SWE-bench tries);
    "" when it applied, else what failed."""
    if not patch.strip():
        return ""
    path = f"/tmp/venusrl-{name}.diff"
    flag = "-R " if reverse else ""
    script = (
        f"cat > {path} && ({_GIT} apply --whitespace=nowarn {flag}{path} 2>/tmp/venusrl-apply.err"
        f" || patch --batch --fuzz=5 -p1 {flag}-i {path} >>/tmp/venusrl-apply.err 2>&1"
        f" || {{ cat /tmp/venusrl-apply.err; exit 1; }})"
    )
    code, out, err = await _sh(sandbox, script, 120.0, stdin=patch.encode())
    return "" if code == 0 else ((out + err).strip() or f"exit {code}")[-2000:]


async def start_state(sandbox: SandboxVerbs, task: SweTask) -> None:
    """The state an episode starts from: the image as it is, or with the task's start patch
    applied (SWE-smith's planted bug) and made the only commit there is, so that a diff
    against HEAD is the agent's alone and no history holds the fix."""
    if not task.setup_patch:
        return
    problem = await apply_patch(sandbox, task.setup_patch, "setup")
    if problem:
        raise GradingError(f"{task.instance_id}: the start patch does not apply: {problem}")
    script = (
        f"{_GIT} checkout -q --orphan venusrl-start && {_GIT} add -A"
        f" && {_GIT} commit -qm start && {_GIT} for-each-ref --format='%(refname)'"
        " | grep -v '^refs/heads/venusrl-start$' | while read -r ref; do"
        f' {_GIT} update-ref -d "$ref"; done; {_GIT} reflog expire --expire=now --all'
        f" && {_GIT} gc -q --prune=now"
    )
    code, out, err = await _sh(sandbox, script, 300.0)
    if code != 0:
        raise GradingError(f"{task.instance_id}: making the start state failed: {out}{err}")


async def episode_diff(sandbox: SandboxVerbs) -> str:
    """The agent's changes to the repository as a git diff (new files included). Raises
    `RuntimeError` when git cannot say: an empty diff must mean that nothing changed."""
    script = f"{_GIT} add -A >/dev/null && {_GIT} diff --cached --binary HEAD"
    code, out, err = await _sh(sandbox, script, 120.0, cap=MAX_DIFF_BYTES)
    if code != 0:
        why = "over the size limit" if code == 137 else err.strip()[-500:] or f"exit {code}"
        raise RuntimeError(f"the episode's diff could not be read: {why}")
    return out


def _is_harness(path: str) -> bool:
    return posixpath.basename(path) in HARNESS_NAMES or path in HARNESS_PATHS


def without_harness(diff: str) -> tuple[str, tuple[str, ...]]:
    """`diff` less its files that the test run reads besides the tests; and those files."""
    kept, dropped = [], []
    for paths, text in split_patch(diff):
        if any(_is_harness(p) for p in paths):
            dropped.append(paths[-1])
        else:
            kept.append(text)
    return "".join(kept), tuple(dropped)


async def reset_tests(sandbox: SandboxVerbs, task: SweTask) -> None:
    """The files the test patch touches (both sides of a rename) and those the listed tests
    live in, as the start state has them: tracked ones checked out, new ones removed."""
    paths = sorted({*patch_files(task.test_patch, both_sides=True), *test_files(task)})
    if not paths:
        return
    resets = "\n".join(
        f"{_GIT} checkout -q HEAD -- {shlex.quote(p)} 2>/dev/null || rm -rf -- {shlex.quote(p)}"
        for p in paths
    )
    await _sh(sandbox, resets, 120.0)


async def run_tests(
    sandbox: SandboxVerbs, task: SweTask, timeout_s: float
) -> tuple[dict[str, str], str, bool]:
    """Reset the tests, apply the test patch, run the task's tests: each test's status, the
    log, and whether the run ended by itself (not at `timeout_s`). Raises `GradingError`
    when the test patch does not apply."""
    await reset_tests(sandbox, task)
    problem = await apply_patch(sandbox, task.test_patch, "tests")
    if problem:
        raise GradingError(f"{task.instance_id}: the test patch does not apply: {problem}")
    cmd = task.test_cmd.replace("{tests}", task.test_targets())
    code, _, _ = await _sh(sandbox, f"{cmd} > /tmp/venusrl-tests.log 2>&1", timeout_s)
    # The tail: a summary is at the end of a log too long to read whole.
    tail = f"tail -c {MAX_LOG_BYTES} /tmp/venusrl-tests.log"
    _, log, _ = await _sh(sandbox, tail, 60.0, cap=MAX_LOG_BYTES + 4096)
    return PARSERS[task.log_parser](log), log, code != 124


def judge(task: SweTask, statuses: dict[str, str], log: str, took: float, **grade: object) -> Grade:
    missing = [t for t in (*task.fail_to_pass, *task.pass_to_pass) if statuses.get(t) != PASSED]
    f2p = sum(statuses.get(t) == PASSED for t in task.fail_to_pass)
    p2p = sum(statuses.get(t) == PASSED for t in task.pass_to_pass)
    return Grade(
        resolved=not missing and not grade.get("error"),
        applied=True,
        fail_to_pass=(f2p, len(task.fail_to_pass)),
        pass_to_pass=(p2p, len(task.pass_to_pass)),
        not_passing=tuple(missing[:10]),
        log_tail=log[-3000:],
        duration_s=took,
        **grade,  # type: ignore[arg-type]
    )


def unresolved(task: SweTask, applied: bool, error: str, **grade: object) -> Grade:
    none = (0, len(task.fail_to_pass)), (0, len(task.pass_to_pass))
    return Grade(False, applied, *none, error=error, **grade)  # type: ignore[arg-type]


async def grade(sandbox: SandboxVerbs | None, task: SweTask, diff: str, timeout_s: float) -> Grade:
    """Grade `diff` in `sandbox`, a fresh sandbox of the task's image. A diff that changes
    nothing the tests run leaves the start state, which fails its FAIL_TO_PASS tests by
    definition: unresolved, nothing run (no sandbox needed)."""
    start = time.monotonic()
    kept, left_out = without_harness(diff)
    if not kept.strip():
        return unresolved(task, False, "the diff changes nothing the tests run", left_out=left_out)
    assert sandbox is not None
    await start_state(sandbox, task)
    problem = await apply_patch(sandbox, kept, "agent")
    if problem:
        return unresolved(task, False, f"the diff does not apply: {problem}", left_out=left_out)
    try:
        statuses, log, finished = await run_tests(sandbox, task, timeout_s)
    except GradingError as e:
        # Its files were reset first, so only what the agent did elsewhere can stop it (a
        # directory made where a test file goes): the agent's doing, not the task's.
        return unresolved(task, True, str(e), left_out=left_out)
    error = "" if finished else f"the tests ran past {timeout_s:g} s"
    return judge(task, statuses, log, time.monotonic() - start, left_out=left_out, error=error)
