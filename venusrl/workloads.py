"""Agentic RL workloads: the sourced scenarios of WORKLOADS.md and a YAML format for new ones.

A workload says how a trajectory looks (turns, prompt, action and observation tokens, tool and
sandbox latencies, reward time, success, infrastructure failures) and what it runs on (model,
GPU, tensor parallelism, rollout and training GPUs, P x K). Every draw comes from one seeded
generator, and "prompt-level" values are drawn once per prompt and shared by a group's K members,
so a group's stragglers are correlated the way real tasks make them.

Distributions, in Python and in YAML:

    {lognormal: {median: 220, sigma: 0.6, max: 8192}}   LN(median, log-sd), clamped to [min, max]
    {constant: 450}
    {mixture: [{p: 0.85, lognormal: {...}}, {p: 0.15, constant: 45}]}

A workload file holds the fields of `Workload` by name (any left out keep the `base` scenario's
value, `swe-long` by default): `venusrl sim --workload FILE`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml


class Dist(Protocol):
    def sample(self, rng: random.Random) -> float: ...

    def scaled(self, factor: float) -> Dist:
        """The same shape, every value multiplied by `factor`."""
        ...


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    min: float = 0.0
    max: float = math.inf

    def __post_init__(self) -> None:
        if not (0 < self.median < math.inf and 0 <= self.sigma < math.inf):
            raise ValueError(
                f"lognormal needs a finite median > 0 and sigma >= 0, got {self.median}, "
                f"{self.sigma}"
            )
        if not 0 <= self.min <= self.max:
            raise ValueError(f"lognormal needs 0 <= min <= max, got {self.min}, {self.max}")

    def sample(self, rng: random.Random) -> float:
        return min(
            max(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.min), self.max
        )

    def scaled(self, factor: float) -> LogNormal:
        return LogNormal(self.median * factor, self.sigma, self.min * factor, self.max * factor)


@dataclass(frozen=True)
class Constant:
    value: float

    def __post_init__(self) -> None:
        if not 0 <= self.value < math.inf:
            raise ValueError(f"a constant is a finite number >= 0, got {self.value}")

    def sample(self, rng: random.Random) -> float:
        return self.value

    def scaled(self, factor: float) -> Constant:
        return Constant(self.value * factor)


@dataclass(frozen=True)
class Mixture:
    parts: tuple[tuple[float, Dist], ...]  # (probability, distribution); probabilities sum to 1

    def __post_init__(self) -> None:
        ps = [p for p, _ in self.parts]
        if not ps or not all(0 <= p <= 1 for p in ps) or abs(sum(ps) - 1) > 1e-6:
            raise ValueError(f"mixture probabilities must be in [0, 1] and sum to 1, got {ps}")

    def sample(self, rng: random.Random) -> float:
        u = rng.random()
        for p, dist in self.parts:
            if u < p:
                return dist.sample(rng)
            u -= p
        return self.parts[-1][1].sample(rng)

    def scaled(self, factor: float) -> Mixture:
        return Mixture(tuple((p, dist.scaled(factor)) for p, dist in self.parts))


@dataclass(frozen=True)
class Turns:
    """Turns of one trajectory. `lognormal`: the prompt's median m_p ~ `prompt_median`, the
    trajectory's turns ~ LN(m_p, sigma); `binomial`: 1 + Binomial(n, p); `poisson`: 1 +
    Poisson(mean). All clamped to the turn cap."""

    kind: Literal["lognormal", "binomial", "poisson"]
    prompt_median: LogNormal | None = None
    sigma: float = 0.35
    n: int = 3
    p: float = 0.5
    mean: float = 2.5

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "binomial", "poisson"):
            raise ValueError(
                f"turns: kind must be lognormal, binomial or poisson, not {self.kind!r}"
            )
        if self.kind == "lognormal" and self.prompt_median is None:
            raise ValueError("turns: lognormal needs prompt_median (each prompt's median turns)")
        if not (0 <= self.sigma < math.inf and 0 <= self.p <= 1 and 0 <= self.mean <= 1e4):
            raise ValueError(
                f"turns: needs sigma >= 0, p in [0, 1], mean in [0, 1e4]; got {self.sigma}, "
                f"{self.p}, {self.mean}"
            )
        if not 0 <= self.n <= 10_000:
            raise ValueError(f"turns: n must be in [0, 10000], got {self.n}")

    def prompt_level(self, rng: random.Random) -> float:
        return self.prompt_median.sample(rng) if self.prompt_median else 0.0

    def sample(self, rng: random.Random, prompt_median: float, cap: int) -> int:
        if self.kind == "lognormal":
            n = round(LogNormal(prompt_median, self.sigma).sample(rng))
        elif self.kind == "binomial":
            n = 1 + sum(rng.random() < self.p for _ in range(self.n))
        else:
            n = 1 + _poisson(rng, self.mean)
        return min(max(n, 1), cap)


@dataclass(frozen=True)
class ToolLatency:
    """Seconds of one tool call: the body, rare heavy calls and hangs. With `per_prompt_sigma`,
    a prompt's multiplier m ~ LN(1, per_prompt_sigma) scales the heavy and hang probabilities
    (some tasks have slow tests), each capped: min(heavy_p m, heavy_p_max) and
    min(hang_p m, hang_p_max), so that a task with a large m is slow, not made of heavy calls
    only (at sigma 1.3 one task in a hundred has m > 20)."""

    body: Dist
    heavy_p: float = 0.0
    heavy: Dist = Constant(0.0)
    hang_p: float = 0.0
    hang_s: float = 0.0
    per_prompt_sigma: float = 0.0
    heavy_p_max: float = 1.0
    hang_p_max: float = 1.0

    def __post_init__(self) -> None:
        if not (0 <= self.heavy_p <= 1 and 0 <= self.hang_p <= 1 - self.heavy_p):
            raise ValueError(
                f"tool_s: heavy_p and hang_p are probabilities (their sum at most 1), got "
                f"{self.heavy_p}, {self.hang_p}"
            )
        if not (0 <= self.heavy_p_max <= 1 and 0 <= self.hang_p_max <= 1):
            raise ValueError(
                f"tool_s: heavy_p_max and hang_p_max are probabilities, got "
                f"{self.heavy_p_max}, {self.hang_p_max}"
            )
        if not (0 <= self.hang_s < math.inf and 0 <= self.per_prompt_sigma < math.inf):
            raise ValueError(
                f"tool_s: hang_s and per_prompt_sigma must be finite and >= 0, got "
                f"{self.hang_s}, {self.per_prompt_sigma}"
            )

    def prompt_level(self, rng: random.Random) -> float:
        return LogNormal(1.0, self.per_prompt_sigma).sample(rng) if self.per_prompt_sigma else 1.0

    def probabilities(self, multiplier: float) -> tuple[float, float]:
        """A call's chances of being heavy and of hanging, on a prompt of that multiplier."""
        return (
            min(self.heavy_p * multiplier, self.heavy_p_max),
            min(self.hang_p * multiplier, self.hang_p_max),
        )

    def sample(self, rng: random.Random, multiplier: float) -> float:
        heavy_p, hang_p = self.probabilities(multiplier)
        u = rng.random()
        if u < hang_p:
            return self.hang_s
        if u < hang_p + heavy_p:
            return self.heavy.sample(rng)
        return self.body.sample(rng)

    def scaled(self, factor: float) -> ToolLatency:
        """Every duration times `factor`, the probabilities as they are."""
        return dataclasses.replace(
            self,
            body=self.body.scaled(factor),
            heavy=self.heavy.scaled(factor),
            hang_s=self.hang_s * factor,
        )


@dataclass(frozen=True)
class Workload:
    name: str
    # What it runs on.
    model: str = "qwen3-4b"
    gpu: str = "h200"
    tp: int = 1
    rollout_gpus: int = 16
    train_gpus: int = 16
    prompts_per_batch: int = 64  # P
    group_size: int = 8  # K
    # What a trajectory looks like.
    turn_cap: int = 300
    context_cap: int = 131072
    turns: Turns = Turns("lognormal", LogNormal(57, 0.35), sigma=0.35)
    prompt_tokens: Dist = LogNormal(4000, 0.35, 1500, 16000)
    action_tokens: Dist = LogNormal(220, 0.6, 1, 8192)
    observation_tokens: Dist = LogNormal(800, 1.0, 1, 12000)
    template_tokens: int = 20  # chat template tokens around each turn
    tool_s: ToolLatency = ToolLatency(
        LogNormal(0.4, 0.8), 0.02, LogNormal(20, 1.3, 0, 450), 0.001, 450, per_prompt_sigma=1.3
    )
    sandbox: bool = True
    sandbox_start_s: Dist = Mixture(
        ((0.85, LogNormal(2, 0.5)), (0.14, LogNormal(45, 0.8)), (0.01, Constant(600)))
    )
    sandbox_rss_gb: Dist = LogNormal(1.5, 0.6)
    sandbox_shared_fraction: float = 0.7  # of a member's pages shared within its group
    reward_s: Dist = LogNormal(22, 1.0, 0, 1800)
    # Rewards graded at once across the cluster, at most (CPU set apart for grading); None:
    # every trajectory graded as its turns end.
    reward_workers: int | None = 64
    # Whether the reward reads the episode's sandbox; False: it is graded in a fresh one, as
    # SWE-bench's harness and the swe environment do, so reward workers let the episode's go.
    reward_reads_sandbox: bool = False
    success_beta: tuple[float, float] = (0.6, 1.4)  # per-prompt pass rate ~ Beta(a, b)
    infra_failure_rate: float = 0.01  # of trajectories, at a uniform point in time
    # The harness's wall-clock limit on a trajectory, from its start: one that runs past it
    # ends at its next turn boundary (a tool call in progress is cut), scored as a failure.
    trajectory_limit_s: float = math.inf
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = (
            "tp",
            "rollout_gpus",
            "train_gpus",
            "prompts_per_batch",
            "turn_cap",
            "context_cap",
        )
        problems = [
            f"{k} must be >= 1, got {getattr(self, k)}" for k in counts if getattr(self, k) < 1
        ]
        if self.group_size < 2:
            problems.append(
                f"group_size must be >= 2 (GRPO compares members), got {self.group_size}"
            )
        if not 0 <= self.infra_failure_rate < 1:
            # At 1 every episode fails and is replaced, forever.
            problems.append(f"infra_failure_rate must be in [0, 1), got {self.infra_failure_rate}")
        for k, most in (("rollout_gpus", 100_000), ("train_gpus", 100_000), ("tp", 64)):
            if getattr(self, k) > most:
                problems.append(f"{k} must be <= {most}, got {getattr(self, k)}")
        if self.prompts_per_batch * self.group_size > 1_000_000:
            problems.append(
                f"prompts_per_batch x group_size must be <= 1,000,000 trajectories a batch, got "
                f"{self.prompts_per_batch * self.group_size}"
            )
        if self.reward_workers is not None and not 1 <= self.reward_workers <= 1_000_000:
            problems.append(
                f"reward_workers must be in [1, 1000000] or null, got {self.reward_workers}"
            )
        if not self.trajectory_limit_s > 0:
            problems.append(f"trajectory_limit_s must be > 0, got {self.trajectory_limit_s}")
        if self.template_tokens < 0 or not 0 <= self.sandbox_shared_fraction <= 1:
            problems.append("template_tokens must be >= 0 and sandbox_shared_fraction in [0, 1]")
        if min(self.success_beta) <= 0:
            problems.append(f"success_beta must be two positive numbers, got {self.success_beta}")
        if problems:
            raise ValueError(f"workload {self.name}: " + "; ".join(problems))

    def scaled_for(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TurnPlan:
    action_tokens: int
    observation_tokens: int  # 0 on the last turn
    tool_s: float  # 0 on the last turn


@dataclass(frozen=True)
class TrajectoryPlan:
    prompt_tokens: int
    turns: tuple[TurnPlan, ...]
    sandbox_start_s: float
    reward_s: float
    success: bool
    infra_failure_turn: int | None  # the turn during which the platform fails it, if any
    sandbox_rss_gb: float


@dataclass(frozen=True)
class PromptPlan:
    prompt_id: str
    prompt_tokens: int
    turn_median: float
    tool_multiplier: float
    pass_rate: float


class WorkloadSampler:
    """Seeded draws of prompts and trajectories (a member's trajectory depends only on the seed,
    its prompt and its draw order, never on the schedule that runs it)."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self.w = workload
        self.seed = seed
        self._prompt_rng = random.Random(f"{seed}-prompts")
        self._n = 0

    def next_prompt(self) -> PromptPlan:
        rng, w = self._prompt_rng, self.w
        pid = f"p{self._n}"
        self._n += 1
        return PromptPlan(
            pid,
            round(w.prompt_tokens.sample(rng)),
            w.turns.prompt_level(rng),
            w.tool_s.prompt_level(rng),
            rng.betavariate(*w.success_beta),
        )

    def trajectory(self, prompt: PromptPlan, member: int, attempt: int = 0) -> TrajectoryPlan:
        rng, w = random.Random(f"{self.seed}-{prompt.prompt_id}-{member}-{attempt}"), self.w
        n = w.turns.sample(rng, prompt.turn_median, w.turn_cap)
        turns = []
        context = prompt.prompt_tokens
        for i in range(n):
            action = round(w.action_tokens.sample(rng))
            last = i == n - 1
            obs = 0 if last else round(w.observation_tokens.sample(rng))
            if context + action + obs + w.template_tokens >= w.context_cap:
                turns.append(TurnPlan(max(min(action, w.context_cap - context), 1), 0, 0.0))
                break
            turns.append(
                TurnPlan(action, obs, 0.0 if last else w.tool_s.sample(rng, prompt.tool_multiplier))
            )
            context += action + obs + w.template_tokens
        fails = rng.random() < w.infra_failure_rate
        return TrajectoryPlan(
            prompt.prompt_tokens,
            tuple(turns),
            w.sandbox_start_s.sample(rng) if w.sandbox else 0.0,
            w.reward_s.sample(rng),
            rng.random() < prompt.pass_rate,
            rng.randrange(len(turns)) if fails else None,
            w.sandbox_rss_gb.sample(rng) if w.sandbox else 0.0,
        )


def _poisson(rng: random.Random, mean: float) -> int:
    threshold, k, product = math.exp(-mean), 0, rng.random()
    while product > threshold:
        k += 1
        product *= rng.random()
    return k


_SWE_SOURCES = {
    "turns": "[D] SWE-bench Pro trajectories of SWE-agent: median 53-78 turns, p99 144-163",
    "prompt_tokens": "[A] DeepSWE caps prompts at 4,096, SkyRL at 8,000",
    "action_tokens": "[V] visible action medians 94-224 tokens",
    "observation_tokens": "[D] 2.4-3.8K characters per step",
    "tool_s": "[D] median 0.4 s, 2.4-3.7 % over 10 s, ~1 % over 60 s",
    "sandbox_start_s": "[A] published container and microVM start times",
    "reward_s": "[D] SWE-bench's harness grades Lite's 300 instances in ~15 min on 12 workers"
    " with images cached (~36 worker-s each); tails past 15 min reported; its timeout 1,800 s",
    "reward_workers": "[A] 64 cores set apart for grading, ~1 core per task instance (NeMo Gym)",
    "reward_reads_sandbox": "[V] SWE-bench's harness grades in a fresh container of the image",
    "success_beta": "[A] 20-45 % pass rates reported",
    "infra_failure_rate": "[A]",
    "sandbox_rss_gb": "[A] the figure to measure",
    "trajectory_limit_s": "[A] rLLM's DeepSWE recipe: agent.trajectory_timeout=5400",
}

SWE_LONG = Workload("swe-long", trajectory_limit_s=5400.0, sources=_SWE_SOURCES)

SEARCH_SHORT = Workload(
    "search-short",
    prompts_per_batch=512,
    group_size=5,
    turn_cap=4,
    context_cap=4096,
    turns=Turns("binomial", n=3, p=0.5),
    prompt_tokens=LogNormal(350, 0.3),
    action_tokens=LogNormal(150, 0.6, 1, 500),
    observation_tokens=LogNormal(450, 0.25),
    tool_s=ToolLatency(LogNormal(0.08, 0.6), 0.02, LogNormal(1.5, 0.7)),
    sandbox=False,
    reward_s=LogNormal(0.05, 0.5),
    reward_workers=None,
    success_beta=(1.0, 1.0),
    infra_failure_rate=0.0,
    sources={"all": "WORKLOADS.md, scenario search-short"},
)

SCENARIOS: dict[str, Workload] = {
    "swe-long": SWE_LONG,
    "swe-long-32b": SWE_LONG.scaled_for(name="swe-long-32b", model="qwen3-32b", tp=2),
    # No per-prompt correlation: is priority robust without a good length prediction?
    "swe-long-iid": SWE_LONG.scaled_for(
        name="swe-long-iid",
        turns=Turns("lognormal", LogNormal(57, 0.0), sigma=0.5),
        tool_s=dataclasses.replace(SWE_LONG.tool_s, per_prompt_sigma=0.0),
        success_beta=(50.0, 100.0),
    ),
    # DeepSWE-like: 50 turns, 36K context.
    "swe-short": SWE_LONG.scaled_for(
        name="swe-short",
        turn_cap=50,
        context_cap=36864,
        turns=Turns("lognormal", LogNormal(25, 0.35), sigma=0.35),
    ),
    "search-short": SEARCH_SHORT,
    "search-long": SEARCH_SHORT.scaled_for(
        name="search-long",
        turn_cap=128,
        context_cap=32768,
        turns=Turns("lognormal", LogNormal(15, 0.0), sigma=0.8),
        # search LN(1.5 s, 0.6) then fetch LN(3 s, 0.8): their sum's median ~4.5 s, spread ~0.6
        tool_s=ToolLatency(LogNormal(4.5, 0.6)),
        sources={"all": "WORKLOADS.md, scenario search-long (tool time: search + fetch, [D])"},
    ),
    "math-python": Workload(
        "math-python",
        prompts_per_batch=32,
        group_size=8,
        turn_cap=17,
        context_cap=32768,
        turns=Turns("poisson", mean=2.5),
        prompt_tokens=LogNormal(300, 0.4),
        action_tokens=LogNormal(900, 0.9, 1, 8192),
        observation_tokens=LogNormal(40, 1.2, 1, 2048),
        tool_s=ToolLatency(LogNormal(0.2, 1.0), hang_p=0.005, hang_s=120),
        sandbox_start_s=LogNormal(0.05, 0.5),
        sandbox_rss_gb=LogNormal(0.2, 0.4),
        reward_s=LogNormal(0.05, 0.5),
        reward_workers=None,
        success_beta=(1.0, 1.0),
        infra_failure_rate=0.0,
        sources={"all": "WORKLOADS.md, scenario math-python"},
    ),
}


# --- workload files --------------------------------------------------------------------------


def parse_dist(value: Any, where: str) -> Dist:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Constant(float(value))
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{where}: a distribution is {{lognormal: ...}}, {{constant: x}} or "
                         f"{{mixture: [...]}}, got {value!r}")  # fmt: skip
    ((kind, spec),) = value.items()
    if kind == "constant":
        return Constant(float(spec))
    if kind == "lognormal":
        if not isinstance(spec, dict) or not {"median", "sigma"} <= spec.keys():
            raise ValueError(f"{where}: lognormal needs median and sigma, got {spec!r}")
        unknown = spec.keys() - {"median", "sigma", "min", "max"}
        if unknown:
            raise ValueError(f"{where}: unknown lognormal keys {sorted(unknown)}")
        return LogNormal(**{k: float(v) for k, v in spec.items()})
    if kind == "mixture":
        parts = []
        for i, part in enumerate(spec or []):
            if not isinstance(part, dict) or "p" not in part:
                raise ValueError(f"{where}.mixture[{i}]: needs p and one distribution")
            rest = {k: v for k, v in part.items() if k != "p"}
            parts.append((float(part["p"]), parse_dist(rest, f"{where}.mixture[{i}]")))
        if not parts or abs(sum(p for p, _ in parts) - 1) > 1e-6:
            raise ValueError(f"{where}: mixture probabilities must sum to 1")
        return Mixture(tuple(parts))
    raise ValueError(f"{where}: unknown distribution {kind!r}")


def load_workload(path: str | Path) -> Workload:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if data is None:  # a file left empty by mistake would run the base scenario under its name
        raise ValueError(f"{path}: empty; a workload file sets Workload fields over its `base:`")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a workload file is a mapping of Workload fields")
    base_name = data.pop("base", "swe-long")
    if base_name not in SCENARIOS:
        raise ValueError(f"{path}: base: unknown scenario {base_name!r}")
    base = SCENARIOS[base_name]
    fields = {f.name for f in dataclasses.fields(Workload)}
    changes: dict[str, Any] = {"name": str(data.pop("name", Path(path).stem))}
    for key, value in data.items():
        where = f"{path}: {key}"
        if key not in fields:
            raise ValueError(f"{where}: unknown field; fields: {', '.join(sorted(fields))}")
        try:
            changes[key] = _field(key, value, getattr(base, key), where)
        except (TypeError, KeyError, IndexError, ValueError, OverflowError) as e:
            if str(e).startswith(where):
                raise
            raise ValueError(f"{where}: {value!r} is not a valid value ({e})") from None
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _field(key: str, value: Any, current: Any, where: str) -> Any:
    if key == "reward_workers":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{where}: needs a count of graders or null, got {value!r}")
        return value
    if key == "turns":
        spec = dict(value)
        if "prompt_median" in spec:
            spec["prompt_median"] = parse_dist(spec["prompt_median"], f"{where}.prompt_median")
        return Turns(**spec)
    if key == "tool_s":
        spec = dict(value)
        for k in ("body", "heavy"):
            if k in spec:
                spec[k] = parse_dist(spec[k], f"{where}.{k}")
        return ToolLatency(**spec)
    if isinstance(current, LogNormal | Constant | Mixture):
        return parse_dist(value, where)
    if key == "success_beta":
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError(f"{where}: needs two numbers [a, b], got {value!r}")
        return (float(value[0]), float(value[1]))
    if isinstance(current, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: needs a mapping, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    # As YAML wrote it: 'false' is not a boolean, 1.7 is not a count.
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    else:
        ok = isinstance(value, type(current))
    if not ok:
        raise ValueError(f"{where}: needs a {type(current).__name__}, got {value!r}")
    return type(current)(value)
