"""SWE task rows, read as SWE-bench, SWE-Gym, R2E-Gym and SWE-smith publish them.

Every format becomes one `SweTask`: the issue, the image and the repository directory in it, the
tests that must go from failing to passing (`FAIL_TO_PASS`) and those that must keep passing
(`PASS_TO_PASS`), the gold patch, the test patch, and how to run and read the tests (a command
with `{tests}` for the test files or ids, and a named log parser). Where the formats differ:

| field        | SWE-bench, SWE-Gym       | R2E-Gym                       | SWE-smith           |
|--------------|--------------------------|-------------------------------|---------------------|
| image        | named after instance_id  | docker_image                  | image_name          |
| tests        | FAIL_TO_PASS, PASS_TO_PASS | expected_output_json PASSED | as SWE-bench        |
| gold patch   | patch                    | none (validation skips it)    | `patch` reversed    |
| start state  | the image                | the image                     | `patch` committed   |
| test command | SWE-bench's per repo     | run_tests.sh                  | pytest              |

A row of our own (the built-in SWE example) names `image`, `repo_dir`, `test_cmd` and
`log_parser` itself; any row may, and those win over what the format derives. The SWE-bench
and SWE-Gym image names are their harnesses' (`sweb.eval.x86_64.<id>`, Docker Hub); the
commands follow SWE-bench's per-repository specs for django, sympy and the pytest repositories.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from venusrl.envs.types import GiB, MiB, TemplateSpec

FORMATS = ("auto", "swe-bench", "swe-gym", "r2e-gym", "swe-smith", "venusrl")
LOG_PARSERS = ("pytest", "unittest", "sympy")
REPO_DIR = "/testbed"
# SWE-bench's images run their tests in a conda environment named testbed.
_CONDA = "source /opt/miniconda3/bin/activate && conda activate testbed && "
# No --no-header: pytest before 6 refuses it.
PYTEST_CMD = "python3 -m pytest -rA --tb=no -p no:cacheprovider {tests}"
_DJANGO_CMD = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 {tests}"
_SYMPY_CMD = "bin/test -C --verbose {tests}"


@dataclass(frozen=True)
class SweTask:
    instance_id: str
    problem_statement: str
    image: str
    repo_dir: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    gold_patch: str  # the fix; "" when the dataset has none
    test_patch: str  # applied before grading (its files reset first)
    test_cmd: str  # run in repo_dir with sh; {tests}, if there, is the test files or ids
    log_parser: str
    setup_patch: str = ""  # applied and committed first (SWE-smith's bug)
    repo: str = ""

    def reference(self) -> dict[str, Any]:
        """As a task's `reference` (JSON-friendly)."""
        out = asdict(self)
        out["fail_to_pass"], out["pass_to_pass"] = list(self.fail_to_pass), list(self.pass_to_pass)
        return out

    @classmethod
    def from_reference(cls, reference: Mapping[str, Any]) -> SweTask:
        fields = dict(reference)
        fields["fail_to_pass"] = tuple(fields["fail_to_pass"])
        fields["pass_to_pass"] = tuple(fields["pass_to_pass"])
        return cls(**fields)

    def test_targets(self) -> str:
        """What `{tests}` stands for, shell-quoted: the test files the test patch touches (not
        its data files), as module names for Django's runner; without a test patch, the files
        the listed tests live in (SWE-smith's way: ids may be too many, or cut at a space)."""
        files = [f for f in patch_files(self.test_patch) if not f.endswith(NON_TEST_EXTS)]
        if "runtests.py" in self.test_cmd:
            tests = [f for f in files if f.startswith("tests/") and f.endswith(".py")]
            mods = [f.removeprefix("tests/").removesuffix(".py").replace("/", ".") for f in tests]
            return " ".join(shlex.quote(m) for m in mods)
        return " ".join(shlex.quote(f) for f in files or test_files(self))


# A test patch's files a runner must not be given (SWE-bench's NON_TEST_EXTS): its data.
NON_TEST_EXTS = (
    *(".json", ".png", ".csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml"),
    *(".toml", ".rst", ".cfg", ".ini", ".gif", ".svg"),
)


def test_files(task: SweTask) -> list[str]:
    """The files the listed tests live in, for ids that name one (pytest's path::test)."""
    files = []
    for test in (*task.fail_to_pass, *task.pass_to_pass):
        path = test.split("::", 1)[0]
        if "::" in test and path.endswith(".py") and path not in files:
            files.append(path)
    return files


_DIFF_HEADER = re.compile(
    r'^diff --git ("a/(?:[^"\\]|\\.)*"|a/\S+) ("b/(?:[^"\\]|\\.)*"|b/\S+)$', re.M
)


def _unquote(path: str) -> str:
    if path.startswith('"'):  # git quotes a path with spaces or odd bytes, C-style
        path = path[1:-1].encode().decode("unicode_escape").encode("latin-1").decode()
    return path[2:]  # a/ or b/


def split_patch(patch: str) -> list[tuple[tuple[str, str], str]]:
    """A git diff file by file: ((old path, new path), that file's part of the diff)."""
    heads = list(_DIFF_HEADER.finditer(patch))
    parts = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(patch)
        parts.append(
            ((_unquote(head.group(1)), _unquote(head.group(2))), patch[head.start() : end])
        )
    return parts


def patch_files(patch: str, both_sides: bool = False) -> list[str]:
    """The files a git diff touches, in order: their new paths (and their old ones, which a
    rename leaves, with `both_sides`)."""
    files: list[str] = []
    for (old, new), _ in split_patch(patch):
        for path in (old, new) if both_sides else (new,):
            if path not in files:
                files.append(path)
    return files


@dataclass(frozen=True)
class Hunk:
    """One hunk of a diff as an editor makes it: in `path`, `old` becomes `new`; a file the
    diff creates has `old` "" (`created`), one it deletes `new` "" (`deleted`)."""

    path: str
    old: str
    new: str
    created: bool = False
    deleted: bool = False


def hunks(patch: str, reverse: bool = False) -> list[Hunk]:
    """Each hunk of a unified diff (`reverse`: undone), "\\ No newline at end of file" heeded."""
    out: list[Hunk] = []
    for (_, path), text in split_patch(patch):
        created = "\nnew file mode " in text.split("@@", 1)[0]
        deleted = "\ndeleted file mode " in text.split("@@", 1)[0]
        old: list[str] = []
        new: list[str] = []
        last = ""
        for line in text.splitlines(keepends=True)[1:]:
            if line.startswith("@@"):
                if old or new:
                    out.append(_hunk(path, old, new, created, deleted, reverse))
                old, new = [], []
            elif line[:1] in (" ", "-", "+") and not line.startswith(("--- ", "+++ ")):
                last = line[0]
                if last != "+":
                    old.append(line[1:])
                if last != "-":
                    new.append(line[1:])
            elif line.startswith("\\"):  # the line before it has no newline
                for side in (old, new) if last == " " else (old,) if last == "-" else (new,):
                    side[-1] = side[-1].removesuffix("\n")
        if old or new:
            out.append(_hunk(path, old, new, created, deleted, reverse))
    return out


def _hunk(
    path: str, old: list[str], new: list[str], created: bool, deleted: bool, reverse: bool
) -> Hunk:
    before, after = "".join(old), "".join(new)
    if reverse:
        return Hunk(path, after, before, created=deleted, deleted=created)
    return Hunk(path, before, after, created=created, deleted=deleted)


def _tests(value: Any, where: str, name: str) -> tuple[str, ...]:
    """A list of test ids, given as a list or as a JSON string of one (SWE-bench's way)."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise ValueError(f"{where}: {name} is neither a list nor a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{where}: {name} must be a list of test ids")
    return tuple(value)


# SWE-bench's repositories: a row of SWE-bench's fields from any other is SWE-Gym's.
SWE_BENCH_REPOS = frozenset(
    {"astropy/astropy", "django/django", "matplotlib/matplotlib", "mwaskom/seaborn"}
    | {"pallets/flask", "psf/requests", "pydata/xarray", "pylint-dev/pylint", "sympy/sympy"}
    | {"pytest-dev/pytest", "scikit-learn/scikit-learn", "sphinx-doc/sphinx"}
)


def detect_format(row: Mapping[str, Any]) -> str:
    if "test_cmd" in row or "log_parser" in row:
        return "venusrl"
    if "expected_output_json" in row or "docker_image" in row:
        return "r2e-gym"
    if "image_name" in row:
        return "swe-smith"
    repo = row.get("repo")
    if isinstance(repo, str) and repo and repo not in SWE_BENCH_REPOS:
        return "swe-gym"
    return "swe-bench"


def _harness_image(instance_id: str, fmt: str) -> str:
    """The image SWE-bench's (or SWE-Gym's) harness names for an instance."""
    key = instance_id.lower()
    if fmt == "swe-gym":
        return f"docker.io/xingyaoww/sweb.eval.x86_64.{key.replace('__', '_s_')}:latest"
    return f"docker.io/swebench/sweb.eval.x86_64.{key.replace('__', '_1776_')}:latest"


def _swe_bench_cmd(repo: str) -> tuple[str, str]:
    """SWE-bench's per-repository test command and log parser."""
    if repo == "django/django":
        return _CONDA + _DJANGO_CMD, "unittest"
    if repo == "sympy/sympy":
        return _CONDA + _SYMPY_CMD, "sympy"
    return _CONDA + PYTEST_CMD, "pytest"


def _text(row: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = row.get(key, default)
    if value is None:
        raise ValueError(f"{where}: no field {key!r}")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {type(value).__name__}")
    return value


def swe_task(row: Mapping[str, Any], where: str, fmt: str = "auto") -> SweTask:
    """The task a row of format `fmt` (detected from its fields with "auto") describes;
    `ValueError` naming `where` and the field at fault."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown SWE task format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(row)
    repo = str(row.get("repo") or row.get("repo_name") or "")
    if fmt == "r2e-gym":
        expected = row.get("expected_output_json") or "{}"
        try:
            statuses = json.loads(expected) if isinstance(expected, str) else dict(expected)
        except (ValueError, TypeError):
            raise ValueError(f"{where}: expected_output_json is not a JSON object") from None
        instance_id = str(row.get("instance_id") or row.get("docker_image") or "")
        fields: dict[str, Any] = {
            "image": _text(row, "docker_image", where),
            "fail_to_pass": tuple(t for t, s in statuses.items() if s == "PASSED"),
            "pass_to_pass": (),
            "gold_patch": "",
            "test_patch": "",
            "test_cmd": "bash run_tests.sh",
            "log_parser": "pytest",
        }
    else:
        instance_id = _text(row, "instance_id", where)
        patch = _text(row, "patch", where, "")
        fields = {
            "fail_to_pass": _tests(row.get("FAIL_TO_PASS"), where, "FAIL_TO_PASS"),
            "pass_to_pass": _tests(row.get("PASS_TO_PASS"), where, "PASS_TO_PASS"),
            "gold_patch": patch,
            "test_patch": _text(row, "test_patch", where, ""),
        }
        if fmt == "swe-smith":
            # The image holds the clean repository; the row's patch is the bug it plants.
            fields |= {"image": _text(row, "image_name", where), "setup_patch": patch}
            fields |= {"gold_patch": "", "test_cmd": PYTEST_CMD, "log_parser": "pytest"}
        elif fmt in ("swe-bench", "swe-gym"):
            cmd, parser = _swe_bench_cmd(repo)
            image = row.get("image") or _harness_image(instance_id, fmt)
            fields |= {"image": image, "test_cmd": cmd, "log_parser": parser}
        else:
            fields |= {
                "image": _text(row, "image", where),
                "test_cmd": _text(row, "test_cmd", where, PYTEST_CMD),
            }
            fields["log_parser"] = _text(row, "log_parser", where, "pytest")
    for key in ("image", "repo_dir", "test_cmd", "log_parser"):  # a row's own win
        if isinstance(row.get(key), str) and row[key]:
            fields[key] = row[key]
    fields.setdefault("repo_dir", REPO_DIR)
    task = SweTask(
        instance_id=instance_id,
        problem_statement=_text(row, "problem_statement", where),
        repo=repo,
        **fields,
    )
    _check(task, where)
    return task


def _check(task: SweTask, where: str) -> None:
    if not task.repo_dir.startswith("/"):
        raise ValueError(f"{where}: repo_dir must be an absolute path, got {task.repo_dir!r}")
    if task.log_parser not in LOG_PARSERS:
        raise ValueError(
            f"{where}: unknown log_parser {task.log_parser!r}; known: {', '.join(LOG_PARSERS)}"
        )
    if not task.fail_to_pass:
        raise ValueError(f"{where}: FAIL_TO_PASS is empty: nothing would tell a fix from none")


def swe_template(task: SweTask, writable_bytes: int = 1 * GiB) -> TemplateSpec:
    """The template a task's sandboxes start from: its image, at its repository; one per
    image and directory, so tasks that share an image share its warm zygote."""
    key = hashlib.sha256(f"{task.image}\0{task.repo_dir}".encode()).hexdigest()[:16]
    return TemplateSpec(
        name=f"swe-{key}",
        family="swe",
        image=task.image,
        workdir=task.repo_dir,
        declared_memory_bytes=2 * GiB,
        expected_memory_bytes=256 * MiB,
        workspace_bytes=writable_bytes,
        tmp_bytes=512 * MiB,
        max_pids=1024,
    )
