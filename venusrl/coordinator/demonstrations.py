"""Demonstrations for the warm start: scripted text policies played through token ids.

`ScriptedGenerate` stands where the engine stands in the agent loop: it decodes what is new in
the token record (the observation), asks the trajectory's text policy for its next turn, and
returns that turn's tokens closed with the end-of-turn token. Episodes it plays are ordinary
token records, so the warm start trains on exactly the format reinforcement learning then samples.
Text policies write their calls in the Hermes format (`tool_calls.format_tool_call`); they are
rewritten in the model's own (`ToolParser.format_call`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from venusrl.model.tokenizer import Tokenizer
from venusrl.model.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN, ToolCall
from venusrl.model.tool_formats import ToolParser, tool_parser
from venusrl.types import GenerationOutput, SamplingParams, Trajectory, TurnMeta

TextPolicy = Callable[[str], str]


class ScriptedGenerate:
    def __init__(
        self,
        tokenizer: Tokenizer,
        policies: dict[str, TextPolicy],
        parser: ToolParser | None = None,
    ) -> None:
        """`policies`: one text policy per trajectory id; `parser`: the model's tool-call format
        (default Hermes, the policies' own)."""
        self.tokenizer = tokenizer
        self.policies = policies
        self.parser = parser or tool_parser("hermes")
        self._seen: dict[str, int] = {}
        self._end = list(tokenizer.eos_token_ids)

    async def __call__(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        tid = str(meta.trajectory_id)
        start = self._seen.get(tid, len(prompt_ids))
        new = self.tokenizer.decode(prompt_ids[start:], skip_special_tokens=True)
        if RESPONSE_OPEN in new:  # the tool responses, without the chat template around them
            new = new[new.index(RESPONSE_OPEN) : new.rindex(RESPONSE_CLOSE) + len(RESPONSE_CLOSE)]
        turn = in_format(self.policies[tid](new.strip()), self.parser)
        ids = self.tokenizer.encode(turn) + self._end
        if len(ids) > params.max_tokens:
            # Cut, it would teach a malformed turn; kept, one the model may never sample.
            raise ValueError(
                f"a demonstration turn of {len(ids)} tokens does not fit the {params.max_tokens}"
                " the model may write (rollout.max_tokens_per_turn, or the context left)"
            )
        self._seen[tid] = len(prompt_ids) + len(ids)
        n = len(ids)
        return GenerationOutput(tid, list(prompt_ids), ids, [0.0] * n, [0] * n, "stop", 0)


def in_format(text: str, parser: ToolParser) -> str:
    """A text policy's turn with its Hermes calls written in `parser`'s format: the text before
    the first call as it is, then the calls (on separate lines, or `;`-separated where the
    format reads them so)."""
    hermes = tool_parser("hermes")
    parsed = hermes.parse(text)
    if parser.name == hermes.name or not parsed:
        return text
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    if len(calls) < len(parsed):
        raise ValueError(f"a demonstration turn has a malformed tool call: {text!r}")
    head = text[: hermes.call_start(text)]
    written = [parser.format_call(c.name, c.arguments) for c in calls]
    for separator in ("\n", "; "):
        turn = head + separator.join(written)
        if [getattr(c, "name", None) for c in parser.parse(turn)] == [c.name for c in calls]:
            return turn
    raise ValueError(
        f"a demonstration turn cannot be written in the {parser.name} format: {text!r}"
    )


def retokenize(traj: Trajectory, old: Tokenizer, new: Tokenizer) -> Trajectory:
    """The same episode in another tokenizer's ids. Each piece (the prompt, every model turn,
    every observation) is decoded and encoded on its own, which is how the agent loop encodes
    them, so the record is the one playing the episode with `new` would have produced."""

    def piece(start: int, end: int) -> list[int]:
        return new.encode(old.decode(traj.token_ids[start:end], skip_special_tokens=False))

    out = Trajectory.start(
        traj.trajectory_id, traj.group_id, traj.prompt_id, piece(0, traj.prompt_len)
    )
    bounds = [*traj.turn_starts, len(traj.token_ids)]
    for start, next_turn in itertools.pairwise(bounds):
        end = start
        while end < next_turn and traj.mask[end]:
            end += 1
        ids = piece(start, end)
        version = traj.versions[start]
        out.add_model_turn(ids, [0.0] * len(ids), [version] * len(ids))
        if end < next_turn:
            out.add_observation(piece(end, next_turn))
    out.tool_calls, out.reward = traj.tool_calls, traj.reward
    out.finish, out.failure = traj.finish, traj.failure
    return out
