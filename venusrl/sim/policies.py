"""The simulator's policies: the knobs one run compares (`SimPolicy`), the named ones
(`POLICIES`: the baselines and ours), and the names a command gives them (`sim_policy`:
`NAME+offload`, `NAME[KNOB=VALUE,...]`, `NAME@N:L`)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Any, Literal

from venusrl.policy.agent_admission import AgentAdmission, ConcurAdmission
from venusrl.policy.kv_window import CriticalWindow
from venusrl.policy.staleness import StalenessBound
from venusrl.sim.settings import key_values


@dataclass(frozen=True)
class SimPolicy:
    """One scheduler configuration: the knobs a run compares."""

    name: str
    priorities: Literal["critical", "fifo"] = "fifo"
    max_staleness: int = 1
    retention: Literal["lru", "trajectory"] = "lru"
    pin_s: float = 5.0  # retention pin while a trajectory waits on a tool (trajectory retention)
    admission: AgentAdmission | CriticalWindow | None = None  # agent-level admission control
    max_train_staleness: int | None = None  # policy.staleness; None: max_staleness
    release_overtaken: bool = False  # policy.staleness: an overtaken group frees its start place
    # Rewards graded by reward workers off the rollout's path (`rewards.pool`): a trajectory's
    # places go as its turns end, the ranking learns only its reward is left, and the graders
    # take the most critical group's first. False: graded inline, as each episode ends, holding
    # its places until its reward is in (`reward.placement=inline`).
    reward_pool: bool = False


# Every policy that runs ahead of the trainer may train a straggling group up to this many
# versions after it started, rather than wait for it (AReaL's documented example bound; in
# `venusrl train`, `rollout.max_train_staleness`, default the start bound); `NAME@N:L` sets another.
TRAIN_BOUND = 4

POLICIES = {
    # veRL-like: the whole batch rolls out, then the trainer steps, then weights sync; continuous
    # batching, an LRU radix cache and sticky routing, as veRL on SGLang has.
    "sync": SimPolicy("sync", "fifo", 0, "lru"),
    # AReaL / ROLL Flash-like: rollout runs ahead of the trainer by at most one version.
    "async": SimPolicy("async", "fifo", 1, "lru", max_train_staleness=TRAIN_BOUND),
    # Concur: one version of staleness, LRU KV, and active trajectories per engine bounded by the
    # paper's congestion window on KV occupancy and hit rate (policy.agent_admission).
    "concur": SimPolicy(
        "concur", "fifo", 1, "lru", admission=ConcurAdmission(), max_train_staleness=TRAIN_BOUND
    ),
    # Ours: critical groups first, admitted into a per-engine KV window by that rank
    # (policy.kv_window), tool-waiting KV kept or offloaded, never silently dropped.
    "venus": SimPolicy(
        "venus",
        "critical",
        1,
        "trajectory",
        admission=CriticalWindow(),
        max_train_staleness=TRAIN_BOUND,
        reward_pool=True,
    ),
}
# `NAME+offload`: a baseline given the host tier ours has (the same size), as SGLang's HiCache or
# LMCache give a plain server: trajectory retention (idle KV offloaded, not dropped; finished KV
# first to go), with no priorities.
OFFLOAD = "+offload"


MAX_STALENESS = 64


def sim_policy(name: str) -> SimPolicy:
    """A policy by name; `NAME+offload` is that baseline with a host tier (`OFFLOAD`); `NAME@N`
    is that policy with a staleness bound of N versions, so that policies compare at the same
    bound (`async@2,venus@2`; `venus@0` is synchronous), and `NAME@N:L` also lets a group be
    trained up to L versions after it started (`max_train_staleness`: batches need not wait for
    a straggler). `NAME[KNOB=VALUE,...]` sets knobs of the policy (`knobs`), before any bound:
    `venus[leave_after_calls=5,lane=0.5]@1:4`."""
    known = f"known: {', '.join(POLICIES)}, NAME{OFFLOAD}, NAME[KNOB=VALUE] or NAME@BOUND"
    base, at, bounds = name.partition("@")
    base, bracket, settings = base.partition("[")
    offload = base.endswith(OFFLOAD) and base[: -len(OFFLOAD)] in POLICIES
    policy = POLICIES.get(base[: -len(OFFLOAD)] if offload else base)
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; {known}")
    if offload:
        if policy.retention != "lru":
            raise ValueError(f"policy {name!r}: {policy.name} already offloads to the host tier")
        policy = replace(policy, retention="trajectory")
    if bracket:
        if not settings.endswith("]"):
            raise ValueError(f"policy {name!r}: knobs go in one [KNOB=VALUE,...] before any '@'")
        try:
            policy = with_knobs(policy, settings[:-1])
        except ValueError as err:
            raise ValueError(f"policy {name!r}: {err}") from None
    policy = replace(policy, name=name)
    if not at:
        return policy
    start, colon, train = bounds.partition(":")
    if not all(b.isascii() and b.isdigit() for b in (start, *([train] if colon else []))):
        raise ValueError(
            f"policy {name!r}: after '@' comes a staleness bound in versions (0, 1, ...),"
            " optionally ':' and how many versions late a group may be trained"
        )
    policy = replace(
        policy,
        max_staleness=int(start),
        max_train_staleness=int(train) if colon else None,
    )
    most = max(policy.max_staleness, policy.max_train_staleness or 0)
    if most > MAX_STALENESS:
        # The bound opens P x (N + 1) groups at once: a typo's extra zeros would take the memory.
        raise ValueError(f"policy {name!r}: staleness bounds go up to {MAX_STALENESS} versions")
    try:
        StalenessBound(1, policy.max_staleness, policy.max_train_staleness)
    except ValueError as err:
        raise ValueError(f"policy {name!r}: {err}") from None
    return policy


# The policy's own knobs; the others are its admission control's.
OWN_KNOBS = ("pin_s", "release_overtaken", "reward_pool")


def knobs(policy: SimPolicy) -> dict[str, float | int | bool]:
    """What `NAME[KNOB=VALUE]` may set: the retention pin, whether an overtaken group frees its
    place under the start bound, and the numeric fields of the policy's admission control (its
    constants, chosen on swe-long: a user tunes them on their own workload from the command
    line)."""
    found: dict[str, float | int | bool] = {k: getattr(policy, k) for k in OWN_KNOBS}
    if is_dataclass(policy.admission):  # every admission policy is one
        found.update(
            (k, v) for k, v in asdict(policy.admission).items() if isinstance(v, int | float)
        )
    return found


def with_knobs(policy: SimPolicy, settings: str) -> SimPolicy:
    """`policy` with `settings` ("KNOB=VALUE,...") applied; ValueError names a bad one."""
    current = knobs(policy)
    own, admission = dict[str, Any](), dict[str, Any]()
    given = key_values(settings)
    if not given:
        raise ValueError(
            f"no KNOB=VALUE between the brackets; {policy.name}'s knobs: " + ", ".join(current)
        )
    for key, text in given.items():
        if key not in current:
            listed = ", ".join(current)
            raise ValueError(f"{key}: not a knob of {policy.name}; its knobs: {listed}")
        kind = type(current[key])
        value: float | int | bool
        try:
            if kind is bool:
                if text not in ("true", "false"):
                    raise ValueError
                value = text == "true"
            else:
                value = kind(text)
        except ValueError:
            raise ValueError(f"{key}: needs {kind.__name__}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}: needs a finite number, got {text!r}")
        (own if key in OWN_KNOBS else admission)[key] = value
    if own.get("pin_s", 0) < 0:
        raise ValueError(f"pin_s must be >= 0, got {own['pin_s']}")
    control = policy.admission
    if admission:
        assert is_dataclass(control) and not isinstance(control, type)  # (its knobs were found)
        control = replace(control, **admission)
    return replace(policy, admission=control, **own)


def sim_policies(names: str) -> list[SimPolicy]:
    """Comma-separated policy names (`sim_policy`'s), in order (commas inside a policy's
    [KNOB=VALUE,...] are its own); ValueError names a bad one."""
    listed = [n.strip() for n in re.split(r",(?![^\[]*\])", names) if n.strip()]
    if not listed:
        raise ValueError(f"no policy given; known: {', '.join(POLICIES)}, or NAME@BOUND")
    repeated = sorted({n for n in listed if listed.count(n) > 1})
    if repeated:  # it would simulate the same thing twice and compare it with itself
        raise ValueError(f"{', '.join(repeated)} listed more than once")
    return [sim_policy(n) for n in listed]
