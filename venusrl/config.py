"""One typed config tree: YAML files plus dotted command-line overrides.

    cfg = load_config("run.yaml", ["engine.page_size=32", "server.port=9000"])

Unknown keys and invalid values raise `ConfigError` naming the dotted key and the reason
(DESIGN.md contract 5). Every section forbids extra keys, so a typo never silently falls back
to a default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _torch_device(value: str) -> str:
    """A device string torch can parse ("cpu", "cuda", "cuda:1"); whether the device exists is
    known only where the run starts."""
    import torch  # only when a device is checked

    try:
        torch.device(value)
    except RuntimeError:
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N, ...)") from None
    return value


class EngineConfig(_Section):
    """The rollout engine: paged KV cache, radix prefix cache, continuous batching."""

    device: str = Field("cpu", description="torch device of the model and the device KV tier")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="model and KV dtype; fp32 on CPU (bf16 decode is ~2x slower there)"
    )
    page_size: int = Field(
        8, ge=1, le=1024, description="tokens per KV page (only whole pages are shared)"
    )
    device_kv_pages: int = Field(
        4096, ge=2, description="pages in the device tier (page 0 is reserved as padding)"
    )
    host_kv_pages: int = Field(
        0, ge=0, description="pages in the host tier, where evicted KV is offloaded"
    )
    retention: Literal["lru", "trajectory"] = Field(
        "trajectory",
        description="which idle KV leaves the device first and whether it is offloaded or"
        " dropped (policy.kv_retention): lru drops the least recently used; trajectory keeps"
        " the KV of trajectories waiting on a tool and offloads it rather than drop it",
    )
    layer_residency: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="pressure (KV pages high-priority requests need / device pages) at which"
        " their completed pages keep only a band of their layers on device (half, a quarter"
        " further up, ...) and read the rest from the host tier layer by layer"
        " (policy.layer_residency; needs host_kv_pages); None: off",
    )
    max_running: int = Field(256, ge=1, description="most requests decoded in one batch")
    token_budget: int = Field(
        2048, ge=1, description="most tokens (decode + prefill chunks) in one forward pass"
    )
    max_context: int | None = Field(
        None, ge=1, description="context limit; defaults to the model's max_position_embeddings"
    )
    prefix_cache: bool = Field(True, description="reuse KV of shared prefixes (radix tree)")
    salt_cache_by_version: bool = Field(
        True,
        description="key cached KV by the weight version its trajectory started under: a new"
        " trajectory never reads KV that older weights computed, one in flight keeps its own",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None leaves torch's")
    seed: int = Field(0, ge=0, description="seed of requests that give none")

    _device = field_validator("device")(_torch_device)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(
        None,
        min_length=1,  # an empty key (an unset variable) must not silently turn auth off
        description="if set, requests need 'Authorization: Bearer'",
    )
    model_name: str | None = Field(None, description="name served at /v1/models; default: dir name")


def _environment(reference: str) -> str:
    """A built-in environment's name or a reference to the user's own class
    (`venusrl.envs.loading`); the class is loaded here, so that a wrong one stops the run
    before anything starts."""
    from venusrl.envs.loading import canonical_reference, environment_class

    environment_class(reference)
    return canonical_reference(reference)


EnvName = Annotated[str, AfterValidator(_environment)]


class MixEntry(_Section):
    """One environment of a mixed run (`rollout.mix`)."""

    env: EnvName
    weight: float = Field(1.0, gt=0, description="share of the groups, relative to the others")
    group_size: int | None = Field(None, ge=2, description="K; default rollout.group_size")
    max_turns: int | None = Field(None, ge=1, description="turn cap; default the environment's")


class RolloutConfig(_Section):
    """Groups, batches and the agent loop (`venusrl train`)."""

    env: EnvName = Field(
        "treasure_hunt",
        description="the environment when `mix` is empty: a built-in name (agent_workload is a"
        " scheduler benchmark), 'package.module:Class' or 'path/to/file.py:Class'",
    )
    mix: list[MixEntry] = Field(
        default_factory=list,
        description="several environments in one run, each group drawing one by weight",
    )
    group_size: int = Field(8, ge=2, description="K trajectories per task (GRPO group)")
    batch_groups: int = Field(4, ge=1, description="B complete groups per trainer step")
    max_staleness: int = Field(1, ge=0, description="0 = synchronous on-policy")
    max_train_staleness: int | None = Field(
        None,
        ge=0,
        description="how many versions after it started a group may still be trained; default"
        " max_staleness. Larger lets batches take later groups in a straggler's place"
        " (policy.staleness)",
    )
    max_infra_retries: int = Field(2, ge=0, description="replacement members per group")
    priorities: Literal["critical", "fifo"] = "critical"
    temperature: float = Field(1.0, ge=0)
    max_tokens_per_turn: int = Field(24, ge=1)
    max_context: int = Field(1024, ge=16)
    group_timeout_s: float = Field(900.0, gt=0)
    step_timeout_s: float = Field(
        300.0,
        gt=0,
        description="the longest one environment step (the tool calls of a model turn) may take;"
        " past it the episode ends as an infrastructure failure. A tool that overruns its"
        " environment's tool_timeout_s is reported at once",
    )
    tool_wait_pin_s: float = Field(
        5.0,
        ge=0,
        description="how long the engine keeps a trajectory's KV for it while it waits on a tool"
        " (engine.retention=trajectory)",
    )
    admission: Literal["none", "aimd"] = Field(
        "none",
        description="none: every member of every open group runs at once; aimd: episodes run"
        " only while fewer run than a window that grows while the engine's KV cache is healthy"
        " and halves when it thrashes (policy.agent_admission; local engine only)",
    )
    admission_period_s: float = Field(
        5.0, gt=0, description="control period of rollout.admission=aimd (about one turn)"
    )
    admission_initial_window: int = Field(
        8, ge=1, le=4096, description="episodes rollout.admission=aimd lets run at first"
    )

    @model_validator(mode="after")
    def _train_staleness_covers_start(self) -> RolloutConfig:
        lag = self.max_train_staleness
        if lag is not None and lag < self.max_staleness:
            raise ValueError(
                f"max_train_staleness ({lag}) must be >= max_staleness ({self.max_staleness}):"
                " a group may start that many versions ahead, so it is at least that stale"
                " when trained"
            )
        return self

    @field_validator("mix")
    @classmethod
    def _distinct_envs(cls, mix: list[MixEntry]) -> list[MixEntry]:
        from venusrl.envs.loading import environment_class
        from venusrl.envs.types import TemplateSpec

        envs = [environment_class(entry.env) for entry in mix]
        names = [env.name for env in envs]
        if len(set(names)) != len(names):
            raise ValueError(f"each environment may appear once in the mix, got {names}")
        templates: dict[str, TemplateSpec] = {}
        for env in envs:  # the pool keeps one template per name
            if templates.setdefault(env.template.name, env.template) != env.template:
                raise ValueError(
                    f"two environments of the mix have different templates named"
                    f" {env.template.name!r}: give each its own name"
                )
        return mix


class TrainerSection(_Section):
    device: str = Field(
        "cpu", description="torch device of the trained model (fp32 weights and AdamW state)"
    )
    lr: float = Field(5e-4, gt=0)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(
        0.1,
        ge=0,
        description="k3 KL penalty to the policy RL starts from: it keeps the tool-call format"
        " where the start policy had it while the advantages move the decisions (without it the"
        " CPU example's losers, taking the format down with them, make the reward dip early)",
    )
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=2)
    updates_per_batch: int = Field(1, ge=1, description="PPO epochs: gradient steps per batch")
    loss_aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean", description="weigh every model token alike, or every trajectory alike"
    )

    _device = field_validator("device")(_torch_device)


class SandboxSection(_Section):
    memory_budget_gib: float = Field(4.0, gt=0)
    admission: Literal["footprint", "quota"] = "footprint"
    share_pages: bool = True


class RunConfig(_Section):
    steps: int = Field(150, ge=1, description="trainer steps")
    seed: int = Field(0, ge=0)
    preset: str = Field("micro", description="model preset when `model` is not given")
    checkpoint_every: int = Field(25, ge=1, description="trainer steps between checkpoints")
    warm_start_episodes: int = Field(
        256, ge=0, description="scripted demonstrations imitated before RL (0 = no warm start)"
    )
    warm_start_epochs: int = Field(15, ge=1)
    warm_start_batch: int = Field(8, ge=1, description="demonstrations per imitation step")
    warm_start_lr: float = Field(2e-3, gt=0, description="learning rate of the imitation steps")
    engine_url: str | None = Field(
        None, description="train against `venusrl serve` at this URL instead of in-process"
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        from venusrl.engine.model_dir import PRESETS  # torch: only when a preset is checked

        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        return preset


class FaultsSection(_Section):
    """Fault injection, to show the run survives the platform failing under it."""

    kill_sandboxes: float = Field(0.0, ge=0, le=1, description="fraction of sandboxes killed")
    preempt_sandboxes: float = Field(
        0.0, ge=0, le=1, description="fraction of sandboxes preempted by their pool"
    )
    fault_within_s: float = Field(
        1.0, gt=0, description="a sandbox killed or preempted goes at a uniform time within this"
    )
    engine_errors: float = Field(0.0, ge=0, le=1, description="fraction of engine calls failed")


class RuntimeSection(_Section):
    """Where the roles run: all in this process, or as actors of a Ray cluster."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:10001'); None starts one here"
    )
    namespace: str = Field("venusrl", min_length=1, description="Ray namespace of the actors")
    engines: int = Field(
        1, ge=1, description="rollout engines (one rollout worker actor each, with its sandboxes)"
    )
    engine_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each engine")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each engine")
    actor_restarts: int = Field(3, ge=0, description="times Ray restarts a worker that died")


class Config(_Section):
    model: str | None = Field(None, description="Hugging Face-format model directory")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    faults: FaultsSection = Field(default_factory=FaultsSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)

    @model_validator(mode="after")
    def _runtime_fits(self) -> Config:
        rt = self.runtime
        if rt.kind == "local" and rt.engines > 1:
            raise ValueError("runtime.engines > 1 needs runtime.kind=ray")
        if rt.kind == "ray" and self.run.engine_url:
            raise ValueError(
                "run.engine_url trains against one served engine: use runtime.kind=local"
            )
        if self.rollout.admission != "none" and (rt.kind == "ray" or self.run.engine_url):
            raise ValueError(
                "rollout.admission reads the cache of an in-process engine: use runtime.kind=local"
                " without run.engine_url"
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
    """An environment file named in a YAML file is read from the YAML file's directory, so that
    a config and the environment beside it move together (on the command line: the current
    directory)."""
    from venusrl.envs.loading import canonical_reference

    rollout = data.get("rollout")
    if not isinstance(rollout, dict):
        return
    entries = [rollout, *(e for e in rollout.get("mix") or [] if isinstance(e, dict))]
    for entry in entries:
        if isinstance(entry.get("env"), str):
            entry["env"] = canonical_reference(entry["env"], directory)


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
