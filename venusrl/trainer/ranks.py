"""The trainer as N processes in one torch.distributed group (`trainer.world_size`), driven from
the run's process: `RankedTrainer` has the in-process trainer's verbs; each call sends every
rank its share of the batch (rows balanced by tokens) and waits for all of them.

Every wait is bounded (`trainer.rank_timeout_s`) and watches the ranks' process sentinels: a rank
that dies stops the run with an error that names it, instead of the others waiting in a
collective for ever.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from venusrl.trainer.checkpoint import SHARDED, RunState, commit_checkpoint
from venusrl.trainer.config import TrainerConfig
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


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    store: str  # torch.distributed's init_method
    model_dir: Path
    config: TrainerConfig
    version: int
    temperature: float
    resume: bool


class RankedTrainer:
    """`trainer.world_size` ranks sharding the model of `model_dir` with FSDP2; with `resume`
    (`model_dir` a checkpoint with `sharded/`), its weights and optimizer state."""

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        version: int = 0,
        temperature: float = 1.0,
        resume: bool = False,
    ) -> None:
        if resume and not (model_dir / SHARDED).is_dir():
            raise ValueError(
                f"{model_dir} has no {SHARDED}/ (written by trainer.world_size=1?): a sharded"
                " trainer resumes from a sharded checkpoint only"
            )
        gpus = torch.cuda.device_count()
        if torch.device(config.device).type == "cuda" and gpus < config.world_size:
            raise ValueError(
                f"trainer.world_size={config.world_size} needs a GPU per rank; {gpus} visible"
            )
        self.config, self.version = config, version
        self._has_reference = False
        self._lock = threading.Lock()  # one command at a time
        self._scratch = Path(tempfile.mkdtemp(prefix="venusrl-ranks-"))
        store = f"file://{self._scratch / 'store'}"
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        for rank in range(config.world_size):
            spec = _RankSpec(
                rank, config.world_size, store, model_dir, config, version, temperature, resume
            )
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(spec, theirs), name=f"venusrl-trainer-rank{rank}"
            )
            process.daemon = True  # never outlives the run
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)
        try:
            self._call("start", [()] * config.world_size)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

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

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under Hugging Face names, gathered by the ranks one parameter at a time
        and streamed from rank 0 (in shared memory): never a whole copy on the ranks' side."""
        with self._lock:
            self._send_all("weights", [()] * self.config.world_size)
            done = False
            try:
                while not done:
                    kind, payload = self._reply(0, "weights")
                    if kind == "weight":
                        yield payload
                    else:
                        done = True
            finally:
                while not done:  # a consumer that stopped early: the stream ends all the same
                    done = self._reply(0, "weights")[0] != "weight"
                for rank in range(1, self.config.world_size):
                    self._reply(rank, "weights")

    def write_model_dir(self, out: Path, like: Path) -> None:
        """The consolidated Hugging Face model directory, written by rank 0."""
        self._call("write_model_dir", [(out, like)] * self.config.world_size)

    def save_checkpoint(self, run_dir: Path, state: RunState, model_dir: Path) -> Path:
        """The sharded checkpoint (`torch.distributed.checkpoint`) and the consolidated model."""

        def write(tmp: Path) -> None:
            self._call("save", [(tmp, model_dir)] * self.config.world_size)

        return commit_checkpoint(run_dir, state, model_dir, write)

    def close(self, grace_s: float = 10.0) -> None:
        """Stops the ranks (told, then ended after `grace_s`) and removes the store."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # that rank is gone
                conn.send(("close", ()))
        for process in self._processes:
            process.join(timeout=grace_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _call(self, command: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """`command` on every rank, with its own arguments; their results, by rank."""
        with self._lock:
            self._send_all(command, args)
            return [self._reply(rank, command)[1] for rank in range(self.config.world_size)]

    def _send_all(self, command: str, args: list[tuple[Any, ...]]) -> None:
        for rank, (conn, arg) in enumerate(zip(self._conns, args, strict=True)):
            try:
                conn.send((command, arg))
            except OSError:
                raise self._failure(rank, command) from None

    def _reply(self, rank: int, command: str) -> tuple[str, Any]:
        """Rank `rank`'s next message, while every rank lives, within the timeout."""
        conn = self._conns[rank]
        sentinels = {p.sentinel: r for r, p in enumerate(self._processes)}
        ready = wait([conn, *sentinels], timeout=self.config.rank_timeout_s)
        for r in sorted(sentinels[s] for s in ready if s in sentinels):
            raise self._failure(r, command)
        if not ready:
            self.close()
            raise RankFailed(
                f"trainer rank {rank} did not answer {command!r} within"
                f" trainer.rank_timeout_s={self.config.rank_timeout_s:g} s; the ranks are stopped"
            )
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            raise self._failure(rank, command) from None
        if kind == "error":
            self.close()
            raise RankFailed(f"trainer rank {rank} failed in {command!r}:\n{payload}")
        return kind, payload

    def _failure(self, rank: int, command: str) -> RankFailed:
        """The error of rank `rank` gone (the others are stopped)."""
        process = self._processes[rank]
        process.join(timeout=5)
        code = process.exitcode
        self.close(grace_s=0)  # the others wait on it in a collective: no use waiting on them
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return RankFailed(
            f"trainer rank {rank} (pid {process.pid}) died ({how}) during {command!r}; the"
            " other ranks are stopped"
        )


def _rank_main(spec: _RankSpec, conn: Connection) -> None:
    """One rank: joins the group, loads its shard, then runs the driver's commands until told
    to close (or the driver is gone)."""
    config = spec.config
    torch.set_num_threads(config.rank_threads)
    cuda = torch.device(config.device).type == "cuda"
    device = torch.device("cuda", spec.rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=spec.store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=config.rank_timeout_s),
    )
    try:
        _serve(spec, device, conn)
    finally:
        dist.destroy_process_group()
        conn.close()


def _serve(spec: _RankSpec, device: torch.device, conn: Connection) -> None:
    from venusrl.trainer.sharded import ShardedTrainer  # FSDP only where a rank runs

    try:
        trainer = ShardedTrainer.load(
            spec.model_dir, spec.config, device, spec.version, spec.temperature, spec.resume
        )
    except Exception:  # the answer to the driver's first command, "start"
        conn.send(("error", f"{traceback.format_exc()}(pid {os.getpid()})"))
        return

    def weights() -> None:
        for name, tensor in trainer.hf_weights():
            if spec.rank == 0:  # the others took part in the gather
                conn.send(("weight", (name, tensor.cpu())))

    def save(out: Path, like: Path) -> None:
        trainer.save_sharded(out / SHARDED)
        trainer.write_model_dir(out, like)

    commands: dict[str, Callable[..., Any]] = {
        "start": lambda: None,  # loaded above: the driver's first call waits for it
        "step": trainer.train_rows,
        "imitate": trainer.imitate_rows,
        "use_reference": trainer.use_reference,
        "freeze_reference": lambda: trainer.freeze_reference() and None,  # the model stays
        "weights": weights,
        "write_model_dir": trainer.write_model_dir,
        "save": save,
    }
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if command == "close":
            return
        try:
            result = commands[command](*args)
        except Exception:
            conn.send(("error", f"{traceback.format_exc()}(pid {os.getpid()})"))
            continue
        conn.send(("ok", result))
