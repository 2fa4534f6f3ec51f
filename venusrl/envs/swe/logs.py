"""Reading a test run's log: each test's status, by the test runner that wrote it.

The parsers read what SWE-bench's harness reads: pytest's `-rA` summary (`PASSED path::test`) and
its verbose lines (`path::test PASSED`), unittest's and Django's verbose lines (`test_x
(module.Class) ... ok`, Python 3.11's `(module.Class.test_x)` form named as the older one), and
sympy's `bin/test --verbose` (`test_x ok`). A test reported more than once keeps its last status.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"
_PYTEST_STATUS = {
    "PASSED": PASSED,
    "XFAIL": PASSED,  # SWE-bench counts an expected failure as passing
    "FAILED": FAILED,
    "ERROR": FAILED,
    "XPASS": FAILED,
    "SKIPPED": SKIPPED,
}
_PYTEST_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+?)(?: - .*)?$")
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?: \S.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure)$"
)
_SYMPY = re.compile(r"^(test_\w+) (ok|F|E|f|s|X)\s*$")


def parse_pytest(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.splitlines():
        line = line.strip()
        m = _PYTEST_SUMMARY.match(line)
        if m:
            out[m.group(2)] = _PYTEST_STATUS[m.group(1)]
            continue
        m = _PYTEST_VERBOSE.match(line)
        if m:
            out[m.group(1)] = _PYTEST_STATUS[m.group(2)]
    return out


def parse_unittest(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _UNITTEST.match(line.strip())
        if not m:
            continue
        name, where, status = m.groups()
        where = where.removesuffix(f".{name}")  # 3.11 writes (module.Class.test_x)
        if status == "ok" or status == "expected failure":
            out[f"{name} ({where})"] = PASSED
        elif status.startswith("skipped"):
            out[f"{name} ({where})"] = SKIPPED
        else:
            out[f"{name} ({where})"] = FAILED
    return out


def parse_sympy(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _SYMPY.match(line.strip())
        if m:
            status = m.group(2)
            out[m.group(1)] = (
                PASSED if status in ("ok", "f") else SKIPPED if status == "s" else FAILED
            )
    return out


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest,
    "unittest": parse_unittest,
    "sympy": parse_sympy,
}
