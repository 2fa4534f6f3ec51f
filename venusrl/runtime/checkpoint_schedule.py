"""When a run writes a checkpoint: every `run.checkpoint_every` steps, or `run.checkpoint_every_s`
seconds after the last one if that comes first (a long run's steps can take minutes each), and
after its last step. The warm start's checkpoint (`step-start/`) is written apart, as it ends."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointSchedule:
    """A checkpoint follows step `s`, which ended at `now_s`, when

        (s + 1) % every_steps == 0  or  s == last_step  or  now_s - saved_s >= every_s

    `saved_s`: when the last checkpoint was written (to start with, when the run's steps began).
    Times are given, never read, so the same steps at the same times decide alike."""

    every_steps: int
    last_step: int
    every_s: float | None
    saved_s: float

    def due(self, step: int, now_s: float) -> bool:
        by_time = self.every_s is not None and now_s - self.saved_s >= self.every_s
        return (step + 1) % self.every_steps == 0 or step == self.last_step or by_time

    def saved(self, now_s: float) -> None:
        """A checkpoint was written at `now_s`: the next one by time is `every_s` after it."""
        self.saved_s = now_s
