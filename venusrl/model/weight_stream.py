"""Weights on their way into a model: announced, then streamed. The manifest (every tensor's
name, shape and dtype, which a sender knows without holding a weight) comes first, so that the
receiver refuses a bad set before it copies anything, then holds one tensor at a time
(`CausalLM.load_weights`). Where they cross a process they travel packed in flat buckets of a
bounded size: one shared-memory segment or object-store object per bucket, not per tensor."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

ALIGN_BYTES = 64  # every tensor of a bucket starts at a multiple: a view of any dtype is aligned


class Spec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def spec(tensor: torch.Tensor) -> Spec:
    return Spec(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class WeightStream:
    """Hugging Face-named tensors, each once, in any order; `manifest` names every one of them
    before the first arrives. Iterating it reads `tensors` (once, for a generator)."""

    manifest: dict[str, Spec]
    tensors: Iterable[tuple[str, torch.Tensor]]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    def close(self) -> None:
        """A reader that stops early ends the source too (sharded ranks then finish their
        gathers and wait for the next command, rather than for a reader that has gone)."""
        close = getattr(self.tensors, "close", None)
        if close is not None:
            close()

    @classmethod
    def whole(cls, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightStream:
        """A set already in memory (a state dict, a test's), its own manifest."""
        held = dict(weights)
        return cls({name: spec(t) for name, t in held.items()}, held.items())


@dataclass(frozen=True)
class Bucket:
    """Tensors packed into one flat byte tensor, `entries` saying where: (name, spec, offset)."""

    data: torch.Tensor
    entries: list[tuple[str, Spec, int]]

    def unpack(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, as views into `data` (they keep the bucket alive while they live)."""
        for name, (shape, dtype), offset in self.entries:
            size = torch.Size(shape).numel() * dtype.itemsize
            yield name, self.data[offset : offset + size].view(dtype).view(shape)


def pack(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Generator[Bucket, None, None]:
    """`tensors` in order, packed into host-memory buckets of at most `bucket_bytes` (a larger
    tensor is a bucket of its own). Lazy: it holds the tensors of one bucket at a time."""
    held: list[tuple[str, torch.Tensor, int]] = []
    end = 0
    try:
        for name, tensor in tensors:
            offset = -(-end // ALIGN_BYTES) * ALIGN_BYTES
            if held and offset + tensor.nbytes > bucket_bytes:
                yield _packed(held, end)
                held, offset = [], 0
            held.append((name, tensor, offset))
            end = offset + tensor.nbytes
        if held:
            yield _packed(held, end)
    finally:  # closed early (a publish that failed): the source ends too
        close = getattr(tensors, "close", None)
        if close is not None:
            close()


def _packed(held: list[tuple[str, torch.Tensor, int]], size: int) -> Bucket:
    data = torch.empty(size, dtype=torch.uint8)
    entries = []
    for name, tensor, offset in held:
        entry = (name, spec(tensor), offset)
        entries.append(entry)
        view = data[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())  # from the device too
    return Bucket(data, entries)
