"""Build the SWE example: a Debian image with python3, pytest and git, one image per task holding
a small Python repository at /testbed with a real bug in it, and a task file in SWE-bench's
format for them.

    sudo .venv/bin/python examples/swe/build.py [OUT]

The repositories (examples/swe/repos/) are small libraries with pytest suites; each task plants
one bug in one of them (the base commit), and its gold patch and test patch (a regression test,
as SWE-bench's are) are computed with git. The Debian root is written by mmdebstrap once and
kept in OUT/cache; every task's image shares it as its bottom layer, so the layer cache unpacks
it once. The images go to OUT/images (one OCI layout, a tag per task, OUT being
examples/swe/build by default) and the task file to examples/swe/tasks.jsonl (OUT/tasks.jsonl
with an OUT), its images named relative to it. Check it with `venusrl swe validate`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from venusrl.envs.swe.tasks import PYTEST_CMD
from venusrl.images.build import ImageSpec, LayerWriter, write_oci

HERE = Path(__file__).resolve().parent
PACKAGES = ("python3", "python3-pytest", "git", "ca-certificates", "patch")
GIT = ("git", "-c", "user.name=dev", "-c", "user.email=dev@example.com")


@dataclass(frozen=True)
class Bug:
    instance_id: str
    repo: str
    file: str
    fixed: str  # text in the repository as it should be
    buggy: str  # what the base commit has instead
    test_file: str
    regression_test: str  # appended to test_file by the test patch
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    problem_statement: str


TASKS = (
    Bug(
        "pyini__pyini-1",
        "pyini",
        "pyini/parser.py",
        """def _strip_inline_comment(value):
    for marker in COMMENT_PREFIXES:
        cut = value.find(" " + marker)
        if cut != -1:
            value = value[:cut]
    return value.rstrip()""",
        """def _strip_inline_comment(value):
    cut = value.find(" #")
    if cut != -1:
        value = value[:cut]
    return value.rstrip()""",
        "tests/test_parser.py",
        """

def test_inline_comments_are_stripped():
    config = parse("[s]\\na = 1 ; semicolon\\nb = 2 # hash\\nc = x;y\\n")
    assert config.items("s") == {"a": "1", "b": "2", "c": "x;y"}
""",
        ("tests/test_parser.py::test_inline_comments_are_stripped",),
        (
            "tests/test_parser.py::test_full_line_comments_are_skipped",
            "tests/test_parser.py::test_continuation_lines_join_with_newlines",
            "tests/test_parser.py::test_getint_and_getboolean",
        ),
        "Inline comments that start with `;` end up in the value\n\n"
        "The docs say that the rest of a line after ` ;` or ` #` is a comment, but only `#`"
        " works:\n\n"
        "```python\n>>> from pyini import parse\n"
        '>>> parse("[s]\\nretries = 3 ; per host\\n").get("s", "retries")\n'
        "'3 ; per host'\n```\n\n"
        'I expected `"3"`, as with `retries = 3 # per host`. A `;` with no space before it, as in'
        " `c = x;y`, should stay part of the value.",
    ),
    Bug(
        "pyini__pyini-2",
        "pyini",
        "pyini/parser.py",
        """        found = [(stripped.find(sep), sep) for sep in ("=", ":") if sep in stripped]
        if not found:
            raise ParseError(lineno, f"no '=' or ':' in {stripped!r}")
        _, separator = min(found)  # the first one on the line: "url: http://x?a=b"
        name, _, value = stripped.partition(separator)""",
        """        for separator in ("=", ":"):
            name, found, value = stripped.partition(separator)
            if found:
                break
        else:
            raise ParseError(lineno, f"no '=' or ':' in {stripped!r}")""",
        "tests/test_parser.py",
        """

def test_the_first_separator_on_the_line_splits_key_and_value():
    config = parse("[s]\\nurl: http://example.com/?a=b\\nratio = 1:2\\n")
    assert config.get("s", "url") == "http://example.com/?a=b"
    assert config.get("s", "ratio") == "1:2"
""",
        ("tests/test_parser.py::test_the_first_separator_on_the_line_splits_key_and_value",),
        (
            "tests/test_parser.py::test_equals_and_colon_separators",
            "tests/test_parser.py::test_keys_are_case_insensitive",
            "tests/test_parser.py::test_key_before_section_is_an_error",
        ),
        "A `key: value` line whose value contains `=` is split at the `=`\n\n"
        "```ini\n[remote]\nurl: http://example.com/?a=b\n```\n\n"
        '`config.get("remote", "url")` is `None`, and the section has a key'
        ' `"url: http://example.com/?a"` with the value `"b"`. The separator should be the first'
        " `=` or `:` on the line.",
    ),
    Bug(
        "semverlite__semverlite-1",
        "semverlite",
        "semverlite/version.py",
        """        release = (self.major, self.minor, self.patch)
        if not self.prerelease:
            return (release, 1, ())
        return (release, 0, tuple(_identifier_key(i) for i in self.prerelease))""",
        """        release = (self.major, self.minor, self.patch)
        return (release, tuple(_identifier_key(i) for i in self.prerelease))""",
        "tests/test_version.py",
        """

def test_a_prerelease_sorts_before_its_release():
    assert Version.parse("1.0.0-rc.1") < Version.parse("1.0.0")
    assert sorted(["1.0.0", "1.0.0-alpha", "0.9.0"], key=Version.parse)[1] == "1.0.0-alpha"
    assert max_satisfying(["1.0.0-rc.1", "1.0.0"], "0.1.0", include_prereleases=True) == "1.0.0"
""",
        ("tests/test_version.py::test_a_prerelease_sorts_before_its_release",),
        (
            "tests/test_version.py::test_prerelease_identifiers_compare_one_by_one",
            "tests/test_version.py::test_release_numbers_compare_numerically",
            "tests/test_version.py::test_versions_hash_like_they_compare",
        ),
        "Pre-releases sort after their release\n\n"
        "```python\n>>> from semverlite import Version\n"
        '>>> Version.parse("1.0.0-rc.1") > Version.parse("1.0.0")\nTrue\n```\n\n'
        "semver.org says a pre-release version has lower precedence than the normal version, so"
        " `max_satisfying(..., include_prereleases=True)` picks `1.0.0-rc.1` over `1.0.0`.",
    ),
    Bug(
        "intervaltools__intervaltools-1",
        "intervaltools",
        "intervaltools/ops.py",
        "        if merged and start <= merged[-1][1]:",
        "        if merged and start < merged[-1][1]:",
        "tests/test_ops.py",
        """

def test_merge_touching_intervals():
    assert merge([(1, 3), (3, 5)]) == [(1, 5)]
    assert merge([(5, 7), (0, 2), (2, 5)]) == [(0, 7)]
""",
        ("tests/test_ops.py::test_merge_touching_intervals",),
        (
            "tests/test_ops.py::test_merge_overlapping",
            "tests/test_ops.py::test_intersect",
            "tests/test_ops.py::test_gaps",
        ),
        "merge() keeps closed intervals that touch apart\n\n"
        "```python\n>>> merge([(1, 3), (3, 5)])\n[(1, 3), (3, 5)]\n```\n\n"
        "The intervals are closed (the module docstring says so), so they share the point 3 and"
        " should merge into `[(1, 5)]`.",
    ),
)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        [*GIT, *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def debian_root(cache: Path) -> Path:
    """Debian stable minbase with PACKAGES, as a layer tar (mmdebstrap, once)."""
    tar = cache / f"debian-{'-'.join(PACKAGES)}.tar"
    if tar.exists():
        return tar
    if shutil.which("mmdebstrap") is None:
        raise SystemExit("the SWE example's image needs mmdebstrap: apt-get install mmdebstrap")
    cache.mkdir(parents=True, exist_ok=True)
    partial = tar.with_suffix(".partial")
    include = ",".join(PACKAGES)
    subprocess.run(
        [
            "mmdebstrap",
            "--variant=minbase",
            "--format=tar",
            f"--include={include}",
            "bookworm",
            str(partial),
        ],
        check=True,
    )
    partial.rename(tar)
    return tar


def task_repository(bug: Bug, where: Path) -> dict[str, str]:
    """The repository at its base commit (the bug in it) at `where`; its gold and test patches."""
    junk = shutil.ignore_patterns("__pycache__", ".pytest_cache", ".benchmarks")
    shutil.copytree(HERE / "repos" / bug.repo, where, ignore=junk)
    source = where / bug.file
    text = source.read_text()
    if text.count(bug.fixed) != 1:
        raise SystemExit(f"{bug.instance_id}: the fixed text is not once in {bug.file}")
    source.write_text(text.replace(bug.fixed, bug.buggy))
    _git(where, "init", "-q", "-b", "main")
    _git(where, "add", "-A")
    _git(where, "commit", "-qm", f"{bug.repo}: base of {bug.instance_id}")
    source.write_text(text)
    gold = _git(where, "diff")
    _git(where, "checkout", "-q", "--", bug.file)
    test_file = where / bug.test_file
    test_file.write_text(test_file.read_text() + bug.regression_test)
    test_patch = _git(where, "diff")
    _git(where, "checkout", "-q", "--", bug.test_file)
    return {"patch": gold, "test_patch": test_patch}


def build(out: Path, base: list[Path] | None = None, tasks: Path | None = None) -> Path:
    """The images under `out` and the task file (`out`/tasks.jsonl by default): its path.
    `base`: the layers under each repository (the Debian root by default; tests give a
    smaller one)."""
    base = base or [debian_root(out / "cache")]
    images = out / "images"
    tasks = tasks or out / "tasks.jsonl"
    where = os.path.relpath(images, tasks.parent)
    shutil.rmtree(images, ignore_errors=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bug in TASKS:
            repo = Path(tmp) / bug.instance_id
            patches = task_repository(bug, repo)
            layer = LayerWriter(Path(tmp) / f"{bug.instance_id}.tar")
            layer.host_path(str(repo), "testbed")
            layer.close()
            spec = ImageSpec(
                [*base, layer.path],
                env={
                    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG": "C.UTF-8",
                },
                working_dir="/testbed",
                cmd=("/bin/bash",),
            )
            tag = bug.instance_id.replace("__", "--")  # "__" is no separator in an OCI ref name
            write_oci(spec, images, tag=tag)
            rows.append(
                {
                    "instance_id": bug.instance_id,
                    "repo": bug.repo,
                    "problem_statement": bug.problem_statement,
                    "image": f"oci:{where}:{tag}",
                    "repo_dir": "/testbed",
                    "FAIL_TO_PASS": list(bug.fail_to_pass),
                    "PASS_TO_PASS": list(bug.pass_to_pass),
                    "test_cmd": PYTEST_CMD,
                    "log_parser": "pytest",
                    **patches,
                }
            )
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tasks


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(build(Path(sys.argv[1]).resolve()))
    else:
        print(build(HERE / "build", tasks=HERE / "tasks.jsonl"))
