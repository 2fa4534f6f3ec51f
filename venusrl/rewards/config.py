"""The reward section (`reward.*`): where finished trajectories are scored, and by what."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from venusrl.sections import Section


class ServiceConfig(Section):
    """An HTTP service that scores (`reward.kind=remote`) or judges (`reward.kind=judge`)."""

    url: str | None = Field(
        None,
        description="remote: the endpoint trajectories are POSTed to (docs/rewards.md);"
        " judge: the OpenAI-compatible server's base URL (`venusrl serve`, vLLM), /v1 included",
    )
    max_in_flight: int = Field(16, ge=1, description="requests under way at once, at most")
    request_timeout_s: float = Field(60.0, gt=0, description="the longest one request may take")
    retries: int = Field(
        3,
        ge=0,
        description="a request that failed (no answer, a 5xx or 429, a malformed answer) is sent"
        " again this many times, with exponential backoff",
    )
    backoff_s: float = Field(0.5, gt=0, description="the first retry's wait; each next doubles")
    breaker_failures: int = Field(
        5,
        ge=1,
        description="failed requests in a row that open the circuit: no request goes out until"
        " breaker_cooldown_s has passed, then one probe decides",
    )
    breaker_cooldown_s: float = Field(10.0, gt=0, description="how long an open circuit waits")
    api_key_env: str | None = Field(
        None,
        description="an environment variable holding a bearer token sent with every request",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"https?://[^/\s]+", url):
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        return None if url is None else url.rstrip("/")


class JudgeConfig(Section):
    """A judge model that reads the episode and writes a score (`reward.kind=judge`)."""

    model: str = Field(
        "judge", description="the model name sent in each request, as the server knows it"
    )
    prompt_file: str | None = Field(
        None,
        description="the judge's prompt: a text file with {prompt}, {response}, {output} and"
        " {reference} in it (examples/judge-rubric.txt); None: a built-in rubric",
    )
    score_pattern: str = Field(
        r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)",
        description="a regular expression whose first group is the score in the judge's answer;"
        " its last match counts",
    )
    max_score: float = Field(10.0, gt=0, description="the reward is the score over this, in [0, 1]")
    max_tokens: int = Field(256, ge=1, description="the longest answer the judge may write")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature")

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
        if compiled.groups < 1:
            raise ValueError(f"{pattern!r} has no group: the first group is the score")
        return pattern

    @field_validator("prompt_file")
    @classmethod
    def _readable(cls, path: str | None) -> str | None:
        if path is None:
            return None
        absolute = Path(path).expanduser().resolve()
        if not absolute.is_file():
            raise ValueError(f"{path}: no such file (a relative path is read from {Path.cwd()})")
        return str(absolute)


class RewardConfig(Section):
    """Reward workers (`venusrl train`): a pool of their own, off the rollout's path."""

    placement: Literal["pool", "inline"] = Field(
        "pool",
        description="pool: a trajectory whose turns are over gives its engine and KV places up"
        " at once and waits for a reward worker, graded in the ranking's order; inline: it is"
        " scored in its episode, holding them (what RL frameworks do; the benchmark's baseline)",
    )
    kind: Literal["environment", "remote", "judge"] = Field(
        "environment",
        description="environment: its own `reward` (the swe environment's tests in a fresh"
        " sandbox); remote: an HTTP reward service (reward.service.url); judge: a judge model"
        " served at reward.service.url",
    )
    workers: int = Field(
        4,
        ge=1,
        description="rewards scored at once, at most (reward.placement=pool); a grader's fresh"
        " sandbox is one of them, so grading never takes more sandboxes than this",
    )
    retries: int = Field(
        1,
        ge=0,
        description="a reward that failed for the platform (timed out, a service that erred or"
        " answered no reward) is scored again this many times; past that its trajectory is"
        " replaced or masked, never scored 0",
    )
    ray_resource: str | None = Field(
        None,
        min_length=1,
        description="on Ray (runtime.kind=ray): a custom resource the nodes for the reward"
        " worker declare (`ray start --resources='{\"reward\": 1}'`, CPU-only nodes); it is"
        " placed on one of them, apart from the rollout workers (None: wherever Ray places it)",
    )
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)

    @model_validator(mode="after")
    def _service_for_its_kind(self) -> RewardConfig:
        if self.kind in ("remote", "judge") and self.service.url is None:
            raise ValueError(
                f"reward.kind={self.kind} needs reward.service.url"
                f" ({'the reward service' if self.kind == 'remote' else 'the judge server'})"
            )
        return self
