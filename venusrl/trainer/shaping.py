"""Overlong shaping (DAPO's, Yu et al. 2025): a soft penalty on the reward of a trajectory whose
model tokens run into a buffer before the length limit, growing linearly to `penalty` at the limit,
and, apart from it, trajectories cut at a length limit masked from the loss (their reward says
how far they got, not whether they would have solved it). Both are off by default. Pure: the
runtime shapes a batch's rewards with it before their advantages; the record keeps the raw ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from venusrl.types import Finish, Trajectory

# Where an episode stops for its length: the model's tokens for it, or the context window.
TRUNCATED = frozenset({Finish.TOKEN_CAP, Finish.CONTEXT_CAP})


@dataclass(frozen=True)
class Overlong:
    limit: int | None = None  # model tokens of a trajectory, at most
    buffer: int = 0  # the last tokens before `limit` over which the penalty grows (0: none)
    penalty: float = 1.0  # at the limit
    mask_truncated: bool = False

    @property
    def on(self) -> bool:
        return bool(self.buffer) or self.mask_truncated

    def penalty_of(self, model_tokens: int) -> float:
        """What a trajectory of `model_tokens` loses: 0 up to `limit - buffer`, then linearly
        down to `-penalty` at the limit (and past it)."""
        if not self.buffer or self.limit is None:
            return 0.0
        over = model_tokens - (self.limit - self.buffer)
        return -self.penalty * min(over / self.buffer, 1.0) if over > 0 else 0.0

    def masked(self, traj: Trajectory) -> bool:
        """Left out of the loss: a scored trajectory cut at a length limit (`mask_truncated`)."""
        return self.mask_truncated and traj.reward is not None and traj.finish in TRUNCATED

    def reward(self, traj: Trajectory) -> float | None:
        """The reward the advantages are taken from (None: not trained on)."""
        if traj.reward is None or self.masked(traj):
            return None
        return traj.reward + self.penalty_of(traj.model_tokens)
