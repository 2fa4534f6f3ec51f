"""Demonstrations for the warm start: scripted text policies played through token ids.

`ScriptedGenerate` stands where the engine stands in the agent loop: it decodes what is new in
the token record (the observation), asks the trajectory's text policy for its next turn, and
returns that turn's tokens closed with the end-of-turn token. Episodes it plays are ordinary
token records, so the warm start trains on exactly the format reinforcement learning then samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from venusrl.engine.tokenizer import Tokenizer
from venusrl.envs.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN
from venusrl.types import GenerationOutput, SamplingParams, Trajectory, TurnMeta

TextPolicy = Callable[[str], str]


class ScriptedGenerate:
    def __init__(self, tokenizer: Tokenizer, policies: dict[str, TextPolicy]) -> None:
        """`policies`: one text policy per trajectory id."""
        self.tokenizer = tokenizer
        self.policies = policies
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
        ids = self.tokenizer.encode(self.policies[tid](new.strip())) + self._end
        if len(ids) > params.max_tokens:
            # Cut, it would teach a malformed turn; kept, one the model may never sample.
            raise ValueError(
                f"a demonstration turn of {len(ids)} tokens does not fit the {params.max_tokens}"
                " the model may write (rollout.max_tokens_per_turn, or the context left)"
            )
        self._seen[tid] = len(prompt_ids) + len(ids)
        n = len(ids)
        return GenerationOutput(tid, list(prompt_ids), ids, [0.0] * n, [0] * n, "stop", 0)


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
