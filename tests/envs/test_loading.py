"""`rollout.env` names a built-in environment or the user's own class, by module or by file;
anything else is refused before a run starts, saying what is wrong."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from venusrl.config import ConfigError, load_config
from venusrl.envs.builtin import GuessNumber
from venusrl.envs.environment import Environment
from venusrl.envs.loading import environment_class

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_env" / "arithmetic.py"

# A user's environment in a file outside any package, importing a module beside it.
MY_ENV = """
from venusrl.envs.builtin.guess_number import GuessNumber
from {helpers} import NAME

class MyGuess(GuessNumber):
    name = NAME
    instructions = "Guess well."
"""


@pytest.fixture(autouse=True)
def _sys_path_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a file puts its directory on sys.path, for the rest of the process."""
    monkeypatch.setattr(sys, "path", [*sys.path])


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_builtin_name_and_a_module_reference_name_the_same_class() -> None:
    assert environment_class("guess_number") is GuessNumber
    assert environment_class("venusrl.envs.builtin.guess_number:GuessNumber") is GuessNumber


def test_a_class_in_a_file_loads_once_and_may_import_the_modules_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "helpers_a.py", "NAME = 'my_guess'\n")
    write(tmp_path, "my_env.py", MY_ENV.format(helpers="helpers_a"))
    monkeypatch.chdir(tmp_path)  # a relative path is read from the current directory
    env = environment_class("my_env.py:MyGuess")
    assert issubclass(env, GuessNumber) and env.name == "my_guess"
    assert environment_class(f"{tmp_path}/my_env.py:MyGuess") is env


def test_the_example_environment_loads_by_its_file() -> None:
    env = environment_class(f"{EXAMPLE}:Arithmetic")
    assert issubclass(env, Environment) and env.name == "arithmetic"


@pytest.mark.parametrize(
    ("source", "reference", "words"),
    [
        (None, "guess_numbers", r"neither a built-in environment \(agent_workload, guess_number"),
        (None, "guess_number:", "neither a built-in environment"),
        (None, "missing.py:Env", r"is not a file \(a relative path is read from"),
        (None, "no_such_package.envs:Env", "cannot import no_such_package.envs"),
        ("raise RuntimeError('boom')", "bad.py:Env", "loading .*bad.py failed: RuntimeError: boom"),
        ("x = 1", "bad.py:Env", "has no attribute 'Env'"),
        ("import sys\nsys.exit(3)", "bad.py:Env", "loading .*bad.py failed: SystemExit: 3"),
        ("Env = 42", "bad.py:Env", "is 42, not a subclass of venusrl Environment"),
        (
            "from venusrl.envs.environment import Environment\nclass Env(Environment): pass",
            "bad.py:Env",
            "leaves abstract methods unimplemented: reward, tasks",
        ),
        (
            "from venusrl.envs.builtin import GuessNumber\nclass Env(GuessNumber): pass",
            "bad.py:Env",
            "`name` 'guess_number' is a built-in environment's",
        ),
        (
            "from venusrl.envs.builtin import GuessNumber\n"
            "class Env(GuessNumber):\n    name = 'g'\n    template = None\n    tools = ['x']",
            "bad.py:Env",
            "`template` must be .*TemplateSpec; `tools` must be a tuple",
        ),
        (
            "from venusrl.envs.builtin import GuessNumber\n"
            "class Env(GuessNumber):\n    name = 'g'\n"
            "    tools = GuessNumber.tools * 2\n"
            "    def reward(self): return 1.0\n"
            "    def tasks(self, seed): return GuessNumber.tasks(seed)",
            "bad.py:Env",
            "two `tools` have one name.*`reward` must be an async method.*`tasks` must be a"
            " classmethod",
        ),
        (
            "from venusrl.envs.builtin.math_python import MathPython\n"
            "class Env(MathPython):\n    name = 'm'\n    optional_fields = 'program'\n"
            "    def reference_problem(self, reference): return None",
            "bad.py:Env",
            "`optional_fields` must be a tuple.*`reference_problem` must be a classmethod",
        ),
    ],
)
def test_a_bad_reference_is_refused_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str | None, reference: str, words: str
) -> None:
    if source is not None:
        write(tmp_path, "bad.py", source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=words):
        environment_class(reference)
    with pytest.raises(ConfigError, match=r"rollout\.env: "):
        load_config(None, [f"rollout.env={reference}"])


def test_the_config_keeps_a_file_reference_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "helpers_b.py", "NAME = 'my_guess_b'\n")
    write(tmp_path, "my_env.py", MY_ENV.format(helpers="helpers_b"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["rollout.env=my_env.py:MyGuess"])
    assert environment_class(cfg.rollout.env).name == "my_guess_b"
    assert cfg.rollout.env == f"{tmp_path}/my_env.py:MyGuess"  # a resume from elsewhere finds it


def test_a_mix_of_two_environments_with_one_template_name_is_refused(tmp_path: Path) -> None:
    source = """
        from dataclasses import replace
        from venusrl.envs.builtin import GuessNumber

        class Other(GuessNumber):
            name = "other"
            template = replace(GuessNumber.template, setup="secret = 1")
    """
    path = write(tmp_path, "other.py", source)
    mix = f"rollout.mix=[{{env: guess_number}}, {{env: '{path}:Other'}}]"
    with pytest.raises(ConfigError, match="different templates named 'guess-number'"):
        load_config(None, [mix])


def test_an_environment_file_in_a_config_file_is_read_from_the_config_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    write(conf, "helpers_c.py", "NAME = 'my_guess_c'\n")
    write(conf, "my_env.py", MY_ENV.format(helpers="helpers_c"))
    config = write(conf, "run.yaml", "rollout:\n  mix:\n    - env: my_env.py:MyGuess\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: the path is the config file's
    cfg = load_config(config)
    assert cfg.rollout.mix[0].env == f"{tmp_path}/conf/my_env.py:MyGuess"
    # On the command line the current directory's, as a shell user expects.
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(None, ["rollout.env=my_env.py:MyGuess"])
