"""Mini software engineering: find and fix the one bug that makes a small repository's tests fail.

The template's workspace is a correct little library (`mini/`) with stdlib `unittest` tests at the
top level; each task overwrites one module with a copy that has one bug in it. The model works
through `bash`, `read_file` and `write_file`, like an SWE agent: run the tests, read the failing
code, write the fix, run the tests again. Reward: 1 when the original tests pass at the end, else 0.

The reward first writes the template's test files back, so deleting or editing the tests earns
nothing, and runs `python -I` (isolated): a workspace module called `unittest`, a planted
`usercustomize` under the workspace (which is also $HOME) or PYTHON* variables cannot stand in
for the standard library (unittest's discovery puts the workspace on the path for the tests'
own imports).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from venusrl.envs.environment import Environment, SandboxVerbs, Task, Tool
from venusrl.envs.types import InfraFailure, MiB, SandboxError, TemplateSpec
from venusrl.model.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN, format_tool_call

_REPO: dict[str, str] = {
    "mini/__init__.py": '"""A tiny utility library."""\n',
    "mini/stats.py": '''\
def mean(xs):
    """The arithmetic mean of a non-empty sequence."""
    return sum(xs) / len(xs)


def median(xs):
    """The middle value of a non-empty sequence; the mean of the two middle ones if even."""
    ordered = sorted(xs)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
''',
    "mini/text.py": '''\
def is_palindrome(text):
    """True when text reads the same backwards, ignoring case, spaces and punctuation."""
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def word_count(text):
    """How many whitespace-separated words text has."""
    return len(text.split())
''',
    "mini/ranges.py": '''\
def clamp(x, low, high):
    """x limited to the interval [low, high]."""
    return max(low, min(high, x))
''',
    "mini/search.py": '''\
def binary_search(xs, target):
    """The index of target in the sorted list xs, or -1 when it is absent."""
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
    "test_stats.py": """\
import unittest

from mini.stats import mean, median


class TestStats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)
        self.assertEqual(mean([5]), 5)

    def test_median(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)
""",
    "test_text.py": """\
import unittest

from mini.text import is_palindrome, word_count


class TestText(unittest.TestCase):
    def test_is_palindrome(self):
        self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))
        self.assertTrue(is_palindrome("Racecar"))
        self.assertFalse(is_palindrome("palindrome"))

    def test_word_count(self):
        self.assertEqual(word_count("  two   words "), 2)
        self.assertEqual(word_count(""), 0)
""",
    "test_ranges.py": """\
import unittest

from mini.ranges import clamp


class TestRanges(unittest.TestCase):
    def test_clamp(self):
        self.assertEqual(clamp(5, 0, 10), 5)
        self.assertEqual(clamp(-3, 0, 10), 0)
        self.assertEqual(clamp(12, 0, 10), 10)
""",
    "test_search.py": """\
import unittest

from mini.search import binary_search


class TestSearch(unittest.TestCase):
    def test_finds_every_element(self):
        xs = [1, 3, 5, 7, 9]
        for i, x in enumerate(xs):
            self.assertEqual(binary_search(xs, x), i)

    def test_absent(self):
        self.assertEqual(binary_search([1, 3, 5], 4), -1)
        self.assertEqual(binary_search([], 1), -1)
""",
}

_TEST_FILES = {path: text for path, text in _REPO.items() if path.startswith("test_")}


@dataclass(frozen=True)
class _Bug:
    path: str
    correct: str  # a snippet of the module as the template has it
    buggy: str  # what replaces it in the task's copy


_BUGS = (
    _Bug("mini/stats.py", "sum(xs) / len(xs)", "sum(xs) / (len(xs) - 1)"),
    _Bug(
        "mini/stats.py",
        "(ordered[mid - 1] + ordered[mid]) / 2",
        "(ordered[mid] + ordered[mid + 1]) / 2",
    ),
    _Bug("mini/text.py", "[c.lower() for c in text", "[c for c in text"),
    _Bug("mini/text.py", "len(text.split())", 'len(text.split(" "))'),
    _Bug("mini/ranges.py", "max(low, min(high, x))", "min(low, max(high, x))"),
    _Bug("mini/search.py", "while lo <= hi:", "while lo < hi:"),
)
assert all(_REPO[b.path].count(b.correct) == 1 for b in _BUGS), "each bug must have one site"

_PROMPT = (
    "The unit tests of the Python repository in the current directory fail. Find the bug in the"
    " library code under mini/ (the tests are correct) and fix it. Run the tests with"
    " `python -m unittest`. When they pass, reply without a tool call."
)

_MAX_OUTPUT_BYTES = 64 << 10  # per command; the observation is capped further in characters


async def _bash(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    r = await sandbox.exec(
        arguments["command"], timeout_s=timeout_s, max_output_bytes=_MAX_OUTPUT_BYTES
    )
    status = "" if r.exit_code == 0 or r.timed_out else f"\n[exit code {r.exit_code}]"
    return r.text() + status


async def _read_file(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    return (await sandbox.read_file(arguments["path"])).decode(errors="replace")


async def _write_file(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    data = arguments["content"].encode()
    await sandbox.write_file(arguments["path"], data)
    return f"wrote {len(data)} bytes to {arguments['path']}"


def _params(**properties: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": "string", "description": d} for k, d in properties.items()},
        "required": list(properties),
    }


class SweMini(Environment):
    name = "swe_mini"
    template = TemplateSpec(
        name="swe-mini",
        files={path: text.encode() for path, text in _REPO.items()},
        declared_memory_bytes=256 * MiB,
    )
    instructions = "You are a software engineer working in a sandboxed repository."
    tools = (
        Tool(
            "bash",
            "Run a shell command in the repository and return its output.",
            _params(command="the command line"),
            _bash,
        ),
        Tool(
            "read_file",
            "Return the content of a file.",
            _params(path="relative to the repository root"),
            _read_file,
        ),
        Tool(
            "write_file",
            "Replace the content of a file (or create it).",
            _params(path="relative to the repository root", content="the whole new content"),
            _write_file,
        ),
    )
    max_turns = 12
    tool_timeout_s = 20.0

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        index = 0
        while True:
            bug = rng.choice(_BUGS)
            yield Task(
                id=f"swe-{seed}-{index}",
                prompt=_PROMPT,
                files={bug.path: _REPO[bug.path].replace(bug.correct, bug.buggy).encode()},
                reference={"path": bug.path, "buggy": bug.buggy, "correct": bug.correct},
            )
            index += 1

    async def reward(self) -> float:
        try:
            for path, text in _TEST_FILES.items():
                await self.sandbox.write_file(path, text.encode())
        except InfraFailure:
            raise
        except SandboxError:  # the model put a directory or a symlink where a test file goes
            return 0.0
        # Only the exit status scores: output is discarded, so a fix that prints past the cap
        # (which stops a command, as a flood) still passes.
        r = await self.sandbox.exec(
            "python -I -m unittest >/dev/null 2>&1", timeout_s=60, max_output_bytes=1 << 10
        )
        return 1.0 if r.ok else 0.0


def _call(name: str, **arguments: str) -> str:
    return format_tool_call(name, arguments)


def _response_content(observation: str) -> str:
    return observation.removeprefix(f"{RESPONSE_OPEN}\n").removesuffix(f"\n{RESPONSE_CLOSE}")


class ScriptedFixer:
    """A scripted expert: runs the tests, reads the buggy module, writes it back fixed (editing
    the text it read, so it goes through the tools), runs the tests again and answers."""

    def __init__(self, task: Task) -> None:
        self.reference: Mapping[str, Any] = task.reference
        self.turn = 0

    def __call__(self, observation: str) -> str:
        self.turn += 1
        path = self.reference["path"]
        if self.turn == 1:
            return _call("bash", command="python -m unittest")
        if self.turn == 2:
            return _call("read_file", path=path)
        if self.turn == 3:
            source = _response_content(observation)
            if self.reference["buggy"] not in source:
                raise ValueError(f"{path} as read does not hold the bug: {observation!r}")
            fixed = source.replace(self.reference["buggy"], self.reference["correct"])
            return _call("write_file", path=path, content=fixed)
        if self.turn == 4:
            return _call("bash", command="python -m unittest")
        return "The tests pass now."


class CheatByDeletingTests:
    """A wrong episode: makes `python -m unittest` pass by deleting the tests, then answers."""

    def __init__(self) -> None:
        self.turn = 0

    def __call__(self, observation: str) -> str:
        self.turn += 1
        if self.turn == 1:
            return _call("bash", command="rm test_*.py && python -m unittest")
        return "The tests pass now."
