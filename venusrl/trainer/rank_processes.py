"""The ranks as local processes (spawned, one pipe each): `trainer.world_size` without Ray. A
rank's death is seen on its process sentinel, whichever rank the driver is waiting on.

A tensor sent down a pipe moves to shared memory, and the receiver holds one file descriptor
per storage while the tensor lives (torch's `file_descriptor` sharing). The weights therefore
travel as flat buckets (one storage, one descriptor each), and the driver acknowledges each
bucket it takes, rank 0 sending at most `STREAM_AHEAD` ahead: a publish holds a few
descriptors and a few buckets of shared memory, whatever the model's size. (The `file_system`
strategy would hold no descriptors, but is process-wide and leaves files in /dev/shm behind a
killed process.)"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Collection
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from venusrl.trainer.rank_link import STREAM_AHEAD, Message, RankGone, RankJob
from venusrl.trainer.rank_server import RankServer


class ProcessRanks:
    """`RankLink` over `world_size` spawned processes; the rendezvous is a file store."""

    def __init__(self, job: RankJob, world_size: int) -> None:
        gpus = torch.cuda.device_count()
        if torch.device(job.config.device).type == "cuda" and gpus < world_size:
            raise ValueError(
                f"trainer.world_size={world_size} needs a GPU per rank; {gpus} visible"
            )
        self._scratch = Path(tempfile.mkdtemp(prefix="venusrl-ranks-"))
        self.init_method = f"file://{self._scratch / 'store'}"
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        try:
            for rank in range(world_size):
                ours, theirs = context.Pipe()
                self._conns.append(ours)
                process = context.Process(
                    target=_rank_main,
                    args=(job, rank, world_size, theirs),
                    name=f"venusrl-trainer-rank{rank}",
                )
                process.daemon = True  # never outlives the run
                process.start()
                theirs.close()
                self._processes.append(process)
        except BaseException:  # the ranks started so far and the store go too
            self.close(grace_s=0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def send(self, rank: int, command: str, args: tuple[Any, ...]) -> None:
        try:
            self._conns[rank].send((command, args))
        except OSError:
            raise self._gone(rank) from None

    def receive(self, ranks: Collection[int], timeout_s: float) -> tuple[int, Message] | None:
        conns = {self._conns[r]: r for r in ranks}
        sentinels = {p.sentinel: r for r, p in enumerate(self._processes)}
        ready = wait([*conns, *sentinels], timeout=timeout_s)
        for r in sorted(sentinels[s] for s in ready if s in sentinels):
            raise self._gone(r)
        if not ready:
            return None
        rank = min(conns[c] for c in ready if c in conns)
        try:
            message: Message = self._conns[rank].recv()
            if message[0] == "bucket":
                self._conns[rank].send(("ack", ()))
        except (EOFError, OSError):
            raise self._gone(rank) from None
        return rank, message

    def close(self, grace_s: float) -> None:
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

    def _gone(self, rank: int) -> RankGone:
        process = self._processes[rank]
        process.join(timeout=5)
        code = process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return RankGone(rank, f"(pid {process.pid}) died ({how})")


def _rank_main(job: RankJob, rank: int, world_size: int, conn: Connection) -> None:
    """One rank: runs the driver's commands until told to close (or the driver is gone)."""
    server = RankServer(job, rank, world_size)
    try:
        while True:
            try:
                command, args = conn.recv()
            except (EOFError, OSError):
                return  # the driver is gone
            if command == "close":
                return
            if command == "ack":  # of a bucket the stream no longer waited for
                continue
            ahead = 0
            for message in server.handle(command, args):
                conn.send(message)
                ahead += message[0] == "bucket"
                while ahead > STREAM_AHEAD:
                    try:
                        reply, _ = conn.recv()
                    except (EOFError, OSError):
                        return
                    if reply != "ack":  # told to close mid-stream
                        return
                    ahead -= 1
    finally:
        server.close()
        conn.close()
