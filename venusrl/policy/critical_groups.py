"""Which GRPO groups run first: the ones that unlock the next trainer batch.

Pure policy (DESIGN.md contract 1; "Critical groups" there). The trainer consumes
batches of B complete groups. A group is useless to it until all its members are done, so time
spent on a group that cannot complete soon only delays the batch. The coordinator therefore ranks
the open groups

    by completion ratio (done members / K), highest first,
    then by the predicted remaining time of the group's slowest unfinished member, shortest first,
    then by age (oldest first),

and marks the first `B - complete_groups_waiting` of them high priority (they fill the next batch),
and `spares` (an eighth of B) more while the batch still needs any; the rest are best effort.
The engine and the sandbox pool receive that priority with every request.
Which groups fill the batch is decided soonest-done first; among them the batch waits for the last,
so they run longest remaining path first (the longest-processing-time rule for a makespan): the
KV window admits by this order. Under a start bound of one version the groups in flight are exactly
the next batch, and its step waits for the slowest of them (BENCHMARKS.md, swe-long).

Two kinds of group rank before all others: the *due* ones, which the staleness bound makes the
next batch take, and the *late* ones, with less than `LATE` times their predicted remaining path
left before the harness's time limit cuts their members (`GroupView.cut_at`). Ranked by how soon
it completes alone, a long group waits behind every group opened after it until it is cut: with
overtaken groups released (`policy.staleness`) ours ran 12.8 % of its trained samples on
swe-long into the 90-minute limit (seed 1, BENCHMARKS.md 2026-12-06 (8)).

Why spares: under a train bound the batch takes whichever open groups complete first, and the
guess of which those are is poorest right after new weights are out, when it matters most. The
groups ranked first then are the last step's stragglers, often waiting on a tool call no engine
can shorten, and the groups just opened all look alike; the batch is completed by whichever of
those finishes first. The spares, the next groups in the ranking, run as fast as the ones the
batch needs, so the groups that do complete it are among the fast (on swe-long the batch's wait
fell from 652-738 s to 555-639 s a step, BENCHMARKS.md).

A member's remaining time is its predicted remaining tokens at the decode rate plus the expected
tool time of its remaining turns; the length prediction comes from `LengthPredictor`, which starts
from the prompt's own history (the K members of a group share a prompt, and prompts are revisited
across epochs) and falls back to the global median; a member past its prediction still has
`OVERRUN` of what it did ahead of it. The decode speed and the median tool time come from
`TurnRates`, the medians of the run's own recent turns; a group's tool time per call is its own
members' (a task with slow tests stays slow), shrunk toward that median, and a call in progress
that has run past it counts what it ran past.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

# A group's own tool time per call is shrunk toward the run's median by this many calls' worth
# of it: one slow call says little, a task whose tests are slow shows it within a few calls.
TOOL_PRIOR = 8.0
# A member past its predicted length has at least this share of what it did still ahead of it
# (long trajectories run long: without it, a member past its prediction looks nearly done).
OVERRUN = 0.25
# A group is late when the time left before the harness cuts it is less than this many times its
# predicted remaining path: it runs among the critical groups from then, with that path's worth
# of time to spare for the prediction's error and for waiting behind the others.
LATE = 2.0
HIGH = 1  # priority sent with the requests of critical groups
BEST_EFFORT = 0


def critical(priority: int) -> bool:
    """Whether a request, agent or KV of this priority is a critical group's: the one rule the
    engine, the KV window, retention and the simulator read priorities by."""
    return priority >= HIGH


def reward_rank(
    group_id: str, ranking: Mapping[str, int], place: Mapping[str, int]
) -> tuple[int, int]:
    """Where a group's finished trajectories wait for a reward worker, lowest first: by their
    group's priority in `ranking` (the latest, in its order), then by its `place` in that order:
    the groups the next batch needs are graded first. The rule of the runtime's reward pool and
    of the simulator's graders."""
    return -ranking.get(group_id, BEST_EFFORT), place.get(group_id, len(place))


@dataclass(frozen=True)
class MemberView:
    done: bool
    generated_tokens: int = 0
    turns: int = 0
    waiting_on_tool: bool = False
    tool_s: float = 0.0  # seconds its tool calls took so far (those that returned)
    tool_calls: int = 0  # how many returned
    tool_since: float | None = None  # when the call it waits on began (None: not known)
    reward_since: float | None = None  # when its reward began, its turns over (None: not yet)

    @property
    def rolled_out(self) -> bool:
        """Its turns are over: it is done, or only its reward is left."""
        return self.done or self.reward_since is not None


@dataclass(frozen=True)
class GroupView:
    group_id: str
    prompt_id: str
    arrival: int  # order in which the group was opened (lower = older)
    members: tuple[MemberView, ...]
    due: bool = False  # the staleness bound requires it in the next batch
    cut_at: float = math.inf  # when the harness's time limit cuts its members (inf: no limit)

    @cached_property  # a view is ranked over and over while its group does not change
    def completion(self) -> float:
        return sum(m.rolled_out for m in self.members) / len(self.members)


@dataclass(frozen=True)
class Prediction:
    total_tokens: float  # tokens a trajectory of this prompt generates in all
    turns: float


@dataclass(frozen=True)
class CoordinatorSnapshot:
    groups: Sequence[GroupView]  # open groups (not complete yet)
    batch_groups: int  # B
    complete_groups_waiting: int  # complete groups not yet consumed by the trainer
    predictions: Mapping[str, Prediction]  # per prompt id
    decode_tokens_per_s: float  # of one trajectory, as the engine currently runs it (TurnRates)
    tool_s_per_turn: float
    now: float = 0.0  # for the elapsed time of tool calls and rewards in progress
    reward_s: float = 0.0  # from a member's last turn to its reward, as the run's rewards show


@dataclass(frozen=True)
class GroupPriorities:
    order: tuple[str, ...]  # group ids, most critical first
    priority: Mapping[str, int]


def slowest_remaining_s(group: GroupView, pred: Prediction, snap: CoordinatorSnapshot) -> float:
    """Predicted seconds until the group's slowest member is done: the tokens it has still to
    generate at the engine's decode speed, plus its turns still to come at the group's tool time
    per call (at least the tool call it waits on now, and what that call has run past it: a call
    that has run long is likely to run as long again). Run for every open group at every
    re-ranking: one plain loop. A member whose reward is being scored off the rollout's path
    has only that left: the run's reward latency, or what it has run past it again."""
    calls, spent = 0, 0.0
    for m in group.members:
        calls += m.tool_calls
        spent += m.tool_s
    tool_s = (spent + TOOL_PRIOR * snap.tool_s_per_turn) / (calls + TOOL_PRIOR)
    slowest = 0.0
    for m in group.members:
        if m.done:
            continue
        if m.reward_since is not None:  # graded off the rollout's path: its reward is all left
            slowest = max(
                slowest, snap.reward_s + max(snap.now - m.reward_since - snap.reward_s, 0)
            )
            continue
        tokens = max(pred.total_tokens - m.generated_tokens, OVERRUN * m.generated_tokens, 0.0)
        turns = max(pred.turns - m.turns, OVERRUN * m.turns, 1.0 if m.waiting_on_tool else 0.0)
        seconds = tokens / snap.decode_tokens_per_s + turns * tool_s
        if m.tool_since is not None and snap.now - m.tool_since > tool_s:
            seconds += snap.now - m.tool_since - tool_s
        slowest = max(slowest, seconds)
    return slowest


@dataclass(frozen=True)
class CriticalGroups:
    default: Prediction = Prediction(total_tokens=256, turns=3)
    spares: float = 0.125  # a share of the batch (rounded up), critical beside the groups it needs

    def __post_init__(self) -> None:
        if not 0 <= self.spares <= 1:
            raise ValueError(f"spares is a share of the batch in [0, 1], got {self.spares}")

    def decide(self, snap: CoordinatorSnapshot) -> GroupPriorities:
        predictions, default = snap.predictions, self.default

        left = {
            g.group_id: slowest_remaining_s(g, predictions.get(g.prompt_id, default), snap)
            for g in snap.groups
        }
        urgent = {
            g.group_id: g.due or snap.now + LATE * left[g.group_id] >= g.cut_at for g in snap.groups
        }
        ranked = sorted(
            snap.groups,
            key=lambda g: (not urgent[g.group_id], -g.completion, left[g.group_id], g.arrival),
        )
        needed = max(snap.batch_groups - snap.complete_groups_waiting, 0)
        # The batch is complete when the last group it needs is: those run longest path first.
        ranked[:needed] = sorted(
            ranked[:needed], key=lambda g: (not urgent[g.group_id], -left[g.group_id], g.arrival)
        )
        order = tuple(g.group_id for g in ranked)
        high = needed + math.ceil(self.spares * snap.batch_groups) if needed else 0
        return GroupPriorities(
            order, {gid: HIGH if i < high else BEST_EFFORT for i, gid in enumerate(order)}
        )


@dataclass(frozen=True)
class FifoGroups:
    """The baseline: groups in arrival order, all equal (what RL frameworks do today)."""

    def decide(self, snap: CoordinatorSnapshot) -> GroupPriorities:
        order = tuple(g.group_id for g in sorted(snap.groups, key=lambda g: g.arrival))
        return GroupPriorities(order, dict.fromkeys(order, BEST_EFFORT))


@dataclass
class LengthPredictor:
    """Per-prompt trajectory length, learned from finished trajectories. Pure state."""

    window: int = 64
    _by_prompt: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    _all: list[tuple[int, int]] = field(default_factory=list)
    # Medians are asked for far more often than they change (every re-ranking, for every open
    # group): computed once per change of their history.
    _cache: dict[str | None, Prediction] = field(default_factory=dict)

    def observe(self, prompt_id: str, total_tokens: int, turns: int) -> None:
        for history in (self._by_prompt.setdefault(prompt_id, []), self._all):
            history.append((total_tokens, turns))
            del history[: -self.window]
        self._cache.pop(prompt_id, None)
        self._cache.pop(None, None)

    def _median(self, key: str | None, history: list[tuple[int, int]]) -> Prediction:
        pred = self._cache.get(key)
        if pred is None:
            pred = self._cache[key] = Prediction(
                statistics.median(t for t, _ in history),
                statistics.median(n for _, n in history),
            )
        return pred

    def predictions(self, prompt_ids: Sequence[str]) -> dict[str, Prediction]:
        out = {}
        for pid in prompt_ids:
            own = self._by_prompt.get(pid)
            if own:
                out[pid] = self._median(pid, own)
            elif self._all:
                out[pid] = self._median(None, self._all)
        return out


class TurnRates:
    """What a member's remaining turns cost, as the run's own turns show it: the decode speed of
    one trajectory (a turn's tokens over the seconds from its request to its last token,
    queueing and prefill included, as a member waits them), the tool time of a turn that
    another turn follows (the simulator's `tool_s`), and a reward's latency where rewards are
    scored off the rollout's path. Each is the median of the latest `window` that showed it,
    robust to the odd turn that queued behind a preemption or a tool that hung; the given
    figures stand until the first such turn. Pure state: the caller measures."""

    def __init__(
        self,
        decode_tokens_per_s: float = 50.0,
        tool_s_per_turn: float = 0.5,
        window: int = 256,
        reward_s: float = 1.0,
    ) -> None:
        self.decode_tokens_per_s, self.tool_s_per_turn = decode_tokens_per_s, tool_s_per_turn
        self.reward_s = reward_s
        self._decode, self._tool = RollingMedian(window), RollingMedian(window)
        self._reward = RollingMedian(window)

    def observe(self, tokens: int, generation_s: float, tool_s: float | None) -> None:
        """One turn: `tokens` generated in `generation_s`, then `tool_s` for the environment to
        act on them (None: no turn followed, so this was no tool call between turns). A turn
        that generated nothing in no time (replayed from a record) tells nothing of the decode
        speed."""
        if tokens > 0 and generation_s > 0:
            self.decode_tokens_per_s = self._decode.add(tokens / generation_s)
        if tool_s is not None:
            self.tool_s_per_turn = self._tool.add(max(tool_s, 0.0))

    def observe_reward(self, reward_s: float) -> None:
        """One member's reward came in `reward_s` after its last turn (queue and scoring)."""
        self.reward_s = self._reward.add(max(reward_s, 0.0))


class RollingMedian:
    """The median of the latest `window` values, kept sorted as they come (`statistics.median`
    of them, without sorting them again for each: the simulator asks once a turn)."""

    def __init__(self, window: int) -> None:
        self._latest: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def add(self, value: float) -> float:
        """Takes `value` in (the oldest out, if the window is full); returns the median."""
        if len(self._latest) == self._latest.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._latest[0])]
        self._latest.append(value)
        bisect.insort(self._sorted, value)
        n = len(self._sorted)
        middle = self._sorted[n // 2]
        return middle if n % 2 else (self._sorted[n // 2 - 1] + middle) / 2
