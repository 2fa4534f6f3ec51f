"""Software-engineering agents on SWE-bench-style tasks, each in its own container image.

A task is a row of a task file as SWE-bench, SWE-Gym, R2E-Gym or SWE-smith publish them
(`envs/swe/tasks.py`); its group's sandboxes are rooted in the task's image, at the repository
directory, and fork from one zygote on the image's own Python. The model works as SWE agents do:
`bash` in the repository, `str_replace_editor` to view files and edit them by exact-string
replacement, and `submit` when done. The episode's output is its diff. The reward is SWE-bench's:
the diff is applied to a fresh sandbox of the same image, then the test patch (its files reset
first, so that editing tests earns nothing), then `FAIL_TO_PASS` and `PASS_TO_PASS` run; 1 when
all pass (`envs/swe/grading.py`).
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from venusrl.envs.environment import Environment, OpenSandbox, SandboxVerbs, Task, Tool
from venusrl.envs.swe.grading import Grade, episode_diff, grade, start_state, without_harness
from venusrl.envs.swe.tasks import SweTask, hunks, swe_task, swe_template
from venusrl.envs.types import GiB, MiB, SandboxError, TemplateSpec
from venusrl.images.reference import LOCAL_TRANSPORTS
from venusrl.model.tool_calls import format_tool_call

IMAGE_FIELDS = ("image", "image_name", "docker_image")  # where each format names the image
_MAX_OUTPUT_BYTES = 256 << 10
_MAX_FILE_BYTES = 16 << 20
_VIEW_LINES = 400
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
SUBMITTED = "Your changes are submitted."
INSTRUCTIONS = (
    "You are a software engineer fixing an issue in a repository, in a sandbox with its"
    " dependencies installed. Explore the code, reproduce the issue, edit the source to fix it"
    " and check your fix; do not change the tests. Paths are absolute or relative to the"
    " repository. When you are done, call submit."
)


def _params(required: tuple[str, ...], **properties: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in properties.items()},
        "required": list(required),
    }


async def _bash(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    r = await sandbox.exec(
        arguments["command"], timeout_s=timeout_s, max_output_bytes=_MAX_OUTPUT_BYTES
    )
    status = "" if r.exit_code == 0 or r.timed_out else f"\n[exit code {r.exit_code}]"
    return (r.text() or "(no output)") + status


async def _read(sandbox: SandboxVerbs, path: str, timeout_s: float) -> str:
    r = await sandbox.exec(
        ["cat", "--", path], timeout_s=timeout_s, max_output_bytes=_MAX_FILE_BYTES
    )
    if r.exit_code != 0 or r.truncated:
        raise SandboxError(r.stderr.decode(errors="replace").strip() or f"cannot read {path}")
    try:
        return r.stdout.decode()
    except UnicodeDecodeError:  # editing it as text would corrupt it
        raise SandboxError(f"{path} is not UTF-8 text: edit it with bash") from None


async def _write(sandbox: SandboxVerbs, path: str, text: str, timeout_s: float) -> None:
    r = await sandbox.exec(
        ["sh", "-c", 'mkdir -p "$(dirname -- "$0")" && cat > "$0"', path],
        timeout_s=timeout_s,
        max_output_bytes=1 << 16,
        stdin=text.encode(),
    )
    if r.exit_code != 0:
        raise SandboxError(r.stderr.decode(errors="replace").strip() or f"cannot write {path}")


async def _keep_for_undo(sandbox: SandboxVerbs, path: str, text: str, timeout_s: float) -> None:
    """The file as it was before an edit, for `undo_edit` (one level, in the sandbox's /tmp)."""
    await _write(sandbox, _undo_path(path), text, timeout_s)


def _undo_path(path: str) -> str:
    return f"/tmp/.venusrl-undo/{hashlib.sha256(path.encode()).hexdigest()[:24]}"


async def _editor(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    """SWE-agent's and OpenHands' file tool: view, create, str_replace, insert, undo_edit.
    Paths are the sandbox's own (absolute, or relative to the repository), its whole root
    being the task's."""
    command, path = arguments.get("command"), str(arguments.get("path", ""))
    if command not in EDITOR_COMMANDS:
        return f"error: command must be one of {', '.join(EDITOR_COMMANDS)}, got {command!r}"
    if not path:
        return "error: path is required"
    if command == "view":
        return await _view(sandbox, path, arguments.get("view_range"), timeout_s)
    if command == "create":
        text = arguments.get("file_text")
        if not isinstance(text, str):
            return "error: create needs file_text"
        exists = await sandbox.exec(["test", "-e", path], timeout_s=timeout_s, max_output_bytes=0)
        if exists.exit_code == 0:
            return f"error: {path} exists; create does not overwrite: edit it with str_replace"
        await _write(sandbox, path, text, timeout_s)
        return f"created {path} ({len(text.splitlines())} lines)"
    if command == "undo_edit":
        try:
            before = await _read(sandbox, _undo_path(path), timeout_s)
        except SandboxError:
            return f"error: no edit of {path} to undo"
        await _write(sandbox, path, before, timeout_s)
        await sandbox.exec(["rm", "-f", _undo_path(path)], timeout_s=timeout_s, max_output_bytes=0)
        return f"undid the last edit of {path}:\n" + _numbered(before, 0, _VIEW_LINES)
    source = await _read(sandbox, path, timeout_s)
    new = arguments.get("new_str", "")
    if not isinstance(new, str):
        return "error: new_str must be a string"
    if command == "str_replace":
        old = arguments.get("old_str")
        if not isinstance(old, str) or not old:
            return "error: str_replace needs a non-empty old_str"
        count = source.count(old)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            return f"error: old_str {where} in {path}; it must occur exactly once"
        at = source.index(old)
        edited = source.replace(old, new)
    else:
        line = arguments.get("insert_line")
        lines = source.splitlines(keepends=True)
        if not isinstance(line, int) or not 0 <= line <= len(lines):
            return f"error: insert needs insert_line in [0, {len(lines)}]"
        if line and not lines[line - 1].endswith("\n"):  # after a last line with no newline
            lines[line - 1] += "\n"
        new = new if new.endswith("\n") else new + "\n"
        at = len("".join(lines[:line]))
        edited = "".join([*lines[:line], new, *lines[line:]])
    await _keep_for_undo(sandbox, path, source, timeout_s)
    await _write(sandbox, path, edited, timeout_s)
    first = edited[:at].count("\n")
    return f"edited {path}:\n" + _numbered(edited, first - 3, first + new.count("\n") + 4)


async def _view(sandbox: SandboxVerbs, path: str, view_range: Any, timeout_s: float) -> str:
    listing = (
        'if [ -d "$0" ]; then echo "$0";'
        ' find "$0" -mindepth 1 -maxdepth 2 -not -path "*/.*" | sort; fi'
    )
    r = await sandbox.exec(
        ["sh", "-c", listing, path], timeout_s=timeout_s, max_output_bytes=_MAX_OUTPUT_BYTES
    )
    if r.stdout:
        return r.text()
    text = await _read(sandbox, path, timeout_s)
    if (
        isinstance(view_range, list)
        and len(view_range) == 2
        and all(isinstance(v, int) for v in view_range)
    ):
        first, last = view_range
        return _numbered(text, first - 1, len(text.splitlines()) if last == -1 else last)
    return _numbered(text, 0, _VIEW_LINES)


def _numbered(text: str, start: int, end: int) -> str:
    lines = text.splitlines()
    start, end = max(0, start), min(len(lines), end)
    shown = "\n".join(f"{i + 1:6}\t{lines[i]}" for i in range(start, end))
    more = f"\n[{len(lines) - end} more lines]" if end < len(lines) else ""
    return shown + more


_EDITOR_PARAMS = _params(
    ("command", "path"),
    command=("string", "view, create, str_replace, insert or undo_edit"),
    path=("string", "the file or directory"),
    file_text=("string", "create: the file's content"),
    old_str=("string", "str_replace: the exact text to replace, occurring once"),
    new_str=("string", "str_replace: its replacement; insert: the text to insert"),
    insert_line=("integer", "insert: the line after which new_str goes (0: at the top)"),
    view_range=("array", "view: [first line, last line]; -1 for the last: to the end"),
)


async def _submit(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    return SUBMITTED


async def graded(swe: SweTask, diff: str, open_sandbox: OpenSandbox, timeout_s: float) -> Grade:
    """The grade of `diff`, in a fresh sandbox `open_sandbox` opens (none for a diff that
    changes nothing: the start state, unresolved)."""
    if not without_harness(diff)[0].strip():
        return await grade(None, swe, diff, timeout_s)
    grader = await open_sandbox()
    try:
        return await grade(grader, swe, diff, timeout_s)
    finally:
        await grader.close()


class Swe(Environment):
    name = "swe"
    # The base template, for what needs one before any task (the tool check); each task's
    # group runs in `template_for(task)`, the task's own image.
    template = TemplateSpec(name="swe", declared_memory_bytes=256 * MiB)
    instructions = INSTRUCTIONS
    tools = (
        Tool(
            "bash",
            "Run a shell command in the repository; its output and exit code.",
            _params(("command",), command=("string", "the command line")),
            _bash,
        ),
        Tool(
            "str_replace_editor",
            "View a file or directory, create a file, or edit one by"
            " replacing an exact string or inserting lines.",
            _EDITOR_PARAMS,
            _editor,
        ),
        Tool("submit", "Submit your changes; the episode ends.", _params(()), _submit),
    )
    max_turns = 50  # SWE agents get 50-100 steps; a run's mix entry may cap it lower
    max_tool_calls_per_turn = 2
    tool_timeout_s = 60.0
    max_observation_chars = 8192
    reference_fields = ()
    optional_fields = (
        "format",
        "image",
        "repo_dir",
        "test_cmd",
        "log_parser",
        "repo",
        "repo_name",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "patch",
        "test_patch",
        "image_name",
        "docker_image",
        "expected_output_json",
    )
    default_columns: ClassVar[Mapping[str, str]] = {
        "id": "instance_id",
        "prompt": "problem_statement",
    }
    # Each sandbox may write this much over its image (the whole root is writable).
    writable_bytes: ClassVar[int] = 1 * GiB
    grade_timeout_s: ClassVar[float] = 900.0
    reward_reads_sandbox = False  # graded from the diff `output` took, in a fresh sandbox

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        super().__init__(task, sandbox)
        self.swe = SweTask.from_reference(task.reference)
        self.submitted = False
        self.diff: str | None = None
        self.last_grade: Grade | None = None

    @classmethod
    def template_for(cls, task: Task) -> TemplateSpec:
        return swe_template(SweTask.from_reference(task.reference), cls.writable_bytes)

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        raise ValueError("the swe environment's tasks come from a task file: rollout.tasks=FILE")

    @classmethod
    def reference_problem(cls, reference: Mapping[str, Any]) -> str | None:
        try:
            cls._swe(reference, "-", "-", "the row")
        except ValueError as e:
            return str(e)
        return None

    @staticmethod
    def _swe(reference: Mapping[str, Any], task_id: str, prompt: str, where: str) -> SweTask:
        row = {"instance_id": task_id, "problem_statement": prompt, **reference}
        return swe_task(row, where, str(reference.get("format", "auto")))

    @classmethod
    def anchor(cls, reference: Mapping[str, Any], directory: Path) -> dict[str, Any]:
        """A local image (`oci:images:TAG`) is found beside the task file."""
        out = dict(reference)
        for key in IMAGE_FIELDS:
            value = out.get(key)
            if isinstance(value, str):
                transport, sep, rest = value.partition(":")
                if sep and transport in LOCAL_TRANSPORTS and not rest.startswith("/"):
                    out[key] = f"{transport}:{directory / rest}"
        return out

    @classmethod
    def task_from_reference(cls, task_id: str, prompt: str, reference: Mapping[str, Any]) -> Task:
        swe = cls._swe(reference, task_id, prompt, f"task {task_id}")
        return Task(task_id, swe.problem_statement, reference=swe.reference())

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> Callable[[str], str] | None:
        """An engineer who knows the fix: looks at each file the gold patch changes, makes its
        hunks with the editor (a new file with `create`, a deleted one with `rm`), runs the
        failing tests, submits. None without a gold patch."""
        swe = SweTask.from_reference(task.reference)
        edits = hunks(swe.gold_patch) if swe.gold_patch else hunks(swe.setup_patch, reverse=True)
        if not edits:
            return None
        turns = [
            format_tool_call("str_replace_editor", {"command": "view", "path": path})
            for path in dict.fromkeys(h.path for h in edits if not h.created)
        ]
        for h in edits:
            if h.created:
                call = {"command": "create", "path": h.path, "file_text": h.new}
                turns.append(format_tool_call("str_replace_editor", call))
            elif h.deleted:
                turns.append(format_tool_call("bash", {"command": f"rm -- {shlex.quote(h.path)}"}))
            else:
                call = {
                    "command": "str_replace",
                    "path": h.path,
                    "old_str": h.old,
                    "new_str": h.new,
                }
                turns.append(format_tool_call("str_replace_editor", call))
        check = swe.test_cmd.replace("{tests}", swe.test_targets())
        turns += [format_tool_call("bash", {"command": check}), format_tool_call("submit", {})]
        script = iter(turns)
        return lambda observation: next(script, "Done.")

    async def reset(self) -> list[dict[str, str]]:
        await start_state(self.sandbox, self.swe)
        return await super().reset()

    def ended(self, answers: list[str]) -> bool:
        self.submitted = self.submitted or SUBMITTED in answers
        return self.submitted

    async def output(self) -> str:
        if self.diff is None:
            self.diff = await episode_diff(self.sandbox)
        return self.diff

    async def reward(self) -> float:
        """SWE-bench's: 1 when the diff, graded in a fresh sandbox of the task's image, makes
        every listed test pass (`envs/swe/grading.py`)."""
        fresh = getattr(self.sandbox, "fresh", None)
        if fresh is None:
            raise RuntimeError(
                "the swe environment grades in a fresh sandbox: its sandbox must be a pool's"
            )
        self.last_grade = await graded(self.swe, await self.output(), fresh, self.grade_timeout_s)
        return 1.0 if self.last_grade.resolved else 0.0

    @classmethod
    async def grade(cls, task: Task, output: str | None, open_sandbox: OpenSandbox) -> float:
        swe = SweTask.from_reference(task.reference)
        verdict = await graded(swe, output or "", open_sandbox, cls.grade_timeout_s)
        return 1.0 if verdict.resolved else 0.0
