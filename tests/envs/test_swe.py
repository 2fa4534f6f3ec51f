"""SWE tasks in their own images: rows read as each dataset publishes them, episodes played
through the tools SWE agents use, graded as SWE-bench grades (a fresh sandbox, the diff, then
the test patch, then the tests), and task files checked by `venusrl swe validate`.

The images are the SWE example's repositories (examples/swe/build.py) on the small test image
(busybox, Debian's python3 with pytest, git) instead of its Debian root."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import BuiltImages
from venusrl.cli import main as cli
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.swe import Swe
from venusrl.envs.environment import Task
from venusrl.envs.swe.logs import parse_pytest, parse_sympy, parse_unittest
from venusrl.envs.swe.tasks import SweTask, swe_task
from venusrl.envs.task_file import read_task_file
from venusrl.model.tool_calls import format_tool_call

from .conftest import requires_root

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("swe_example", ROOT / "examples/swe/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tasks_file(test_images: BuiltImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = test_images.layout.parent
    base = [where / "base.tar", where / "python.tar"]  # the test image's own layers
    return _example().build(tmp_path_factory.mktemp("swe"), base)


@pytest.fixture(scope="module")
def tasks(tasks_file: Path) -> list[Task]:
    return read_task_file(tasks_file, Swe)


def play(test_images: BuiltImages, task: Task, turns: list[str]) -> tuple[float, Swe]:
    """The episode `turns` make (after each, the next), graded."""

    async def main() -> tuple[float, Swe]:
        async with SandboxPool(6 << 30, images=test_images.store()) as pool:
            group = await pool.open_group(Swe.template_for(task))
            env = Swe(task, await group.add())
            await env.reset()
            for turn in turns:
                result = await env.step(turn)
                if result.done:
                    break
            return await env.reward(), env

    return asyncio.run(main())


def call(name: str, **arguments: Any) -> str:
    return format_tool_call(name, arguments)


@requires_root
def test_the_demonstrators_fix_is_graded_resolved_in_a_fresh_sandbox_and_its_diff_is_the_output(
    test_images: BuiltImages, tasks: list[Task]
) -> None:
    task = next(t for t in tasks if t.id == "intervaltools__intervaltools-1")
    policy = Swe.demonstrator(task, 0)
    assert policy is not None
    turns = [policy("") for _ in range(6)]
    reward, env = play(test_images, task, turns)
    assert reward == 1.0
    assert env.last_grade is not None and env.last_grade.fail_to_pass == (1, 1)
    assert env.last_grade.pass_to_pass == (3, 3)
    assert env.diff is not None and "+        if merged and start <= merged[-1][1]:" in env.diff


@requires_root
def test_an_episode_is_graded_from_its_diff_alone_once_its_sandbox_has_closed(
    test_images: BuiltImages, tasks: list[Task]
) -> None:
    # What reward workers do: the episode's sandbox goes as its turns end; its diff is graded in
    # a fresh sandbox of the group, opened for the grading (`Swe.grade`).
    task = next(t for t in tasks if t.id == "intervaltools__intervaltools-1")
    policy = Swe.demonstrator(task, 0)
    assert policy is not None
    opened: list[int] = []

    async def main() -> tuple[float, float, int]:
        async with SandboxPool(6 << 30, images=test_images.store()) as pool:
            group = await pool.open_group(Swe.template_for(task))
            sandbox = await group.add()
            env = Swe(task, sandbox)
            await env.reset()
            for _ in range(6):
                if (await env.step(policy(""))).done:
                    break
            diff = await env.output()
            await sandbox.close()

            async def open_sandbox() -> Any:
                opened.append(pool.sandboxes_running())
                return await group.add()

            fixed = await Swe.grade(task, diff, open_sandbox)
            unchanged = await Swe.grade(task, "", open_sandbox)  # no sandbox for no change
            return fixed, unchanged, pool.sandboxes_running()

    fixed, unchanged, left = asyncio.run(main())
    assert (fixed, unchanged) == (1.0, 0.0)
    assert opened == [0] and left == 0  # one grader, opened after the episode's closed


@requires_root
def test_editing_the_tests_earns_nothing(test_images: BuiltImages, tasks: list[Task]) -> None:
    """The agent writes the failing test itself, passing, without fixing the code: the test
    patch resets the file and puts the real test back."""
    task = next(t for t in tasks if t.id == "intervaltools__intervaltools-1")
    fake = "\n\ndef test_merge_touching_intervals():\n    pass\n"
    turns = [
        call("bash", command=f"printf '%s' '{fake}' >> tests/test_ops.py && python3 -m pytest -q"),
        call("submit"),
    ]
    reward, env = play(test_images, task, turns)
    assert reward == 0.0
    assert env.diff is not None and "test_merge_touching_intervals" in env.diff  # it did edit
    assert env.last_grade is not None and env.last_grade.fail_to_pass == (0, 1)


@requires_root
def test_an_episode_that_changes_nothing_is_unresolved_without_a_test_run(
    test_images: BuiltImages, tasks: list[Task]
) -> None:
    reward, env = play(test_images, tasks[0], ["I cannot fix this."])
    assert reward == 0.0 and env.diff == ""
    assert env.last_grade is not None and "changes nothing" in env.last_grade.error


@requires_root
def test_changes_to_the_test_harness_are_left_out_of_the_graded_diff(
    test_images: BuiltImages, tasks: list[Task]
) -> None:
    """A conftest.py that marks every test passed, beside the real fix: the fix is graded, the
    conftest is not applied, and the grade says it was left out."""
    task = next(t for t in tasks if t.id == "intervaltools__intervaltools-1")
    cheat = (
        "import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    out = yield\n    out.get_result().outcome = 'passed'\n"
    )
    turns = [
        call("str_replace_editor", command="create", path="tests/conftest.py", file_text=cheat),
        call("submit"),
    ]
    reward, env = play(test_images, task, turns)
    assert reward == 0.0
    assert env.last_grade is not None and env.last_grade.left_out == ("tests/conftest.py",)


@requires_root
def test_the_editor_views_with_line_numbers_and_replaces_only_a_unique_exact_string(
    test_images: BuiltImages, tasks: list[Task]
) -> None:
    task = next(t for t in tasks if t.id == "semverlite__semverlite-1")

    async def main() -> list[str]:
        async with SandboxPool(4 << 30, images=test_images.store()) as pool:
            env = Swe(task, await (await pool.open_group(Swe.template_for(task))).add())
            edit = env.tools[1].run
            assert edit is not None
            answers = []
            for arguments in (
                {"command": "view", "path": "/testbed/semverlite/version.py", "view_range": [1, 3]},
                {
                    "command": "str_replace",
                    "path": "semverlite/version.py",
                    "old_str": "self",
                    "new_str": "x",
                },
                {
                    "command": "str_replace",
                    "path": "semverlite/version.py",
                    "old_str": "absent",
                    "new_str": "",
                },
                {"command": "create", "path": "/tmp/notes.md", "file_text": "a\nb\n"},
                {
                    "command": "insert",
                    "path": "/tmp/notes.md",
                    "insert_line": 1,
                    "new_str": "between",
                },
                {"command": "view", "path": "/tmp/notes.md"},
                {"command": "view", "path": "semverlite"},
                {"command": "delete", "path": "x"},
            ):
                answers.append(await edit(env.sandbox, arguments, 30.0))
            return answers

    view, many, absent, created, inserted, notes, listing, bad = asyncio.run(main())
    assert (
        view.splitlines()[0]
        == '     1\t"""A semantic version and its precedence (semver.org, section 11).'
    )
    assert "[" in view.splitlines()[-1] and "more lines]" in view
    assert "occurs" in many and "times" in many and "exactly once" in many
    assert "does not occur" in absent
    assert created.startswith("created /tmp/notes.md") and inserted.startswith("edited")
    assert notes.split("\n")[:3] == ["     1\ta", "     2\tbetween", "     3\tb"]
    assert "semverlite/version.py" in listing
    assert bad.startswith("error: command must be one of")


def test_rows_of_swe_bench_swe_gym_r2e_gym_and_swe_smith_become_one_kind_of_task() -> None:
    common = {"instance_id": "astropy__astropy-12907", "problem_statement": "Bug.", "patch": "p"}
    bench = swe_task(
        {**common, "repo": "astropy/astropy", "FAIL_TO_PASS": '["a::t1"]', "PASS_TO_PASS": "[]"},
        "row 1",
    )
    assert bench.image == "docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert bench.fail_to_pass == ("a::t1",) and bench.log_parser == "pytest"
    assert "conda activate testbed" in bench.test_cmd
    django = swe_task({**common, "repo": "django/django", "FAIL_TO_PASS": ["x (m.C)"]}, "row 2")
    assert django.log_parser == "unittest" and "runtests.py" in django.test_cmd
    gym = swe_task({**common, "FAIL_TO_PASS": ["a"]}, "row 3", "swe-gym")
    assert gym.image == "docker.io/xingyaoww/sweb.eval.x86_64.astropy_s_astropy-12907:latest"
    r2e = swe_task(
        {
            "docker_image": "namanjain12/orange3_final:abc",
            "problem_statement": "Bug.",
            "expected_output_json": json.dumps({"t::a": "PASSED", "t::b": "FAILED"}),
        },
        "row 4",
    )
    assert r2e.image == "namanjain12/orange3_final:abc" and r2e.fail_to_pass == ("t::a",)
    smith = swe_task(
        {**common, "image_name": "jyangballin/swesmith.x86_64.repo", "FAIL_TO_PASS": ["t"]}, "row 5"
    )
    assert smith.setup_patch == "p" and smith.gold_patch == ""
    own = swe_task(
        {**common, "image": "oci:/x:y", "test_cmd": "make {tests}", "FAIL_TO_PASS": ["t"]}, "r"
    )
    assert (own.image, own.test_cmd, own.repo_dir) == ("oci:/x:y", "make {tests}", "/testbed")
    for bad, message in (
        ({**common, "FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS is empty"),
        ({**common, "FAIL_TO_PASS": "not json"}, "neither a list"),
        (
            {**common, "FAIL_TO_PASS": ["t"], "image": "i:1", "log_parser": "x"},
            "unknown log_parser",
        ),
        ({**common, "FAIL_TO_PASS": ["t"], "repo_dir": "testbed"}, "absolute"),
    ):
        with pytest.raises(ValueError, match=message) as info:
            swe_task(bad, "tasks.jsonl:7")
        assert "tasks.jsonl:7" in str(info.value)


def test_test_logs_are_read_under_the_ids_swe_bench_records() -> None:
    pytest_log = (
        "tests/test_a.py::test_x PASSED [ 50%]\n"
        "tests/test_a.py::test_y FAILED [100%]\n"
        "=== short test summary info ===\n"
        "\x1b[32mPASSED\x1b[0m tests/test_a.py::test_x\n"
        "FAILED tests/test_a.py::test_y - AssertionError: 1 != 2\n"
        "XFAIL tests/test_a.py::test_z - reason\n"
        "ERROR tests/test_b.py::test_w\n"
        "PASSED tests/test_a.py::test_p[a b]\n"  # SWE-bench's id: cut at the space
    )
    assert parse_pytest(pytest_log) == {
        "tests/test_a.py::test_x": "PASSED",
        "tests/test_a.py::test_y": "FAILED",
        "tests/test_a.py::test_z": "PASSED",
        "tests/test_b.py::test_w": "FAILED",
        "tests/test_a.py::test_p[a": "PASSED",
    }
    # A policy that prints a runner's line cannot turn a failure into a pass.
    assert parse_pytest("FAILED t.py::test_f\nPASSED t.py::test_f\n") == {"t.py::test_f": "FAILED"}
    django_log = (
        "test_add (tests.test_calc.CalcTests) ... ok\n"
        "test_div (tests.test_calc.CalcTests.test_div) ... FAIL\n"  # 3.11's form, kept as it is
        "test_skip (tests.test_calc.CalcTests)\nA docstring's first line. ... skipped 'later'\n"
        "test_doc (m.C)\nAdds two numbers. ... ok\n"
        "test_noisy (m.C) ... printed something\nok\n"
        "test_err (m.C) ... ERROR\n"
        "test_late (m.D) ... System check identified no issues (0 silenced).\nok\n"
        "test_xf (m.C) ... expected failure\n"
    )
    assert parse_unittest(django_log) == {
        "test_add (tests.test_calc.CalcTests)": "PASSED",
        "test_div (tests.test_calc.CalcTests.test_div)": "FAILED",
        "A docstring's first line.": "SKIPPED",
        "Adds two numbers.": "PASSED",
        "test_noisy (m.C)": "PASSED",
        "test_err (m.C)": "FAILED",
        "test_late (m.D)": "PASSED",
    }
    assert parse_sympy("test_one ok\ntest_two F\ntest_three E\ntest_four f\n") == {
        "test_one": "PASSED",
        "test_two": "FAILED",
        "test_three": "FAILED",
    }


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _validate(
    test_images: BuiltImages, path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str]:
    code = cli(
        ["swe", "validate", str(path), f"sandbox.image_cache_dir={test_images.cache}", *flags]
    )
    return code, capsys.readouterr().out


@requires_root
def test_validate_finds_every_example_row_valid_and_says_what_is_wrong_with_bad_ones(
    test_images: BuiltImages, tasks_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _validate(test_images, tasks_file, capsys, "--limit", "2")
    assert code == 0 and "2 of 2 rows valid" in out, out
    good = _rows(tasks_file)[3]
    good["image"] = good["image"].replace("oci:", f"oci:{tasks_file.parent}/")  # rows move
    broken: list[Callable[[dict[str, Any]], dict[str, Any]]] = [
        lambda r: {
            **r,
            "instance_id": "wrong-test",
            "FAIL_TO_PASS": ["tests/test_ops.py::test_gaps"],
        },
        lambda r: {**r, "instance_id": "no-image", "image": f"oci:{tmp_path}/none:x"},
        lambda r: {**r, "instance_id": "bad-gold", "patch": r["test_patch"]},
    ]
    path = _write(tmp_path / "mixed.jsonl", [good, *(b(good) for b in broken)])
    code, out = _validate(test_images, path, capsys, "--json")
    checks = {c["instance_id"]: c for c in map(json.loads, out.splitlines())}
    assert code == 1
    assert checks["intervaltools__intervaltools-1"]["valid"]
    assert "1/1 FAIL_TO_PASS pass without the fix" in checks["wrong-test"]["problems"][0]
    assert not checks["no-image"]["image"] and "does not exist" in checks["no-image"]["problems"][0]
    assert any("FAIL_TO_PASS fail with the fix" in p for p in checks["bad-gold"]["problems"])


@requires_root
def test_a_swe_smith_row_starts_from_its_planted_bug_and_validates(
    test_images: BuiltImages, tasks_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SWE-smith's images hold the clean repository and its rows the patch that plants the bug:
    the start state commits it, the fix takes it back."""
    row = _rows(tasks_file)[3]
    row["image"] = row["image"].replace("oci:", f"oci:{tasks_file.parent}/")
    fixed_image = row["image"]  # our base commit has the bug: make a clean one with the fix in
    task = SweTask.from_reference(Swe.task_from_reference(row["instance_id"], "x", row).reference)

    async def fixed_image_ref() -> str:
        from venusrl.images.build import ImageSpec, write_oci

        async with SandboxPool(4 << 30, images=test_images.store()) as pool:
            sb = await (
                await pool.open_group(Swe.template_for(Task("t", "p", reference=task.reference())))
            ).add()
            r = await sb.exec(
                ["sh", "-c", "git apply && git -c user.name=a -c user.email=a@b commit -qam fix"],
                stdin=task.gold_patch.encode(),
            )
            assert r.ok, r.text()
            tar = (
                await sb.exec(["tar", "-C", "/", "-cf", "-", "testbed"], max_output_bytes=64 << 20)
            ).stdout
        (tmp_path / "repo.tar").write_bytes(tar)
        where = test_images.layout.parent
        spec = ImageSpec(
            [where / "base.tar", where / "python.tar", tmp_path / "repo.tar"],
            working_dir="/testbed",
        )
        write_oci(spec, tmp_path / "oci", "clean")
        return f"oci:{tmp_path}/oci:clean"

    clean = asyncio.run(fixed_image_ref())
    assert clean != fixed_image
    bug = _rows(tasks_file)[3]["patch"]
    # The planting patch is the fix reversed: swap its - and + lines.
    planting = (
        "\n".join(
            ("+" + line[1:])
            if line.startswith("-") and not line.startswith("---")
            else ("-" + line[1:])
            if line.startswith("+") and not line.startswith("+++")
            else line
            for line in bug.splitlines()
        )
        + "\n"
    )
    smith = {
        "instance_id": "intervaltools__smith", "problem_statement": row["problem_statement"],
        "image_name": clean, "patch": planting, "test_patch": row["test_patch"],
        "FAIL_TO_PASS": row["FAIL_TO_PASS"], "PASS_TO_PASS": row["PASS_TO_PASS"],
        "test_cmd": row["test_cmd"], "format": "swe-smith",
    }  # fmt: skip
    code, out = _validate(test_images, _write(tmp_path / "smith.jsonl", [smith]), capsys, "--json")
    assert code == 0, out


def test_the_example_task_file_is_what_its_build_writes(tasks_file: Path) -> None:
    """examples/swe/tasks.jsonl is committed (so the example's config loads before the images
    are built): it must stay what examples/swe/build.py writes, images aside."""

    def comparable(path: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k != "image"} for row in _rows(path)]

    assert comparable(ROOT / "examples/swe/tasks.jsonl") == comparable(tasks_file)
    images = [row["image"] for row in _rows(ROOT / "examples/swe/tasks.jsonl")]
    assert all(image.startswith("oci:build/images:") for image in images)  # beside the file
