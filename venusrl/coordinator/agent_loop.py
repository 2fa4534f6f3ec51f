"""The multi-turn agent loop: token in, token out.

The prompt is rendered with the chat template and tokenised once. Each turn sends the whole token
record to the engine (whose radix cache holds the prefix, so only the new tokens are computed),
appends the generated tokens with their logprobs and weight versions, lets the environment act on
their text, and appends the observation's tokens, masked. History is never re-tokenised, so the
trainer trains on exactly what the engine sampled.

The observation's tokens are the chat template's own text between the end of an assistant message
and the start of the next one, with the observation as a user message: rendered once per
observation around a marker, so any template works, not only ChatML.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import numbers
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from venusrl.coordinator.config import RolloutConfig
from venusrl.engine.tokenizer import Tokenizer
from venusrl.envs.environment import Environment, acting_for
from venusrl.envs.types import InfraFailure, SandboxPreempted
from venusrl.types import (
    FailureKind,
    Finish,
    Generate,
    SamplingParams,
    Trajectory,
    TurnMeta,
    TurnTimes,
)

T = TypeVar("T")

_MARK = "\ue000"  # a private-use character: where the assistant's text goes in a rendering
_OBSERVATION = "\ue001"  # and where the observation goes


class ChatFormat:
    """The token pieces of a chat template that the loop needs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        closed = tokenizer.apply_chat_template(self._base(), add_generation_prompt=False)
        # What follows the assistant's text when its turn is closed: "<|im_end|>\n" in ChatML.
        self.end_of_turn = closed[closed.index(_MARK) + len(_MARK) :]
        # The markup around an observation, after the model's turn: the same for every one.
        messages = [*self._base(), {"role": "user", "content": _OBSERVATION}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        around = text[text.index(_MARK) + len(_MARK) :].split(_OBSERVATION)
        if len(around) != 2:
            raise ValueError("the chat template rewrites user messages: observations cannot go in")
        self._before, self._after = around
        self._closing = tokenizer.encode(self.end_of_turn.rstrip())

    @staticmethod
    def _base() -> list[dict[str, str]]:
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def observation_ids(self, observation: str, model_ids: Sequence[int]) -> list[int]:
        """Tokens that close the model's turn (unless it closed it itself), carry the observation
        as a user message and open the model's next turn."""
        tok = self.tokenizer
        if tok.spells_markup(observation):  # the tool's text, never the chat's markup
            ids = tok.encode(self._before) + tok.encode_text(observation) + tok.encode(self._after)
        else:  # encoded whole, seams included, as the warm start's records are (`retokenize`)
            ids = tok.encode(self._before + observation + self._after)
        closing = self._closing
        if closing and list(model_ids[-len(closing) :]) == closing:
            ids = ids[len(closing) :]  # the model ended its turn with the end-of-turn token
        return ids

    def text(self, model_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(model_ids, skip_special_tokens=True)


class ReplayDiverged(InfraFailure):
    """Acting again on a record's turns in a new sandbox did not give its observations back."""


class EnvironmentFailed(Exception):
    """The environment's own code (its reset, step, ended or reward) raised: a bug of its
    author's, neither the model's turn nor the platform. The episode is lost; the exception it
    raised is the cause, with the traceback its author needs."""


async def _environment(env: Environment, verb: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except (InfraFailure, TimeoutError):
        raise
    except Exception as e:
        raise EnvironmentFailed(f"{env.name}.{verb} raised {type(e).__name__}: {e}") from e


async def run_episode(
    env: Environment,
    generate: Generate,
    fmt: ChatFormat,
    sampling: SamplingParams,
    rollout: RolloutConfig,
    trajectory_id: str,
    group_id: str,
    prompt_id: str,
    priority: Callable[[], int] = lambda: 0,
    on_turn: Callable[[Trajectory], None] = lambda traj: None,
    replay: Trajectory | None = None,
) -> Trajectory:
    """One episode. Infrastructure failures end it with `Finish.INFRA` and no reward (the
    coordinator replaces or masks it); the model's own failures end it normally and are scored.
    `on_turn` sees the record after each model turn, before the environment acts on it (the
    coordinator's progress view of its members).

    `replay`: the record of this episode up to where its sandbox failed. The environment acts
    again on each of its model turns, in this episode's fresh sandbox, and the episode goes on
    from there: the turns already generated are kept, not sampled again. The observations must
    come out as recorded (`ReplayDiverged` otherwise: a tool that is not deterministic)."""
    messages = await _environment(env, "reset", env.reset())
    traj = Trajectory.start(trajectory_id, group_id, prompt_id, fmt.prompt_ids(messages))
    try:
        finish = await _replay(env, fmt, rollout, replay, traj) if replay else None
        traj.finish = finish or await _turns(
            env, generate, fmt, sampling, rollout, traj, priority, on_turn
        )
        reward = _environment(env, "reward", env.reward())
        limit = rollout.reward_timeout_s
        traj.reward = _checked_reward(
            env, await _within(reward, limit, f"{env.name}.reward", "reward_timeout_s")
        )
    except (InfraFailure, TimeoutError) as e:
        traj.fail(failure_kind(e), f"{type(e).__name__}: {e}")
    return traj


def failure_kind(error: Exception) -> FailureKind:
    """What an exception that ended an episode says about who failed it; an exception of no
    known kind came from a generation call (the loop calls nothing else that may fail)."""
    if isinstance(error, SandboxPreempted):
        return FailureKind.PREEMPTED
    if isinstance(error, ReplayDiverged):
        return FailureKind.REPLAY_DIVERGED
    if isinstance(error, InfraFailure):
        return FailureKind.SANDBOX
    if isinstance(error, TimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(error, EnvironmentFailed):
        return FailureKind.ENVIRONMENT
    return FailureKind.ENGINE


async def _within(call: Awaitable[T], limit_s: float, what: str, key: str) -> T:
    """`call`, or, past its limit, a `TimeoutError` that names what overran and the config key
    of the limit (a TimeoutError the call raises itself goes through as it is)."""
    try:
        async with asyncio.timeout(limit_s) as deadline:
            return await call
    except TimeoutError:
        if deadline.expired():
            raise TimeoutError(f"{what} took longer than rollout.{key}={limit_s:g} s") from None
        raise


def _checked_reward(env: Environment, reward: object) -> float:
    """A NaN would poison the advantages, and through them the weights, without an error."""
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvironmentFailed(
            f"{env.name}.reward returned {reward!r}: a reward is a finite number"
        )
    return float(reward)


async def _replay(
    env: Environment, fmt: ChatFormat, rollout: RolloutConfig, record: Trajectory, traj: Trajectory
) -> Finish | None:
    """Act again on each model turn of `record`; a finish if the episode ended there."""
    turns = [*record.turn_starts, len(record.token_ids)]
    for start, following in itertools.pairwise(turns):
        end = start + [*record.mask[start:following], 0].index(0)  # the model's tokens
        model_ids = record.token_ids[start:end]
        if traj.token_ids != record.token_ids[:start]:
            raise ReplayDiverged(f"turn {len(traj.turn_starts)}: the observation came out changed")
        traj.add_model_turn(model_ids, record.logprobs[start:end], record.versions[start:end])
        acted = time.monotonic()
        finish = await _act(env, fmt, rollout, traj, model_ids)
        traj.turn_times.append(TurnTimes(acted, acted, time.monotonic()))
        if finish is not None:
            return finish
    recorded = min(len(traj.token_ids), len(record.token_ids))
    if traj.token_ids[:recorded] != record.token_ids[:recorded]:
        raise ReplayDiverged("the last observation came out changed")
    return None


async def _act(
    env: Environment,
    fmt: ChatFormat,
    rollout: RolloutConfig,
    traj: Trajectory,
    model_ids: list[int],
) -> Finish | None:
    """The environment acts on a model turn; the observation joins the record, unless the
    episode ends (its finish)."""
    step = _environment(env, "step", env.step(fmt.text(model_ids)))
    with acting_for(traj.trajectory_id):  # an overrunning tool's warning names the trajectory
        result = await _within(step, rollout.step_timeout_s, f"{env.name}.step", "step_timeout_s")
    traj.tool_calls += int(result.info.get("tool_calls", 0))
    if result.done:
        return Finish.TURN_CAP if result.info.get("truncated") else Finish.DONE
    obs = fmt.observation_ids(result.observation or "", model_ids)
    if len(traj.token_ids) + len(obs) >= rollout.max_context:
        return Finish.CONTEXT_CAP
    traj.add_observation(obs)
    return None


async def _turns(
    env: Environment,
    generate: Generate,
    fmt: ChatFormat,
    sampling: SamplingParams,
    rollout: RolloutConfig,
    traj: Trajectory,
    priority: Callable[[], int],
    on_turn: Callable[[Trajectory], None],
) -> Finish:
    while True:
        room = rollout.max_context - len(traj.token_ids)
        if room < 1:
            return Finish.CONTEXT_CAP
        params = dataclasses.replace(sampling, max_tokens=min(rollout.max_tokens_per_turn, room))
        requested = time.monotonic()
        out = await generate(
            list(traj.token_ids),
            params,
            TurnMeta(priority(), traj.trajectory_id, traj.group_id, rollout.tool_wait_pin_s),
        )
        traj.add_model_turn(out.token_ids, out.logprobs, out.weight_versions)
        on_turn(traj)
        generated = time.monotonic()
        finish = await _act(env, fmt, rollout, traj, out.token_ids)
        traj.turn_times.append(TurnTimes(requested, generated, time.monotonic()))
        if finish is not None:
            return finish
