"""Weights announced, then streamed into a running engine: a bad set is refused before anything
is copied, a good one is copied a tensor at a time, and a stream that breaks midway never
passes for a version."""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import GREEDY, engine_for
from venusrl.engine.engine import Engine
from venusrl.model.architecture import ModelConfigError, TornWeights
from venusrl.model.weight_stream import Spec, WeightStream, pack, spec


def other_weights(engine: Engine, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=g) * 0.5
        for name, t in engine.model.hf_state_dict().items()
    }


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.hf_state_dict().items()}


def assert_weights(engine: Engine, expected: dict[str, torch.Tensor]) -> None:
    got = engine.model.hf_state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "bad",
    ["a wrong shape", "a weight missing", "an unexpected weight", "an integer dtype"],
)
def test_a_refused_manifest_leaves_the_engine_weights_and_version_unchanged(
    tiny_qwen3: Path, bad: str
) -> None:
    engine = engine_for(tiny_qwen3)
    before = snapshot(engine)
    weights = other_weights(engine)
    manifest = {name: spec(t) for name, t in weights.items()}
    first = next(iter(manifest))
    if bad == "a wrong shape":
        manifest[first] = Spec((3, 3), torch.float32)
    elif bad == "a weight missing":
        del manifest[first]
    elif bad == "an unexpected weight":
        manifest["model.layers.99.mlp.up_proj.weight"] = Spec((1,), torch.float32)
    else:
        manifest[first] = Spec(manifest[first].shape, torch.int64)

    def never_read() -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("a refused update reads no tensor")
        yield  # a generator

    named = "layers.99" if bad == "an unexpected weight" else first
    with pytest.raises(ModelConfigError, match=re.escape(named)):
        engine.update_weights(WeightStream(manifest, never_read()), version=7)
    assert engine.weight_version == 0
    assert_weights(engine, before)
    assert engine.generate([list(range(10, 20))], GREEDY)[0].token_ids  # it still serves


def test_the_engine_copies_each_tensor_as_it_arrives_and_holds_none_of_the_earlier(
    tiny_qwen3: Path,
) -> None:
    engine = engine_for(tiny_qwen3)
    weights = other_weights(engine)
    sent: list[weakref.ref[torch.Tensor]] = []

    def streamed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights.items():
            assert all(r() is None for r in sent), "an earlier tensor is still held"
            fresh = tensor.clone()  # the sender's copy: the engine's to drop
            sent.append(weakref.ref(fresh))
            yield name, fresh
            del fresh

    manifest = {name: spec(t) for name, t in weights.items()}
    assert engine.update_weights(WeightStream(manifest, streamed()), version=4) == 4
    assert len(sent) == len(weights)
    assert_weights(engine, weights)


@pytest.mark.parametrize("how", ["its source fails", "it ends short", "a tensor is not as said"])
def test_a_stream_broken_midway_keeps_the_version_and_the_engine_refuses_to_run_until_a_whole_set(
    tiny_qwen3: Path, how: str
) -> None:
    engine = engine_for(tiny_qwen3, cuda_graphs=True)  # eager on CPU: the graphs' path too
    prompt = list(range(10, 20))
    weights = other_weights(engine)
    manifest = {name: spec(t) for name, t in weights.items()}

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(weights.items()):
            if i == 3:
                if how == "its source fails":
                    raise ConnectionError("trainer rank 1 died")
                if how == "it ends short":
                    return
                tensor = tensor.to(torch.float64)
            yield name, tensor

    error = {"its source fails": ConnectionError, "it ends short": ModelConfigError}
    with pytest.raises(error.get(how, ModelConfigError)):
        engine.update_weights(WeightStream(manifest, broken()), version=5)
    assert engine.weight_version == 0
    with pytest.raises(TornWeights, match=r"broke after 3 of \d+ tensors"):
        engine.generate([prompt], GREEDY)
    # A whole set makes it whole again, and it serves those weights.
    engine.update_weights(WeightStream(manifest, iter(weights.items())), version=6)
    fresh = engine_for(tiny_qwen3)
    fresh.update_weights(weights.items())
    assert engine.weight_version == 6
    got, want = (e.generate([prompt], GREEDY)[0].token_ids for e in (engine, fresh))
    assert got == want


def test_a_stream_that_fails_before_its_first_tensor_leaves_the_engine_as_it_was(
    tiny_qwen3: Path,
) -> None:
    engine = engine_for(tiny_qwen3)
    before = snapshot(engine)
    weights = other_weights(engine)

    def dead() -> Iterator[tuple[str, torch.Tensor]]:
        raise ConnectionError("trainer rank 0 died")
        yield

    manifest = {name: spec(t) for name, t in weights.items()}
    with pytest.raises(ConnectionError):
        engine.update_weights(WeightStream(manifest, dead()))
    assert engine.weight_version == 0
    assert_weights(engine, before)
    assert engine.generate([list(range(10, 20))], GREEDY)[0].token_ids


def test_buckets_hold_at_most_their_bound_and_unpack_to_the_tensors_packed(
    tiny_qwen3: Path,
) -> None:
    weights = engine_for(tiny_qwen3).model.hf_state_dict()  # views into fused q/k/v, gate/up
    bound = 4096
    buckets = list(pack(weights.items(), bound))
    assert len(buckets) > 4
    for bucket in buckets:
        alone = len(bucket.entries) == 1
        assert bucket.data.numel() <= bound or alone  # a larger tensor is a bucket of its own
    unpacked = [item for bucket in buckets for item in bucket.unpack()]
    assert [name for name, _ in unpacked] == list(weights)
    assert all(torch.equal(t, weights[name]) for name, t in unpacked)


def test_a_reader_that_gives_up_ends_the_source_at_once(tiny_qwen3: Path) -> None:
    # The source stands for the ranks' stream: until it is closed, they wait mid-gather.
    engine = engine_for(tiny_qwen3)
    weights = other_weights(engine)
    manifest = {name: spec(t) for name, t in weights.items()}
    ended: list[str] = []

    def source(label: str, bad_at: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for i, (name, tensor) in enumerate(weights.items()):
                yield name, (tensor.double() if i == bad_at else tensor)
        finally:
            ended.append(label)

    buckets = pack(WeightStream(manifest, source("packed")), bucket_bytes=1 << 10)
    next(buckets)
    buckets.close()  # a publish that failed after its first bucket
    with pytest.raises(ModelConfigError):
        engine.update_weights(WeightStream(manifest, source("loaded", bad_at=2)))
    assert ended == ["packed", "loaded"]  # both closed now, not when collected
