"""The trainer as N ranks in one torch.distributed group (`trainer.world_size`), driven from the
run's process: `RankedTrainer` has the in-process trainer's verbs; each call sends every rank its
share of the batch (rows balanced by tokens) and waits for all of them. What carries the commands
is a `RankLink`: local processes (`trainer/rank_processes.py`) or Ray actors in a placement group
(`runtime/cluster/trainer_actors.py`); the ranks' side is `RankServer` either way.

Every wait is bounded (`trainer.rank_timeout_s`) and watches every rank: a rank that dies stops
the run with an error that names it, instead of the others waiting in a collective for ever.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from venusrl.model.weight_stream import WeightStream
from venusrl.trainer.checkpoint import SHARDED, RunState, commit_checkpoint
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.rank_link import Launch, Message, RankGone, RankJob
from venusrl.trainer.rank_processes import ProcessRanks
from venusrl.trainer.trainer import StepStats, _Row, weighted_rows
from venusrl.types import Trajectory


class RankFailed(RuntimeError):
    """A trainer rank died, failed or did not answer in time: the run cannot go on."""


def token_shares(rows: Sequence[_Row], ranks: int) -> list[list[_Row]]:
    """`rows` dealt to `ranks` shares of nearly equal tokens (longest first, each to the
    lightest share: within 4/3 of the best split, Graham 1969), in their order within a share."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks)]
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i][0].token_ids)):
        tokens, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (tokens + len(rows[i][0].token_ids), r))
    return [[rows[i] for i in sorted(share)] for share in shares]


class RankedTrainer:
    """`trainer.world_size` ranks sharding the model of `model_dir` with FSDP2; with `resume`
    (`model_dir` a checkpoint with `sharded/`), its weights and optimizer state. `launch` starts
    them: local processes by default."""

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        version: int = 0,
        temperature: float = 1.0,
        resume: bool = False,
        launch: Launch = ProcessRanks,
    ) -> None:
        if resume and not (model_dir / SHARDED).is_dir():
            raise ValueError(
                f"{model_dir} has no {SHARDED}/ (written by trainer.world_size=1?): a sharded"
                " trainer resumes from a sharded checkpoint only"
            )
        self.config, self.version = config, version
        self._has_reference = False
        self._lock = threading.Lock()  # one command at a time
        self._closed = False
        job = RankJob(model_dir, config, version, temperature, resume)
        self.link = launch(job, config.world_size)
        try:
            self.manifest = self._call("start", [(self.link.init_method,)] * config.world_size)[0]
        except BaseException:
            self.close()
            raise

    def step(self, trajectories: Sequence[Trajectory], advantages: Sequence[float]) -> StepStats:
        """`GRPOTrainer.step`, each rank training its share of the rows."""
        if len(trajectories) != len(advantages):
            raise ValueError("one advantage per trajectory")
        if self.config.kl_coef and not self._has_reference:
            # As in one process, the weights the first step starts from.
            self._call("freeze_reference", [()] * self.config.world_size)
            self._has_reference = True
        rows = weighted_rows(trajectories, advantages, self.config.loss_aggregation)
        total = sum(t.model_tokens for t, _, _ in rows)
        shares = token_shares(rows, self.config.world_size)
        stats: StepStats = self._call("step", [(s, total, len(rows)) for s in shares])[0]
        self.version = stats.version
        return stats

    def imitation_step(self, trajectories: Sequence[Trajectory], lr: float) -> float:
        """`GRPOTrainer.imitation_step`, each rank imitating its share of the rows."""
        rows = [(t, 0.0, 1.0) for t in trajectories if t.model_tokens]
        total = sum(t.model_tokens for t, _, _ in rows)
        shares = token_shares(rows, self.config.world_size)
        return float(self._call("imitate", [(s, total, lr) for s in shares])[0])

    def use_reference(self, model_dir: Path) -> None:
        self._call("use_reference", [(model_dir,)] * self.config.world_size)
        self._has_reference = True

    def hf_weights(self) -> WeightStream:
        """The weights under Hugging Face names, gathered by the ranks one parameter at a time
        and streamed from rank 0 in buckets, a few in flight (`STREAM_AHEAD`): never a whole
        copy on the ranks' side, nor in this process while the consumer lets each tensor go."""
        return WeightStream(self.manifest, self._streamed())

    def _streamed(self) -> Iterator[tuple[str, torch.Tensor]]:
        with self._lock:
            self._send_all("weights", [()] * self.config.world_size)
            pending = set(range(self.config.world_size))
            try:
                while pending:
                    rank, (kind, payload) = self._reply(pending, "weights")
                    if kind == "bucket":
                        yield from payload.unpack()
                    else:
                        pending.discard(rank)
            except GeneratorExit:  # a consumer that stopped early: the stream ends all the same
                while pending:
                    rank, (kind, _) = self._reply(pending, "weights")
                    if kind != "bucket":
                        pending.discard(rank)
                raise

    def write_model_dir(self, out: Path, like: Path) -> None:
        """The consolidated Hugging Face model directory, written by rank 0."""
        self._call("write_model_dir", [(out, like)] * self.config.world_size)

    def save_checkpoint(self, run_dir: Path, state: RunState, model_dir: Path) -> Path:
        """The sharded checkpoint (`torch.distributed.checkpoint`, every rank its shards) and
        the consolidated model (rank 0), in `run_dir`: every rank must see it, as its own
        disk or a shared filesystem."""

        def write(tmp: Path) -> None:
            self._call("save", [(tmp, model_dir)] * self.config.world_size)

        return commit_checkpoint(run_dir, state, model_dir, write)

    def close(self, grace_s: float = 10.0) -> None:
        if not self._closed:
            self._closed = True
            self.link.close(grace_s)

    def _call(self, command: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """`command` on every rank, with its own arguments; their results, by rank."""
        with self._lock:
            self._send_all(command, args)
            results: dict[int, Any] = {}
            while len(results) < self.config.world_size:
                pending = set(range(self.config.world_size)) - set(results)
                rank, (_, results[rank]) = self._reply(pending, command)
            return [results[rank] for rank in range(self.config.world_size)]

    def _send_all(self, command: str, args: list[tuple[Any, ...]]) -> None:
        try:
            for rank, arg in enumerate(args):
                self.link.send(rank, command, arg)
        except RankGone as e:
            raise self._failure(e, command) from None

    def _reply(self, ranks: set[int], command: str) -> tuple[int, Message]:
        """The next message of any of `ranks`, and its rank, while every rank lives, within the
        timeout; a rank's error ends the command at once (the others may be waiting for it in a
        collective)."""
        try:
            received = self.link.receive(ranks, self.config.rank_timeout_s)
        except RankGone as e:
            raise self._failure(e, command) from None
        if received is None:
            self.close()
            which = ", ".join(map(str, sorted(ranks)))
            raise RankFailed(
                f"trainer ranks {which} did not answer {command!r} within"
                f" trainer.rank_timeout_s={self.config.rank_timeout_s:g} s; the ranks are stopped"
            )
        rank, (kind, payload) = received
        if kind == "error":
            self.close(grace_s=0)  # the others may be stuck in a collective with it
            raise RankFailed(f"trainer rank {rank} failed in {command!r}:\n{payload}")
        return rank, (kind, payload)

    def _failure(self, gone: RankGone, command: str) -> RankFailed:
        self.close(grace_s=0)  # the others wait on it in a collective: no use waiting on them
        detail = f"\n{gone.detail}" if gone.detail else ""
        return RankFailed(f"{gone} during {command!r}; the other ranks are stopped{detail}")
