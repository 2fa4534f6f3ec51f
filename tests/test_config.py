"""The typed config tree: YAML plus dotted overrides, with errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from venusrl.config import ConfigError, load_config
from venusrl.envs.builtin.math_python import TASKS


def test_yaml_and_dotted_overrides_compose(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: /models/x\nengine:\n  page_size: 32\n  token_budget: 1024\n")
    cfg = load_config(
        path, ["engine.token_budget=4096", "server.port=9000", "engine.dtype=bfloat16"]
    )
    assert cfg.model == "/models/x"
    assert cfg.engine.page_size == 32 and cfg.engine.token_budget == 4096
    assert cfg.engine.dtype == "bfloat16" and cfg.server.port == 9000


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["engine.page_sz=3"], "engine.page_sz: unknown key; known keys: attention_backend, cuda"),
        (["engine.page_size=0"], "engine.page_size: Input should be greater than or equal to 1"),
        (["engine.page_size=many"], "engine.page_size"),
        (["engine.dtype=float8"], "engine.dtype"),
        (["rollout.mix=[{env: guess_number}, {env: guess_number}]"], "appear once in the mix"),
        (["rollout.mix=[{env: guess, weight: 0}]"], "rollout.mix.0.weight"),
        (["engine.device=gpu0"], "engine.device: Value error, 'gpu0' is not a torch device"),
        (["trainer.device=cdua"], "trainer.device: Value error, 'cdua' is not a torch device"),
        (["trainr.lr=1e-5"], "trainr: unknown key"),
        (["trainer.lr=-1"], "trainer.lr"),
        (["trainer.updates_per_batch=0"], "trainer.updates_per_batch"),
        (["run.warm_start_lr=0"], "run.warm_start_lr"),
        (["run.checkpoint_every_s=0"], "run.checkpoint_every_s: Input should be greater than 0"),
        (["run.checkpoint_every_s=-60"], "run.checkpoint_every_s: Input should be greater than 0"),
        (["run.checkpoint_every_s=nan"], "run.checkpoint_every_s: Input should be a finite number"),
        (["run.checkpoint_every_s=10min"], "checkpoint_every_s: Input should be a valid number"),
        (["run.preset=huge"], "run.preset: Value error, unknown preset 'huge'; presets: micro"),
        (["engine=3"], "engine"),
        (["engine.page_size.x=1"], "engine.page_size is a value, not a section"),
        (["page_size"], "must look like section.key=value"),
        (["=3"], "must look like section.key=value"),
        (["runtime.kind=slurm"], "runtime.kind"),
        (["runtime.engines=2"], "runtime.engines > 1 needs runtime.kind=ray"),
        (["runtime.kind=ray", "run.engine_url=http://x"], "run.engine_url trains against served"),
        (["run.engine_url=http://a,ftp://b"], "'ftp://b' is not an http"),
        (["run.engine_url=http://a,http://a"], "names an engine twice"),
        (
            ["rollout.backend=vllm", "run.engine_url=http://x", "rollout.admission=critical"],
            "a vllm server does not report",
        ),
        (["rollout.admission=window"], "rollout.admission"),
        (["rollout.admission=aimd", "runtime.kind=ray"], "rollout.admission=aimd runs in one"),
        (["rollout.admission=aimd", "run.engine_url=http://x"], "in-process engine"),
        (["rollout.backend=vllm"], "rollout.backend=vllm generates with a running vllm server"),
        (["rollout.backend=sglang"], "give its URL as run.engine_url"),
        (["rollout.backend=tgi"], "rollout.backend: Input should be 'venus', 'vllm' or 'sglang'"),
        (
            ["rollout.backend=vllm", "run.engine_url=http://x", "runtime.kind=ray"],
            "run.engine_url trains against served",
        ),
        (["rollout.admission_period_s=0"], "rollout.admission_period_s"),
        (["rollout.admission_initial_window=0"], "rollout.admission_initial_window"),
        (["rollout.tasks=tasks.csv"], "rollout.tasks: Value error, tasks.csv: a task file is"),
        (
            ["rollout.tasks=missing.jsonl"],
            "rollout.tasks: Value error, missing.jsonl: no such file",
        ),
        (
            ["rollout.env=guess_number", f"rollout.tasks={TASKS}"],
            "tasks: guess_number makes its tasks in code",
        ),
        (
            ["rollout.env=math_python", f"rollout.tasks={TASKS}", "rollout.task_fields={answr: x}"],
            "task_fields: 'answr' is no field of math_python's tasks; they have id, prompt, answer",
        ),
        (["rollout.env=math_python", "rollout.task_fields={prompt: q}"], "give `tasks` too"),
        (
            ["rollout.mix=[{env: guess_number}]", f"rollout.tasks={TASKS}"],
            "in a mix, give each entry its own `tasks`",
        ),
        (
            [f"rollout.mix=[{{env: guess_number, tasks: {TASKS}}}]"],
            "rollout.mix.0: Value error, tasks: guess_number makes its tasks in code",
        ),
        (
            ["rollout.max_train_staleness=0"],
            "max_train_staleness must be >= max_staleness (1), got 0",
        ),
        (
            ["trainer.overlong_buffer_tokens=64"],
            "trainer.overlong_buffer_tokens needs a length limit: set trainer.overlong_max_tokens",
        ),
        (
            ["trainer.overlong_buffer_tokens=600", "rollout.max_episode_tokens=512"],
            "overlong_buffer_tokens=600 is longer than the length limit it ends at (512 tokens)",
        ),
        (["trainer.overlong_penalty=0"], "trainer.overlong_penalty: Input should be greater"),
        (["trainer.overlong_buffer_tokens=-1"], "trainer.overlong_buffer_tokens: Input should be"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_the_reason(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            overrides if "page_size.x" not in overrides[0] else ["engine.page_size=4", *overrides],
        )
    assert words in str(err.value)


def test_a_task_file_is_read_from_the_config_files_directory_and_stored_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf/train.jsonl").write_text(TASKS.read_text())
    (tmp_path / "conf/run.yaml").write_text(
        "rollout:\n  mix:\n    - {env: math_python, tasks: train.jsonl,"
        " task_fields: {prompt: question}}\n"
    )
    monkeypatch.chdir(tmp_path)
    entry = load_config(tmp_path / "conf/run.yaml").rollout.mix[0]
    assert entry.tasks == str(tmp_path / "conf/train.jsonl")
    assert entry.task_fields == {"prompt": "question"}
    # On the command line a relative path is the current directory's.
    cfg = load_config(None, ["rollout.env=math_python", "rollout.tasks=conf/train.jsonl"])
    assert cfg.rollout.tasks == str(tmp_path / "conf/train.jsonl")


def test_unreadable_or_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_the_kv_window_is_the_default_wherever_the_engines_say_their_device_kv() -> None:
    assert load_config(None, []).rollout.admission == "critical"
    assert load_config(None, ["runtime.kind=ray"]).rollout.admission == "critical"
    assert load_config(None, ["run.engine_url=http://x"]).rollout.admission == "critical"
    served_elsewhere = ["run.engine_url=http://x", "rollout.backend=sglang"]
    assert load_config(None, served_elsewhere).rollout.admission == "none"
    several = load_config(None, ["run.engine_url=http://a:1, http://b:2"]).run
    assert several.engine_urls == ["http://a:1", "http://b:2"]


def test_the_ranking_s_time_limit_is_the_episode_s_or_the_group_s_whichever_is_shorter() -> None:
    assert load_config(None, []).rollout.time_limit_s == 900.0  # the group's, by default
    for group, limit in ((120, 60.0), (30, 30.0)):
        both = ["rollout.episode_timeout_s=60", f"rollout.group_timeout_s={group}"]
        assert load_config(None, both).rollout.time_limit_s == limit


def test_an_empty_api_key_is_refused_rather_than_turning_auth_off() -> None:
    """`--api-key "$KEY"` with KEY unset must not serve without a key."""
    with pytest.raises(ConfigError, match=r"server\.api_key"):
        load_config(None, [], {"server.api_key": ""})


def test_an_unknown_tool_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"server\.tool_parser: .*unknown tool parser 'xml'.*hermes"
    ):
        load_config(None, ["server.tool_parser=xml"])
    assert load_config(None, ["server.tool_parser=hermes"]).server.tool_parser == "hermes"


def test_a_weight_update_mode_for_a_served_engine_is_refused_since_it_loads_its_own_way() -> None:
    with pytest.raises(ConfigError, match=r"engine\.weight_update applies to the run's own"):
        load_config(None, ["run.engine_url=http://127.0.0.1:8000", "engine.weight_update=drain"])
    with pytest.raises(ConfigError, match=r"engine\.weight_update"):
        load_config(None, ["engine.weight_update=pause"])


def test_reading_a_config_loads_no_torch() -> None:
    """`venusrl sim`, `plot`, `--help` and every config error answer without torch's seconds of
    importing."""
    check = "import sys, venusrl.cli, venusrl.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0
