"""The coordinator's config section (`rollout.*`): groups, batches and the agent loop."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from venusrl.envs.loading import canonical_reference, environment_class
from venusrl.envs.task_file import SUFFIXES, check_fields
from venusrl.envs.types import TemplateSpec
from venusrl.model.tool_formats import tool_parser_setting
from venusrl.policy.staleness import StalenessBound
from venusrl.sections import Section


def _environment(reference: str) -> str:
    """A built-in environment's name or a reference to the user's own class
    (`venusrl.envs.loading`); the class is loaded here, so that a wrong one stops the run
    before anything starts."""
    environment_class(reference)
    return canonical_reference(reference)


EnvName = Annotated[str, AfterValidator(_environment)]


def _task_file(path: str | None) -> str | None:
    """A task file's path, made absolute (a run resumed from elsewhere reads the same file);
    its rows are read, and their errors named, when the run starts (`runtime.roles`)."""
    if path is None:
        return None
    absolute = Path(path).expanduser().resolve()
    if absolute.suffix not in SUFFIXES:
        raise ValueError(f"{path}: a task file is {' or '.join(SUFFIXES)}")
    if not absolute.is_file():
        raise ValueError(f"{path}: no such file (a relative path is read from {Path.cwd()})")
    return str(absolute)


TaskFile = Annotated[str | None, AfterValidator(_task_file)]
TASKS_DESCRIPTION = (
    "a .jsonl or .parquet file of tasks, played in epochs in a seeded order, for an environment"
    " that declares `reference_fields` (math_python: prompt, answer; treasure_hunt: prompt, trail);"
    " None: its own tasks(seed)"
)
FIELDS_DESCRIPTION = "the task's fields read from other columns of the file: {prompt: question}"


def _check_task_source(env: str, tasks: str | None, fields: dict[str, str]) -> None:
    if fields and tasks is None:
        raise ValueError("task_fields maps the columns of a task file: give `tasks` too")
    if tasks is not None:
        try:
            check_fields(environment_class(env), fields)
        except ValueError as e:
            takes_files = environment_class(env).reference_fields is not None
            raise ValueError(f"{'task_fields' if takes_files else 'tasks'}: {e}") from None


class MixEntry(Section):
    """One environment of a mixed run (`rollout.mix`)."""

    env: EnvName = Field(description="as rollout.env: a built-in name or 'module:Class'")
    weight: float = Field(1.0, gt=0, description="share of the groups, relative to the others")
    group_size: int | None = Field(None, ge=2, description="K; default rollout.group_size")
    max_turns: int | None = Field(None, ge=1, description="turn cap; default the environment's")
    tasks: TaskFile = Field(None, description=TASKS_DESCRIPTION)
    task_fields: dict[str, str] = Field(default_factory=dict, description=FIELDS_DESCRIPTION)

    @model_validator(mode="after")
    def _task_source(self) -> MixEntry:
        _check_task_source(self.env, self.tasks, self.task_fields)
        return self


class RolloutConfig(Section):
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
    # Where tasks come from (issue 33); `rollout.mix` entries take the same two keys.
    tasks: TaskFile = Field(None, description=TASKS_DESCRIPTION + "; with `env`, not `mix`")
    task_fields: dict[str, str] = Field(default_factory=dict, description=FIELDS_DESCRIPTION)
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
    release_overtaken: bool = Field(
        False,
        description="a group still running after one started later was trained stops counting"
        " against max_staleness, so its replacement starts at once rather than at the next"
        " publish; it is still trained within max_train_staleness (policy.staleness)",
    )
    dynamic_sampling: Literal["off", "raw", "shaped"] = Field(
        "off",
        description="DAPO's dynamic sampling: a group whose rewards all agree teaches GRPO"
        " nothing and is dropped, another opening in its place; raw: the environment's rewards"
        " (accuracy), shaped: as the loss sees them (trainer.overlong_*, mask_truncated)",
    )
    max_uniform_in_a_row: int = Field(
        256,
        ge=1,
        description="under dynamic_sampling the run stops once this many groups in a row had"
        " rewards that all agreed: the tasks are too hard or too easy for the policy, and no"
        " batch would ever fill",
    )
    max_infra_retries: int = Field(2, ge=0, description="replacement members per group")
    priorities: Literal["critical", "fifo"] = Field(
        "critical",
        description="how open groups are ranked: critical (those that unlock the next batch"
        " first, policy.critical_groups) or fifo (arrival order, all equal)",
    )
    tool_parser: Annotated[str, AfterValidator(tool_parser_setting)] = Field(
        "auto",
        description="how the model writes tool calls: hermes (Qwen2.5/Qwen3 <tool_call> JSON),"
        " qwen3_coder (Qwen3-Coder XML), llama3_json (Llama 3.1/3.2), or auto: the one the"
        " model's chat template shows, hermes when it shows none",
    )
    temperature: float = Field(1.0, ge=0, description="sampling temperature of every turn")
    max_tokens_per_turn: int = Field(24, ge=1, description="the longest action the model writes")
    max_context: int = Field(
        1024, ge=16, description="tokens of a trajectory's record; past it the episode ends"
    )
    episode_timeout_s: float | None = Field(
        None,
        gt=0,
        description="wall-clock limit of one episode: no turn starts past it, a generation"
        " running at it is cut, and the episode ends (finish time_cap), scored by the environment"
        " as it stands; a tool call under way finishes first (within step_timeout_s)",
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        description="the most tokens the model may write in one episode, all turns together:"
        " there the episode ends (finish token_cap), scored by the environment",
    )
    group_timeout_s: float = Field(
        900.0, gt=0, description="a group not complete this long after it opened is dropped"
    )
    batch_timeout_s: float = Field(
        1800.0, gt=0, description="the trainer's longest wait for its next batch"
    )
    max_dropped_in_a_row: int = Field(
        64,
        ge=1,
        description="the run stops once this many groups in a row are dropped with none"
        " completing between them: every episode fails (an environment's bug, a task setup that"
        " raises), and waiting out batch_timeout_s would only hide it",
    )
    step_timeout_s: float = Field(
        300.0,
        gt=0,
        description="the longest one environment step may take (its tool calls bound"
        " themselves; this catches a tool that ignores its timeout): past it the episode ends as"
        " an infrastructure failure",
    )
    reward_timeout_s: float = Field(
        120.0,
        gt=0,
        description="the longest one scoring of an episode may take (any reward.kind); past it"
        " the scoring is tried again (reward.retries), then the episode is replaced or masked",
    )
    tool_wait_pin_s: float | None = Field(
        5.0,
        ge=0,
        description="how long the engine keeps a trajectory's KV for it while it waits on a tool"
        " (engine.retention=trajectory); None: no pin",
    )
    admission: Literal["none", "aimd", "critical"] = Field(
        "critical",
        description="critical: a turn runs only while its trajectory holds a place in the"
        " engine's KV window, places going to the most critical groups first"
        " (policy.kv_window; the default with in-process engines, on Ray each rollout worker's"
        " its own; none with run.engine_url); none: every"
        " member of every open group runs at once; aimd: episodes run only while fewer run than"
        " a window that grows while the engine's KV cache is healthy and halves when it thrashes"
        " (policy.agent_admission; in-process engine only)",
    )
    admission_period_s: float = Field(
        5.0, gt=0, description="control period of rollout.admission=aimd (about one turn)"
    )
    admission_initial_window: int = Field(
        8, ge=1, le=4096, description="episodes rollout.admission=aimd lets run at first"
    )
    # Which engine the agent loops generate with.
    backend: Literal["venus", "vllm", "sglang"] = Field(
        "venus",
        description="venus: our engine, in-process or `venusrl serve` at run.engine_url (the only"
        " one that keeps a trajectory's KV across its tool calls); vllm or sglang: a running"
        " server of that project at run.engine_url (docs/backends.md: what each gives up)",
    )

    @model_validator(mode="after")
    def _staleness_bound(self) -> RolloutConfig:
        self.staleness_bound()
        return self

    @property
    def time_limit_s(self) -> float:
        """How long after a group opens its members may run at most: the episode's limit or the
        group's, whichever is shorter (the ranking runs a group nearing it among the critical)."""
        episode = math.inf if self.episode_timeout_s is None else self.episode_timeout_s
        return min(episode, self.group_timeout_s)

    def staleness_bound(self) -> StalenessBound:
        return StalenessBound(
            self.batch_groups,
            self.max_staleness,
            self.max_train_staleness,
            self.release_overtaken,
        )

    @model_validator(mode="after")
    def _task_source(self) -> RolloutConfig:
        if self.mix and (self.tasks or self.task_fields):
            raise ValueError(
                "rollout.tasks goes with rollout.env: in a mix, give each entry its own `tasks`"
            )
        _check_task_source(self.env, self.tasks, self.task_fields)
        return self

    @field_validator("mix")
    @classmethod
    def _distinct_envs(cls, mix: list[MixEntry]) -> list[MixEntry]:
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
