"""The documents keep up with the code: every command the README shows is run by a test or the CI
script, its `venusrl` commands parse as written, the links between the pages resolve, and
docs/configuration.md is what the config models give."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from venusrl import cli
from venusrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]

# Each shell command of the README, and what runs it: a test (in the cheapest form that still
# runs what the command runs) or the CI script. A command added to the README without a row here
# fails `test_every_command_in_the_readme_is_run_by_a_test_or_the_ci_script`.
RUN_BY: dict[str, tuple[str, ...]] = {
    # scripts/train.sh is scripts/bootstrap.sh, then `venusrl train` with what it is given.
    "scripts/train.sh": (
        "tests/runtime/test_train.py::test_the_cpu_example_raises_its_reward_by_0_4_within_ten_minutes",
    ),
    "scripts/test.sh": (".ci/run",),
    "sudo .venv/bin/python examples/swe/build.py": (
        "tests/envs/test_swe_example.py::test_the_swe_example_builds_validates_and_trains_with_graded_episodes",
        "tests/envs/test_swe.py::test_the_example_task_file_is_what_its_build_writes",
    ),
    "sudo .venv/bin/venusrl swe validate examples/swe/tasks.jsonl": (
        "tests/envs/test_swe_example.py::test_the_swe_example_builds_validates_and_trains_with_graded_episodes",
        "tests/envs/test_swe.py::test_validate_finds_every_example_row_valid_and_says_what_is_wrong_with_bad_ones",
    ),
    "sudo .venv/bin/venusrl train --config examples/swe-agent.yaml": (
        "tests/envs/test_swe_example.py::test_the_swe_example_builds_validates_and_trains_with_graded_episodes",
        "tests/test_examples.py::test_example_config_loads",
    ),
    "sudo .venv/bin/venusrl train --config examples/harness-agent.yaml": (
        "tests/gateway/test_harness.py::test_venusrl_train_trains_on_the_episodes_of_an_openai_client_harness",
    ),
    "sudo .venv/bin/venusrl eval RUN_DIR --k 4": (
        "tests/runtime/test_cpu_example.py::test_the_cpu_example_trains_from_a_task_file_into_tensorboard_and_wandb_and_evaluates",
    ),
    "sudo .venv/bin/venusrl train --run-dir runs/t1 run.steps=50 rollout.group_size=16": (
        "tests/runtime/test_cpu_example.py::test_the_cpu_example_trains_from_a_task_file_into_tensorboard_and_wandb_and_evaluates",
    ),
    "sudo .venv/bin/venusrl train --run-dir runs/t1 --resume": (
        "tests/runtime/test_train.py::test_kill_9_mid_run_then_resume_completes_with_every_step_once",
    ),
    ".venv/bin/venusrl show runs/t1 --step 12 --limit 8": (
        "tests/runtime/test_loggers.py::test_show_prints_each_turn_of_a_real_trajectory_with_its_tool_calls_and_observations",
    ),
    "sudo .venv/bin/venusrl eval runs/t1/checkpoints/step-000049"
    " --episodes 128 --k 8 --samples 16": (
        "tests/runtime/test_evaluate.py::test_eval_prints_pass_at_k_and_writes_transcripts_holding_the_tool_calls",
    ),
    "sudo .venv/bin/venusrl train rollout.env=examples/custom_env/arithmetic.py:Arithmetic"
    " rollout.max_context=1536 rollout.max_tokens_per_turn=48": (
        "tests/runtime/test_train.py::test_a_run_trains_on_an_environment_of_the_users_own_named_by_its_file",
    ),
    ".venv/bin/venusrl model init runs/tiny --preset tiny": (
        "tests/model/test_directory.py::test_model_init_writes_a_directory_transformers_can_load",
    ),
    ".venv/bin/venusrl serve --model runs/tiny --port 8000 engine.page_size=16 engine.threads=2": (
        "tests/server/test_server.py::test_openai_client_greedy_completion_matches_transformers",
    ),
    ".venv/bin/venusrl sim --scenario search-short --policies sync,async,venus --steps 3": (
        "tests/sim/test_cli.py::test_sim_prints_one_json_object_with_speedups_per_policy",
    ),
    "sudo .venv/bin/venusrl train reward.kind=remote"
    " reward.service.url=http://127.0.0.1:8080/score": (
        "tests/runtime/test_train.py::test_venusrl_train_scores_its_episodes_with_a_remote_reward_service",
    ),
    "sudo .venv/bin/venusrl train --runtime ray runtime.engines=2": (
        "tests/runtime/test_ray_runtime.py::test_two_workers_keep_each_trajectory_on_one_engine_and_each_group_on_one_node",
    ),
    "sudo .venv/bin/venusrl train --config examples/train-against-vllm.yaml"
    " --model runs/vllm-model": (
        "tests/runtime/test_vllm_backend.py::test_training_against_vllm_records_the_version_that_sampled_every_token",
        "tests/test_examples.py::test_example_config_loads",
    ),
}


def readme_commands() -> list[str]:
    """The commands of the README's ```bash blocks: comments dropped, continued lines joined."""
    commands: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s+# ", line.strip())[0]
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


def test_the_readme_reads_in_five_minutes() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the depth to a page of docs/"


def test_the_readme_starts_with_the_train_and_test_commands() -> None:
    assert readme_commands()[:2] == ["scripts/train.sh", "scripts/test.sh"]


def test_every_command_in_the_readme_is_run_by_a_test_or_the_ci_script() -> None:
    shown = set(readme_commands())
    unlisted = sorted(shown - set(RUN_BY))
    assert not unlisted, (
        f"README commands no test runs (add a test and a row to RUN_BY): {unlisted}"
    )
    stale = sorted(set(RUN_BY) - shown)
    assert not stale, f"RUN_BY rows for commands the README no longer shows: {stale}"


def test_the_tests_that_run_the_readmes_commands_exist() -> None:
    ci = (ROOT / ".ci/run").read_text()
    for command, runners in RUN_BY.items():
        for runner in runners:
            if runner == ".ci/run":
                assert command in ci, f"{command!r}: .ci/run does not run it"
                continue
            path, _, name = runner.partition("::")
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            assert re.search(rf"^def {name}\(", source, re.M), f"{command!r}: no test {runner}"


def venusrl_argv(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index(next(w for w in words if w.endswith("venusrl"))) + 1 :]


@pytest.mark.parametrize(
    "command", [c for c in readme_commands() if "bin/venusrl " in c], ids=lambda c: c[:60]
)
def test_each_venusrl_command_in_the_readme_parses_and_its_config_loads(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cheap form of each command: its flags are the CLI's, and its config file and
    overrides make a valid config (run from the repository's root, as the README runs them)."""
    monkeypatch.chdir(ROOT)
    args, rest = cli._parser().parse_known_args(venusrl_argv(command))
    assert all("=" in a and a[0] != "-" for a in rest), f"{command!r}: unknown arguments {rest}"
    overrides = [*getattr(args, "overrides", []), *rest]
    if args.command in ("train", "serve", "eval") and not getattr(args, "resume", False):
        flags = {"runtime.kind": getattr(args, "runtime", None)}
        values = {k: v for k, v in flags.items() if v is not None}
        load_config(args.config, overrides, values)  # raises ConfigError naming the key


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_pages_resolves(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} does not exist"
        if fragment and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert fragment in {anchor(h) for h in headings}, f"{page.name}: no heading #{fragment}"


def test_the_configuration_reference_is_what_the_config_models_give() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
