"""The training run's config sections: the run itself (`run.*`), fault injection (`faults.*`)
and where the roles run (`runtime.*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from venusrl.model.presets import PRESETS
from venusrl.sections import Section

LoggerName = Literal["jsonl", "tensorboard", "wandb"]


def _record_only() -> list[LoggerName]:
    return ["jsonl"]


class RunConfig(Section):
    """The training run itself: its length, seed, checkpoints, warm start and loggers."""

    steps: int = Field(150, ge=1, description="trainer steps")
    seed: int = Field(
        0,
        ge=0,
        description="seed of the run's task stream, its warm start (tasks, demonstrators,"
        " imitation order), the initial model's weights, torch and fault injection",
    )
    preset: str = Field("micro", description="model preset when `model` is not given")
    checkpoint_every: int = Field(25, ge=1, description="trainer steps between checkpoints")
    checkpoint_every_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="seconds of training between checkpoints, whichever of this and"
        " run.checkpoint_every comes first (None: by steps only)",
    )
    warm_start_episodes: int = Field(
        256, ge=0, description="scripted demonstrations imitated before RL (0 = no warm start)"
    )
    warm_start_epochs: int = Field(
        15, ge=1, description="passes of imitation over the demonstrations"
    )
    warm_start_batch: int = Field(8, ge=1, description="demonstrations per imitation step")
    warm_start_lr: float = Field(2e-3, gt=0, description="learning rate of the imitation steps")
    engine_url: str | None = Field(
        None,
        description="train against the engine served at this URL instead of in-process:"
        " `venusrl serve`, or a vLLM or SGLang server (rollout.backend); several URLs,"
        " comma-separated, are engines the run's turns are placed among",
    )
    loggers: list[LoggerName] = Field(
        default_factory=_record_only,
        description=(
            "where each step's metrics go: jsonl (metrics.jsonl, always), tensorboard"
            " (RUN/tensorboard/), wandb (RUN/wandb/)"
        ),
    )
    wandb_project: str = Field("venusrl", min_length=1, description="W&B project")
    wandb_name: str | None = Field(None, description="W&B run name (default: the run directory's)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: WANDB_MODE, else online); offline: `wandb sync` later"
    )

    @field_validator("loggers")
    @classmethod
    def _keeps_the_record(cls, loggers: list[str]) -> list[str]:
        if "jsonl" not in loggers:
            raise ValueError(
                "must keep jsonl: metrics.jsonl is the run's record, which --resume, plots and"
                f" `venusrl show` read (e.g. run.loggers=[jsonl,{','.join(loggers) or 'wandb'}])"
            )
        if len(set(loggers)) != len(loggers):
            raise ValueError(f"names a logger twice: {loggers}")
        return loggers

    @field_validator("engine_url")
    @classmethod
    def _urls(cls, url: str | None) -> str | None:
        if url is None:
            return None
        urls = [u.strip() for u in url.split(",")]
        for u in urls:
            if not u.startswith(("http://", "https://")) or u in ("http://", "https://"):
                raise ValueError(f"{u!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"names an engine twice: {url}")
        return ",".join(urls)

    @property
    def engine_urls(self) -> list[str]:
        """The served engines' URLs ([] for the in-process engine)."""
        return self.engine_url.split(",") if self.engine_url else []

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        return preset


class FaultsConfig(Section):
    """Fault injection, to show the run survives the platform failing under it."""

    kill_sandboxes: float = Field(0.0, ge=0, le=1, description="fraction of sandboxes killed")
    preempt_sandboxes: float = Field(
        0.0, ge=0, le=1, description="fraction of sandboxes preempted by their pool"
    )
    fault_within_s: float = Field(
        1.0, gt=0, description="a sandbox killed or preempted goes at a uniform time within this"
    )
    engine_errors: float = Field(0.0, ge=0, le=1, description="fraction of engine calls failed")


class RuntimeConfig(Section):
    """Where the roles run: all in this process, or as actors of a Ray cluster."""

    kind: Literal["local", "ray"] = Field(
        "local",
        description="local: every role in this process; ray: the rollout workers (and trainer"
        " ranks) as Ray actors, the coordinator in the driver",
    )
    address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:10001'); None starts one here"
    )
    namespace: str = Field("venusrl", min_length=1, description="Ray namespace of the actors")
    engines: int = Field(
        1, ge=1, description="rollout engines (one rollout worker actor each, with its sandboxes)"
    )
    engine_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each engine")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each engine")
    trainer_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs Ray reserves for each trainer rank (trainer.world_size > 1; with"
        " trainer.device=cuda each also gets one GPU)",
    )
    actor_restarts: int = Field(3, ge=0, description="times Ray restarts a worker that died")
