"""The driver's line to the trainer ranks, whatever runs them (local processes, Ray actors):
the protocol `RankedTrainer` drives, what each rank loads, and how a dead rank is reported."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from venusrl.trainer.config import TrainerConfig

# ("bucket", Bucket) while rank 0 publishes; then ("ok", result) or ("error", traceback)
Message = tuple[str, Any]
# Buckets rank 0 may send ahead of the one the driver has taken: the publish stays a stream,
# a few buckets in flight whatever the model's size (both links hold to it).
STREAM_AHEAD = 2


@dataclass(frozen=True)
class RankJob:
    """What every rank loads: the model (its optimizer state too, on `resume`), how it trains."""

    model_dir: Path
    config: TrainerConfig
    version: int
    temperature: float
    resume: bool


class RankGone(Exception):
    """Rank `rank` is dead; `how` says who it was and how it ended, `detail` what else its
    launcher knows (Ray's account of the actor's death), for the user."""

    def __init__(self, rank: int, how: str, detail: str = "") -> None:
        super().__init__(f"trainer rank {rank} {how}")
        self.rank, self.how, self.detail = rank, how, detail


class RankLink(Protocol):
    """The driver's line to the ranks, whatever runs them. `send` and `receive` raise `RankGone`
    for a rank that died (any rank's death ends a `receive`: the others would wait on it in a
    collective)."""

    init_method: str  # torch.distributed's rendezvous, the argument of the first command

    def send(self, rank: int, command: str, args: tuple[Any, ...]) -> None: ...

    def receive(self, ranks: Collection[int], timeout_s: float) -> tuple[int, Message] | None:
        """The next message of whichever of `ranks` sends first, and its rank; None if none
        came within `timeout_s`. Any of them, not one in turn: a rank that fails while another
        waits for it in a collective must be heard at once, not after the other's timeout."""
        ...

    def close(self, grace_s: float) -> None:
        """Stop the ranks: told, then ended after `grace_s`."""
        ...


Launch = Callable[[RankJob, int], RankLink]  # the job and the world size -> the ranks, started
