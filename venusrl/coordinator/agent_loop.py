"""The multi-turn agent loop: token in, token out.

The prompt is rendered with the chat template and tokenised once. Each turn sends the whole token
record to the engine (whose radix cache holds the prefix, so only the new tokens are computed),
appends the generated tokens with their logprobs and weight versions, lets the environment act on
their text, and appends the observation's tokens, masked. History is never re-tokenised, so the
trainer trains on exactly what the engine sampled.

The prompt is rendered with the environment's tools: by the template itself where it knows tools
(`tools=`, as Hugging Face passes them), else announced in the system message. The observation's
tokens are the chat template's own text between the end of an assistant message and the start of
the next one, with the tool responses as tool messages (or, for a template without tools, one user
message): rendered after a marker for the assistant's text, so any template works, not only ChatML.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from venusrl.coordinator.config import RolloutConfig
from venusrl.envs.environment import (
    Environment,
    EnvironmentFailed,
    ModelTurn,
    acting_for,
    checked_reward,
    environment_call,
    raised_by,
)
from venusrl.envs.types import InfraFailure, SandboxPreempted
from venusrl.model.tokenizer import Tokenizer
from venusrl.model.tool_formats import ToolParser, resolve_tool_parser, with_tool_prompt
from venusrl.rewards.pool import RewardFailed
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
log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 30.0  # for `Environment.close`: past it the episode goes on without it

_MARK = "\ue000"  # a private-use character: where the assistant's text goes in a rendering
_OBSERVATION = 0xE001  # and where the observations go, one character each from here
_MAX_OBSERVATIONS = 0x7FF  # in the private-use area


class ChatFormat:
    """The token pieces of a chat template that the loop needs, and the model's tool-call format
    (`rollout.tool_parser`: a parser's name, or "auto" for the one the template teaches)."""

    def __init__(self, tokenizer: Tokenizer, tool_parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.tool_parser: ToolParser = resolve_tool_parser(tool_parser, tokenizer.chat_template)
        closed = tokenizer.apply_chat_template(self._base(), add_generation_prompt=False)
        # What follows the assistant's text when its turn is closed: "<|im_end|>\n" in ChatML.
        self.end_of_turn = closed[closed.index(_MARK) + len(_MARK) :]
        self._closing = tokenizer.encode(self.end_of_turn.rstrip())
        mark = chr(_OBSERVATION)
        if self._after_model_turn([{"role": "user", "content": mark}]).count(mark) != 1:
            raise ValueError("the chat template rewrites user messages: observations cannot go in")

    @staticmethod
    def _base() -> list[dict[str, str]]:
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]

    def _after_model_turn(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The template's text after the assistant's, with `messages` following it."""
        text = self.tokenizer.apply_chat_template([*self._base(), *messages])
        return text[text.index(_MARK) + len(_MARK) :]

    def prompt_ids(
        self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """The episode's opening. `tools` (function schemas, `Environment.tool_schemas()`) go to
        a template that renders them; for one that does not, the tool parser's announcement
        follows the instructions in the system message."""
        if not tools:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        if self.tokenizer.renders_tools:
            wrapped = [{"type": "function", "function": dict(t)} for t in tools]
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=wrapped)
        announced = with_tool_prompt(messages, self.tool_parser.tool_prompt(tools))
        return self.tokenizer.encode_chat(announced, add_generation_prompt=True)

    def observation_ids(
        self,
        observation: str,
        model_ids: Sequence[int],
        tool_responses: Sequence[str] = (),
        then: str | None = None,
    ) -> list[int]:
        """Tokens that close the model's turn (unless it closed it itself), carry what the
        environment answered and open the model's next turn: `tool_responses` as tool messages
        where the template renders them, else `observation` as a user message; `then`, a user
        message after them."""
        if tool_responses and self.tokenizer.renders_tools:
            messages = [{"role": "tool", "content": r} for r in tool_responses]
        else:
            messages = [{"role": "user", "content": observation}]
        if then is not None:
            messages.append({"role": "user", "content": then})
        ids = self._encode_after_model_turn(messages)
        closing = self._closing
        if closing and list(model_ids[-len(closing) :]) == closing:
            ids = ids[len(closing) :]  # the model ended its turn with the end-of-turn token
        return ids

    def _encode_after_model_turn(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The rendering encoded whole, seams included, as the warm start's records are
        (`retokenize`); where a content spells the chat's markup, each content is encoded as
        text between the template's markup, so a tool's output never becomes a control token."""
        tok = self.tokenizer
        text = self._after_model_turn(messages)
        contents = [m["content"] for m in messages]
        if not any(tok.spells_markup(c) for c in contents) or len(contents) > _MAX_OBSERVATIONS:
            return tok.encode(text)
        marks = [chr(_OBSERVATION + i) for i in range(len(contents))]

        def rendered(kept: int | None) -> str:  # every content a mark but the `kept` one's
            return self._after_model_turn(
                [
                    {**m, "content": m["content"] if i == kept else marks[i]}
                    for i, m in enumerate(messages)
                ]
            )

        marked = rendered(None)
        where = [marked.find(mark) for mark in marks]
        if any(marked.count(mark) != 1 for mark in marks) or where != sorted(where):
            return tok.encode(text)  # the template drops, repeats or reorders contents
        pieces = re.split("|".join(marks), marked)
        written = contents
        if "".join(p + c for p, c in zip(pieces, written, strict=False)) + pieces[-1] != text:
            # The template rewrites contents (Llama 3.1 writes a tool's as JSON): each as it
            # renders it, between the markup before and after its mark.
            written = []
            for i, at in enumerate(where):
                one, before, after = rendered(i), marked[:at], marked[at + 1 :]
                if not (one.startswith(before) and one.endswith(after)):
                    return tok.encode(text)
                written.append(one[len(before) : len(one) - len(after)])
            if "".join(p + c for p, c in zip(pieces, written, strict=False)) + pieces[-1] != text:
                return tok.encode(text)
        ids: list[int] = []
        for piece, content in zip(pieces, written, strict=False):
            ids += tok.encode(piece) + tok.encode_text(content)
        return ids + tok.encode(pieces[-1])

    def text(self, model_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(model_ids, skip_special_tokens=True)


class ReplayDiverged(InfraFailure):
    """Acting again on a record's turns in a new sandbox did not give its observations back."""


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
    on_progress: Callable[[Trajectory], None] = lambda traj: None,
    replay: Trajectory | None = None,
    score: Callable[[Environment, Trajectory], Awaitable[float]] | None = None,
) -> Trajectory:
    """One episode. Infrastructure failures end it with `Finish.INFRA` and no reward (the
    coordinator replaces or masks it); the model's own failures end it normally and are scored.
    `on_progress` sees the record after each model turn, before the environment acts on it, and
    after each tool call that another turn follows (the coordinator's view of its members: how
    far each is, and how long its tools take).

    `replay`: the record of this episode up to where its sandbox failed. The environment acts
    again on each of its model turns, in this episode's fresh sandbox, and the episode goes on
    from there: the turns already generated are kept, not sampled again. The observations must
    come out as recorded (`ReplayDiverged` otherwise: a tool that is not deterministic).

    `score`: what scores the finished episode (the run's reward workers, `rewards.pool`); None:
    the environment's own `reward`, within `rollout.reward_timeout_s`."""
    limit_s = rollout.episode_timeout_s
    deadline = None if limit_s is None else time.monotonic() + limit_s
    env.tool_parser = fmt.tool_parser  # the model's own format, read from its turns
    try:
        messages = await environment_call(env, "reset", env.reset())
        prompt = fmt.prompt_ids(messages, env.tool_schemas())
        traj = Trajectory.start(trajectory_id, group_id, prompt_id, prompt)
        try:
            finish = await _replay(env, fmt, rollout, replay, traj) if replay else None
            traj.finish = finish or await _turns(
                env, generate, fmt, sampling, rollout, traj, priority, on_progress, deadline
            )
            traj.output = await environment_call(env, "output", env.output())
            if score is not None:
                traj.reward = await score(env, traj)
            else:
                reward = environment_call(env, "reward", env.reward())
                limit = rollout.reward_timeout_s
                traj.reward = checked_reward(
                    env, await _within(reward, limit, f"{env.name}.reward", "reward_timeout_s")
                )
        except (InfraFailure, TimeoutError, RewardFailed) as e:
            traj.fail(failure_kind(e), f"{type(e).__name__}: {e}")
        except EnvironmentFailed as e:  # its author's bug, reported with the episode kept
            traj.fail(failure_kind(e), f"{type(e).__name__}: {e}")
            e.record = traj
            raise
        return traj
    finally:
        try:
            await asyncio.wait_for(env.close(), CLOSE_TIMEOUT_S)
        except Exception:  # the episode's record stands; what it held is its author's to mend
            log.warning("%s.close raised (episode %s)", env.name, trajectory_id, exc_info=True)


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
    if isinstance(error, RewardFailed):
        return FailureKind.REWARD
    return FailureKind.ENGINE


def turn_seed(seed: int | None, trajectory_id: str, turn: int) -> int | None:
    """The sampling seed of one turn: from the run's seed, the trajectory and the turn, so a
    turn samples the same tokens however the engine batches it and whenever it runs (the
    engine's own seeds follow arrival order). None: the engine's."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{trajectory_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # below 2**63: the seeds a request may give


def _loop_time(deadline: float | None) -> float | None:
    """A `time.monotonic()` deadline on the event loop's clock (`asyncio.timeout_at`)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + deadline - time.monotonic()


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


async def _replay(
    env: Environment, fmt: ChatFormat, rollout: RolloutConfig, record: Trajectory, traj: Trajectory
) -> Finish | None:
    """Act again on each model turn of `record`; a finish if the episode ended there."""
    for start, end, _ in record.turn_spans():
        model_ids = record.token_ids[start:end]
        if traj.token_ids != record.token_ids[:start]:
            raise ReplayDiverged(f"turn {len(traj.turn_starts)}: the observation came out changed")
        cut = len(traj.turn_starts) in record.cut_turns
        traj.add_model_turn(model_ids, record.logprobs[start:end], record.versions[start:end], cut)
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
    cut = len(traj.turn_starts) - 1 in traj.cut_turns
    with raised_by(env, "model_turn"):
        env.model_turn(ModelTurn(traj.turn_starts[-1], len(model_ids), cut))
    step = environment_call(env, "step", env.step(fmt.text(model_ids)))
    with acting_for(traj.trajectory_id):  # an overrunning tool's warning names the trajectory
        result = await _within(step, rollout.step_timeout_s, f"{env.name}.step", "step_timeout_s")
    traj.tool_calls += result.tool_calls
    if result.done:
        return Finish.TURN_CAP if result.truncated else Finish.DONE
    obs = fmt.observation_ids(
        result.observation or "", model_ids, result.tool_responses, result.then
    )
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
    on_progress: Callable[[Trajectory], None],
    deadline: float | None,
) -> Finish:
    budget = rollout.max_episode_tokens
    while True:
        room = rollout.max_context - len(traj.token_ids)
        if room < 1:
            return Finish.CONTEXT_CAP
        left = room if budget is None else budget - traj.model_tokens
        if left < 1:
            return Finish.TOKEN_CAP
        requested = time.monotonic()
        if deadline is not None and requested >= deadline:
            return Finish.TIME_CAP
        max_tokens = min(rollout.max_tokens_per_turn, room, left)
        seed = turn_seed(sampling.seed, traj.trajectory_id, len(traj.turn_starts))
        params = dataclasses.replace(sampling, max_tokens=max_tokens, seed=seed)
        meta = TurnMeta(priority(), traj.trajectory_id, traj.group_id, rollout.tool_wait_pin_s)
        try:
            async with asyncio.timeout_at(_loop_time(deadline)) as cut:
                out = await generate(list(traj.token_ids), params, meta)
        except TimeoutError:
            if cut.expired():  # the episode's time ran out mid-turn: the turn is not kept
                return Finish.TIME_CAP
            raise
        traj.add_model_turn(
            out.token_ids, out.logprobs, out.weight_versions, out.finish_reason == "length"
        )
        on_progress(traj)
        generated = time.monotonic()
        finish = await _act(env, fmt, rollout, traj, out.token_ids)
        traj.turn_times.append(TurnTimes(requested, generated, time.monotonic()))
        if finish is not None:
            return finish
        on_progress(traj)
