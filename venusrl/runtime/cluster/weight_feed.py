"""A rollout worker's side of a bucketed publish: buckets handed from the actor's event loop to
its engine's thread one at a time, each call answering once the engine has copied the bucket
(or with the load's error), so that the worker holds one bucket and the object store can let
each go as soon as every worker has it."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator

import torch

from venusrl.model.weight_stream import Bucket, Spec, WeightStream
from venusrl.runtime.engines import LocalEngine


class WeightFeed:
    """One update of `engine`'s weights to version `version`, its tensors still to come."""

    def __init__(self, engine: LocalEngine, manifest: dict[str, Spec], version: int,
                 timeout_s: float) -> None:  # fmt: skip
        """`timeout_s`: the longest the engine waits for the next bucket before it gives the
        update up (its weights then torn: it runs nothing until a whole set loads)."""
        self._loop = asyncio.get_running_loop()
        self._buckets: queue.Queue[Bucket | BaseException | None] = queue.Queue()
        self._asks: asyncio.Queue[None] = asyncio.Queue()  # the engine wants the next bucket
        self._timeout_s = timeout_s
        stream = WeightStream(manifest, self._tensors())
        self._loading = asyncio.ensure_future(engine.load_weights(stream, version))

    async def started(self) -> None:
        """Once the engine has accepted the manifest, or its refusal."""
        await self._asked()

    async def give(self, bucket: Bucket) -> None:
        """Once the engine has copied `bucket`, or the load's error."""
        self._buckets.put(bucket)
        await self._asked()

    async def end(self, broke: str | None = None) -> None:
        """The stream ends: whole (the load's outcome), or broken, `broke` saying how (the
        engine's weights are torn if it had copied any)."""
        self._buckets.put(None if broke is None else RuntimeError(f"the publish broke: {broke}"))
        await self._loading

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:  # on the engine's thread
        while True:
            self._loop.call_soon_threadsafe(self._asks.put_nowait, None)
            try:
                item = self._buckets.get(timeout=self._timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no weights came for {self._timeout_s:g} s") from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item.unpack()

    async def _asked(self) -> None:
        ask = asyncio.ensure_future(self._asks.get())
        await asyncio.wait({ask, self._loading}, return_when=asyncio.FIRST_COMPLETED)
        if not ask.done():
            ask.cancel()
            await self._loading  # its error
            raise RuntimeError("the engine's update ended before the stream did")
