"""What a run asks of its trainer, in the driver's process (`GRPOTrainer`) or as sharded ranks
(`RankedTrainer`, `trainer.world_size` > 1): steps, the warm start's imitation, the KL reference,
its weights for the engines and its checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from venusrl.model.weight_stream import WeightStream
from venusrl.trainer.checkpoint import RunState
from venusrl.trainer.trainer import StepStats
from venusrl.types import Trajectory


class Trainer(Protocol):
    version: int  # of the weights it holds

    def step(
        self, trajectories: Sequence[Trajectory], advantages: Sequence[float]
    ) -> StepStats: ...

    def imitation_step(self, trajectories: Sequence[Trajectory], lr: float) -> float: ...

    def use_reference(self, model_dir: Path) -> None:
        """The KL penalty's reference policy: the model of `model_dir`, frozen."""
        ...

    def hf_weights(self) -> WeightStream:
        """The weights under Hugging Face names, announced, then one tensor at a time (an
        engine's update)."""
        ...

    def write_model_dir(self, out: Path, like: Path) -> None:
        """The weights as a Hugging Face model directory, with `like`'s config and tokenizer."""
        ...

    def save_checkpoint(self, run_dir: Path, state: RunState, model_dir: Path) -> Path: ...

    def close(self) -> None: ...
