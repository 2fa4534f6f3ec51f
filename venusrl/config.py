"""One typed config tree: YAML files plus dotted command-line overrides.

    cfg = load_config("run.yaml", ["engine.page_size=32", "server.port=9000"])

Each role owns its section (`engine/config.py`, `coordinator/config.py`, `trainer/config.py`,
`envs/config.py`, `runtime/config.py`); this module composes them, with the rules that span
sections. Unknown keys and invalid values raise `ConfigError` naming the dotted key and the
reason (DESIGN.md contract 6).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from venusrl.coordinator.config import RolloutConfig
from venusrl.engine.config import EngineConfig
from venusrl.envs.config import SandboxConfig
from venusrl.envs.loading import canonical_reference
from venusrl.model.hub import model_path
from venusrl.rewards.config import RewardConfig
from venusrl.runtime.config import FaultsConfig, RunConfig, RuntimeConfig
from venusrl.sections import Section
from venusrl.server.config import ServerConfig
from venusrl.trainer.config import TrainerConfig


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names the key."""


class Config(Section):
    model: str | None = Field(
        None,
        description="Hugging Face-format model directory, or a hub id (Qwen/Qwen3-0.6B) in the"
        " local Hugging Face cache",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled as its data and validated again where it lands (a Ray worker): validating
        loads each environment named by a file path, under the module name the driver gave it,
        so that the environment classes the driver sends later unpickle there."""
        return (Config.model_validate, (self.model_dump(),))

    @field_validator("model")
    @classmethod
    def _local_model(cls, model: str | None) -> str | None:
        """A hub id is stored as the snapshot directory it names, so that a resumed run (and
        `venusrl show`) reads the very weights the run started from."""
        return None if model is None else str(model_path(model))

    @model_validator(mode="after")
    def _runtime_fits(self) -> Config:
        rt = self.runtime
        if rt.kind == "local" and rt.engines > 1:
            raise ValueError("runtime.engines > 1 needs runtime.kind=ray")
        if rt.kind == "ray" and self.run.engine_url:
            raise ValueError(
                "run.engine_url trains against served engines from one process: use"
                " runtime.kind=local"
            )
        backend = self.rollout.backend
        if backend != "venus" and not self.run.engine_url:
            raise ValueError(
                f"rollout.backend={backend} generates with a running {backend} server: give its"
                " URL as run.engine_url (e.g. run.engine_url=http://127.0.0.1:8000)"
            )
        if self.run.engine_url and self.engine.weight_update != "keep":
            raise ValueError(
                "engine.weight_update applies to the run's own engines: a served engine"
                " (run.engine_url) loads new weights its own way; leave it at keep"
            )
        t = self.trainer
        if t.overlong_buffer_tokens:
            limit = t.overlong_max_tokens or self.rollout.max_episode_tokens
            if limit is None:
                raise ValueError(
                    "trainer.overlong_buffer_tokens needs a length limit: set"
                    " trainer.overlong_max_tokens or rollout.max_episode_tokens"
                )
            if t.overlong_buffer_tokens > limit:
                raise ValueError(
                    f"trainer.overlong_buffer_tokens={t.overlong_buffer_tokens} is longer than the"
                    f" length limit it ends at ({limit} tokens)"
                )
        if self.run.engine_url:
            if backend != "venus" and "admission" not in self.rollout.model_fields_set:
                self.rollout.admission = "none"  # their servers do not say their device KV
            if self.rollout.admission == "aimd":
                raise ValueError(
                    "rollout.admission=aimd reads the cache of an in-process engine: leave"
                    " run.engine_url unset, or set rollout.admission=critical or none"
                )
            if self.rollout.admission == "critical" and backend != "venus":
                raise ValueError(
                    f"rollout.admission=critical places turns by each engine's device KV, which"
                    f" a {backend} server does not report to its client: set"
                    " rollout.admission=none, or serve with `venusrl serve`"
                )
        if self.rollout.admission == "aimd" and rt.kind == "ray":
            raise ValueError(
                "rollout.admission=aimd runs in one process: on Ray use critical (each rollout"
                " worker's engine its own KV window) or none"
            )
        return self


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    values: Mapping[str, Any] | None = None,
) -> Config:
    """Read a YAML file (optional), apply `a.b.c=value` overrides, then `values` (dotted keys
    whose values are taken as they are, for command-line flags), and validate the whole tree."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping, got {type(loaded).__name__}"
            )
        data = loaded or {}
        _anchor_environment_files(data, Path(path).parent)
    for item in overrides:
        apply_override(data, item)
    for key, value in (values or {}).items():
        _set_dotted(data, key, value, key)
    return validate_config(data)


def _anchor_environment_files(data: dict[str, Any], directory: Path) -> None:
    """An environment file (or a task file) named in a YAML file is read from the YAML file's
    directory, so that a config and the environment beside it move together (on the command
    line: the current directory)."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict):
        return
    entries = [rollout, *(e for e in rollout.get("mix") or [] if isinstance(e, dict))]
    for entry in entries:
        if isinstance(entry.get("env"), str):
            entry["env"] = canonical_reference(entry["env"], directory)
        if isinstance(entry.get("tasks"), str):
            entry["tasks"] = str(directory / Path(entry["tasks"]).expanduser())


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `data[a][b][c]` from `a.b.c=value`; the value is parsed as YAML (`1e-5`, `[1,2]`)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    _set_dotted(data, key, value, item)


def _set_dotted(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"{'.'.join(parts[: i + 1])} is a value, not a section (in {source!r})"
            )
        node = child
    node[parts[-1]] = value


def validate_config(data: Mapping[str, Any]) -> Config:
    try:
        return Config.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(_describe(e, Config)) from None


def _describe(error: ValidationError, root: type[BaseModel]) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            known = _known_keys(root, err["loc"][:-1])
            hint = f"; known keys: {', '.join(known)}" if known else ""
            lines.append(f"{key}: unknown key{hint}")
        elif not err["loc"]:  # a rule across sections: its message names the keys
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _known_keys(root: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return sorted(model.model_fields)
