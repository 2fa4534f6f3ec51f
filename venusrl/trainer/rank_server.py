"""One trainer rank's side of the driver's protocol, whatever carries it (a local process's pipe,
a Ray actor's calls): it joins the group, loads its shard, and answers each command with a
stream of messages, `("bucket", Bucket)` from rank 0 while it publishes (the weights packed a
bucket at a time, `trainer.publish_bucket_mib`), then one `("ok", result)` or
`("error", traceback)`. `start`'s result is the weights' manifest (rank 0's)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from venusrl.model.weight_stream import Spec, pack
from venusrl.trainer.checkpoint import SHARDED
from venusrl.trainer.rank_link import Message, RankJob


class RankServer:
    """Rank `rank` of `world_size`. Its first command is `start(init_method)` (torch.distributed's
    rendezvous); every later one is collective: all ranks get it, in the same order."""

    def __init__(self, job: RankJob, rank: int, world_size: int) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self._commands: dict[str, Callable[..., Any]] = {"start": self._start}
        torch.set_num_threads(job.config.rank_threads)

    def handle(self, command: str, args: tuple[Any, ...]) -> Iterator[Message]:
        try:
            result = self._commands[command](*args)
            if isinstance(result, Iterator):  # a stream (the weights), then its end
                yield from result
                result = None
        except Exception:
            yield "error", f"{traceback.format_exc()}(pid {os.getpid()})"
            return
        yield "ok", result

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _start(self, init_method: str) -> dict[str, Spec]:
        from venusrl.trainer.sharded import ShardedTrainer  # FSDP only where a rank runs

        config = self.job.config
        cuda = torch.device(config.device).type == "cuda"
        # The rank's own GPU: local ranks see every GPU of the machine, a Ray actor only the one
        # its placement bundle holds (CUDA_VISIBLE_DEVICES).
        device = torch.device("cuda", self.rank % torch.cuda.device_count()) if cuda else None
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(
            # gloo beside NCCL on CUDA: host tensors (offloaded shards, a step's counts) reduce
            # too.
            "cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=config.rank_timeout_s),
        )
        job = self.job
        trainer = ShardedTrainer.load(
            job.model_dir,
            config,
            device or torch.device("cpu"),
            job.version,
            job.temperature,
            job.resume,
        )

        def weights() -> Iterator[Message]:
            gathered = trainer.hf_weights()
            if self.rank != 0:
                for _ in gathered:  # the gathers are collective
                    pass
                return
            bucket_bytes = int(config.publish_bucket_mib * 2**20)
            for bucket in pack(gathered, bucket_bytes):
                yield "bucket", bucket

        def save(out: Path, like: Path) -> None:
            trainer.save_sharded(out / SHARDED)
            trainer.write_model_dir(out, like)

        self._commands.update(
            {
                "step": trainer.train_rows,
                "imitate": trainer.imitate_rows,
                "use_reference": trainer.use_reference,
                "freeze_reference": lambda: trainer.freeze_reference() and None,  # model stays
                "weights": weights,
                "write_model_dir": trainer.write_model_dir,
                "save": save,
            }
        )
        return trainer.model.hf_manifest()
