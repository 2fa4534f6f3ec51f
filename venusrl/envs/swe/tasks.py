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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from venusrl.envs.types import GiB, MiB, TemplateSpec

FORMATS = ("auto", "swe-bench", "swe-gym", "r2e-gym", "swe-smith", "venusrl")
LOG_PARSERS = ("pytest", "unittest", "sympy")
REPO_DIR = "/testbed"
# SWE-bench's images run their tests in a conda environment named testbed.
_CONDA = "source /opt/miniconda3/bin/activate && conda activate testbed && "
PYTEST_CMD = "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider {tests}"
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
        """What `{tests}` stands for: the test files the test patch touches (pytest, sympy),
        as module names for django's runner; the listed tests when it touches none."""
        files = patch_files(self.test_patch)
        if "runtests.py" in self.test_cmd:
            mods = [f.removeprefix("tests/").removesuffix(".py").replace("/", ".") for f in files]
            return " ".join(mods)
        if files:
            return " ".join(files)
        return " ".join(_quote(t) for t in (*self.fail_to_pass, *self.pass_to_pass))


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def patch_files(patch: str) -> list[str]:
    """The files a unified git diff touches, in order."""
    files = []
    for match in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.MULTILINE):
        if match.group(2) not in files:
            files.append(match.group(2))
    return files


def hunks(patch: str, reverse: bool = False) -> list[tuple[str, str, str]]:
    """(file, old text, new text) for each hunk of a unified diff (`reverse`: undone), each
    an exact-string replacement an editor can make."""
    out: list[tuple[str, str, str]] = []
    path, in_hunk = "", False
    old: list[str] = []
    new: list[str] = []

    def flush() -> None:
        if in_hunk and path:
            before, after = "".join(old), "".join(new)
            out.append((path, after, before) if reverse else (path, before, after))

    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git "):
            flush()
            path, in_hunk = line.split(" b/", 1)[1].strip(), False
        elif line.startswith("@@"):
            flush()
            old, new, in_hunk = [], [], True
        elif in_hunk and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                old.append(line[1:])
            if line[0] != "-":
                new.append(line[1:])
        elif in_hunk and line.startswith("\\"):
            continue  # "\ No newline at end of file"
        else:
            flush()
            in_hunk = False
    flush()
    return out


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


def detect_format(row: Mapping[str, Any]) -> str:
    if "test_cmd" in row or "log_parser" in row:
        return "venusrl"
    if "expected_output_json" in row or "docker_image" in row:
        return "r2e-gym"
    if "image_name" in row:
        return "swe-smith"
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
