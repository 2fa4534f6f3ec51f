"""Reading a test run's log: each test's status, by the test runner that wrote it, under the ids
SWE-bench's harness records (the ids its datasets list).

- pytest: `-rA`'s summary lines (`PASSED path::test`, the id the first word after the status, as
  SWE-bench keys it: an id with a space is cut there, and so is the dataset's) and verbose lines
  (`path::test PASSED`); XFAIL counts as passing.
- unittest and Django's runner (`--verbosity 2`): a test is the text before ` ... ` (`test_x
  (module.Class)`, Python 3.11's `test_x (module.Class.test_x)`, or the first line of its
  docstring), its status after it or, when the test printed something, on a later line (`ok`);
  `FAIL: test` and `ERROR: test` headers; Django's three known interleavings of a late `ok`.
- sympy's `bin/test --verbose`: `test_x ok`, `test_x F`, `test_x E`.

For RL, where a policy may print what a runner prints: a test reported both passing and failing
counts as failed. ANSI colour codes are stripped first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PYTEST_STATUS = {
    "PASSED": PASSED,
    "XFAIL": PASSED,  # SWE-bench counts an expected failure as passing
    "FAILED": FAILED,
    "ERROR": FAILED,
    "XPASS": FAILED,
    "SKIPPED": SKIPPED,
}
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# Django's late `ok`, after a message its logger printed mid-line.
_DJANGO_LATE_OK = (
    re.compile(r"^(.*?) \.\.\. Testing against Django installed in .*? silenced\.\nok$", re.M),
    re.compile(r"^(.*?) \.\.\. Internal Server Error: /.*/\nok$", re.M),
    re.compile(r"^(.*?) \.\.\. System check identified no issues \(0 silenced\)\.\nok$", re.M),
)


def _record(out: dict[str, str], test: str, status: str) -> None:
    if out.get(test) != FAILED:
        out[test] = status


def parse_pytest(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _ANSI.sub("", log).splitlines():
        line = line.strip()
        words = line.split()
        if len(words) >= 2 and words[0] in _PYTEST_STATUS:
            _record(out, words[1], _PYTEST_STATUS[words[0]])
            continue
        m = _PYTEST_VERBOSE.match(line)
        if m:
            _record(out, m.group(1), _PYTEST_STATUS[m.group(2)])
    return out


def parse_unittest(log: str) -> dict[str, str]:
    log = _ANSI.sub("", log)
    out: dict[str, str] = {}
    last: str | None = None  # the test a late `ok` belongs to
    for raw in log.splitlines():
        line = raw.strip()
        if " ... " in line:
            last = line.split(" ... ", 1)[0]
        passed = next((x for x in (" ... ok", " ... OK", " ...  OK") if line.endswith(x)), "")
        if passed:
            _record(out, line[: -len(passed)], PASSED)
        elif " ... skipped" in line:
            _record(out, line.split(" ... skipped", 1)[0], SKIPPED)
        elif line.endswith((" ... FAIL", " ... ERROR")):
            _record(out, line.rsplit(" ... ", 1)[0], FAILED)
        elif line.startswith(("FAIL: ", "ERROR: ")):
            _record(out, line.split(": ", 1)[1].strip(), FAILED)
        elif line.startswith("ok") and last is not None:
            _record(out, last, PASSED)
            last = None
    for pattern in _DJANGO_LATE_OK:
        for test in pattern.findall(log):
            _record(out, test.strip(), PASSED)
    return out


def parse_sympy(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _ANSI.sub("", log).splitlines():
        line = line.strip()
        if not line.startswith("test_"):
            continue
        test = line.split()[0]
        if line.endswith(" ok"):
            _record(out, test, PASSED)
        elif line.endswith((" F", " E")):
            _record(out, test, FAILED)
    return out


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest,
    "unittest": parse_unittest,
    "sympy": parse_sympy,
}
