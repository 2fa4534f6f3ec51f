"""The trainer as ranks: real processes in one gloo group sharding the model with FSDP2."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from venusrl.engine.engine import Engine
from venusrl.model.architecture import ModelConfigError, TornWeights
from venusrl.model.directory import init_model_dir, load_model
from venusrl.model.weight_stream import WeightStream
from venusrl.trainer.checkpoint import RunState, latest_checkpoint
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.rank_processes import ProcessRanks
from venusrl.trainer.ranks import RankedTrainer, RankFailed, token_shares
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import SamplingParams, Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("m") / "micro", preset="micro", seed=0)


def batch(seed: int, rows: int = 6) -> tuple[list[Trajectory], list[float]]:
    """Trajectories of different lengths, with observations between turns, off-policy logprobs
    (so that the clip and the ratio matter) and advantages of both signs."""
    rng = random.Random(seed)
    trajectories = []
    for i in range(rows):
        t = Trajectory.start(f"t{i}", "g", "p", [rng.randrange(1, 1000) for _ in range(5)])
        for _ in range(rng.randrange(1, 4)):
            n = rng.randrange(2, 9)
            t.add_model_turn(
                [rng.randrange(1, 1000) for _ in range(n)],
                [-rng.uniform(5.0, 9.0) for _ in range(n)],
                [0] * n,
            )
            t.add_observation([rng.randrange(1, 1000) for _ in range(3)])
        trajectories.append(t)
    return trajectories, [rng.choice([-1.5, -0.5, 0.5, 1.0]) for _ in range(rows)]


def config(**overrides: object) -> TrainerConfig:
    # lr 1e-4: Adam's first steps move every weight by about lr * sign(gradient), so where a
    # gradient is ~1e-8 (Adam's eps), float noise in its sum moves the update by up to lr.
    base: dict[str, object] = dict(
        lr=1e-4, kl_coef=0.0, entropy_coef=0.01, micro_batch_tokens=40, max_grad_norm=0.5
    )
    return TrainerConfig(**{**base, **overrides})


NOISE = 1e-5  # what summing in another order moves an fp32 weight by, away from Adam's flips
FLIPPED = 1e-4  # the share of a tensor's weights whose update noise may flip (see `config`)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same weights up to float noise. Where a gradient is near Adam's eps, noise in its sum
    flips the update's sign: such a weight may differ by up to 2 lr an update, so all but a few
    in 10,000 of a tensor's weights must agree within NOISE, and every one within 2 lr x 4
    updates (no test here takes more). A sharding error (a shard misplaced, or not updated)
    moves whole rows, far more than that share, by the update's size or more."""
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs()
        assert diff.max() <= 2 * 1e-4 * 4, (name, diff.max())
        off = int((diff > NOISE).sum())
        assert off <= FLIPPED * diff.numel(), f"{name}: {off} of {diff.numel()} weights differ"


def test_rows_are_dealt_to_ranks_by_tokens() -> None:
    trajectories, advantages = batch(0, rows=9)
    rows = [(t, a, 1.0) for t, a in zip(trajectories, advantages, strict=True)]
    shares = token_shares(rows, 2)
    assert sorted(id(r) for s in shares for r in s) == sorted(id(r) for r in rows)
    tokens = [sum(len(t.token_ids) for t, _, _ in s) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= max(len(t.token_ids) for t in trajectories)
    assert token_shares(rows[:1], 3)[1:] == [[], []]  # a rank may have nothing to train


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_two_rank_fsdp_step_equals_the_one_rank_step(tmp_path: Path, tied: bool) -> None:
    # The output head is read outside the sharded forward (the logprobs project a chunk at a
    # time): its gradient must reach the shards whether it is the embedding's or its own.
    overrides = {"tie_word_embeddings": tied}
    model_dir = init_model_dir(tmp_path / "micro", preset="micro", overrides=overrides, seed=0)
    trajectories, advantages = batch(1)
    # The KL penalty's reference: the weights of the first step, frozen by each trainer.
    cfg = config(world_size=2, updates_per_batch=2, kl_coef=0.1)
    one = GRPOTrainer(load_model(model_dir), cfg)
    expected = [one.step(trajectories, advantages), one.step(*batch(2))]
    ranks = RankedTrainer(model_dir, cfg)
    try:
        got = [ranks.step(trajectories, advantages), ranks.step(*batch(2))]
        weights = dict(ranks.hf_weights())
    finally:
        ranks.close()
    for e, g in zip(expected, got, strict=True):
        assert g.version == e.version and g.tokens == e.tokens
        assert g.trajectories == e.trajectories
        # Within 1e-5, relative where a figure is large (a norm of ~10, mean off-policy ratios
        # of ~2): summed in another order, fp32 moves in the 6th digit.
        for field in ("loss", "grad_norm", "clip_fraction", "mean_ratio", "entropy", "kl"):
            want = pytest.approx(getattr(e, field), rel=1e-5, abs=1e-5)
            assert getattr(g, field) == want, field
    assert expected[0].grad_norm > cfg.max_grad_norm  # the clip was at work
    assert expected[1].kl > 0  # and the KL penalty
    assert_same_weights(weights, one.model.hf_state_dict())


def test_the_weight_comparison_catches_a_misplaced_or_unupdated_shard(tmp_path: Path) -> None:
    model_dir = init_model_dir(tmp_path / "micro", preset="micro", seed=0)
    start = load_model(model_dir).hf_state_dict()
    trainer = GRPOTrainer(load_model(model_dir), config(updates_per_batch=2))
    trainer.step(*batch(1))
    stepped = trainer.model.hf_state_dict()
    assert_same_weights(stepped, {k: v.clone() for k, v in stepped.items()})
    name = "model.embed_tokens.weight"
    half = stepped[name].shape[0] // 2
    w = stepped[name]
    misplaced = {**stepped, name: torch.cat([w[half:], w[:half]])}
    unupdated = {**stepped, name: torch.cat([w[:half], start[name][half:]])}
    for wrong in (misplaced, unupdated):
        with pytest.raises(AssertionError):
            assert_same_weights(wrong, stepped)


def test_ranks_with_activation_checkpointing_imitate_as_one_process(model_dir: Path) -> None:
    demos, _ = batch(3, rows=5)
    cfg = config(world_size=2, activation_checkpointing=True)
    one = GRPOTrainer(load_model(model_dir), cfg)
    expected = one.imitation_step(demos, lr=1e-3)
    ranks = RankedTrainer(model_dir, cfg)
    try:
        assert ranks.imitation_step(demos, lr=1e-3) == pytest.approx(expected, abs=1e-5)
        weights = dict(ranks.hf_weights())
    finally:
        ranks.close()
    assert_same_weights(weights, one.model.hf_state_dict())


def test_bf16_compute_steps_near_the_fp32_step_and_keeps_fp32_master_weights(
    model_dir: Path,
) -> None:
    trajectories, advantages = batch(1)
    expected = GRPOTrainer(load_model(model_dir), config()).step(trajectories, advantages)
    ranks = RankedTrainer(model_dir, config(world_size=2, param_dtype="bfloat16"))
    try:
        stopped = iter(ranks.hf_weights())  # an engine that refuses the first tensor it is sent
        next(stopped)
        stopped.close()  # type: ignore[attr-defined]  # the ranks finish the gather all the same
        got = ranks.step(trajectories, advantages)
        dtypes = {t.dtype for _, t in ranks.hf_weights()}
    finally:
        ranks.close()
    assert got.loss == pytest.approx(expected.loss, rel=1e-2)
    assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-2)
    assert dtypes == {torch.float32}  # what the engines get and the checkpoints hold


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_publish_from_two_ranks_is_checked_up_front_then_copied_holding_one_bucket_at_a_time(
    model_dir: Path, tmp_path: Path
) -> None:
    """Every bucket that reaches this process is a shared-memory segment it holds a file
    descriptor for while any of its tensors lives: the descriptors open count the buckets
    held. A publish that held the whole set (the engine checking every tensor before copying
    any) would hold one per parameter."""
    engine = Engine.from_model_dir(init_model_dir(tmp_path / "e", preset="micro", seed=1))
    another = Engine.from_model_dir(init_model_dir(tmp_path / "t", preset="tiny", seed=0))
    bucket_mib = 1 / 16  # the micro model (2 MiB) in 20-odd buckets
    ranks = RankedTrainer(model_dir, config(world_size=2, publish_bucket_mib=bucket_mib))
    try:
        with pytest.raises(ModelConfigError, match="has shape"):
            another.update_weights(ranks.hf_weights(), version=1)  # another model's shapes
        assert another.weight_version == 0

        stream = ranks.hf_weights()
        baseline, held, tensors = open_fds(), [0], [0]

        def watched() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                held[0], tensors[0] = max(held[0], open_fds() - baseline), tensors[0] + 1
                yield name, tensor

        engine.update_weights(WeightStream(stream.manifest, watched()), version=1)
        total_mib = (
            sum(s.dtype.itemsize * torch.Size(s.shape).numel() for s in stream.manifest.values())
            / 2**20
        )
        assert total_mib / bucket_mib > 20 and tensors[0] == len(stream.manifest)
        assert held[0] <= 1, f"{held[0]} buckets held at once"
        assert engine.weight_version == 1
        assert_same_weights(engine.model.hf_state_dict(), load_model(model_dir).hf_state_dict())

        # A rank that dies midway: the run stops, and the engine keeps its version and runs
        # nothing until a whole set loads (it is half copied).
        def killing() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(ranks.hf_weights()):
                if i == 0:
                    os.kill(ranks.link.pids[1], signal.SIGKILL)  # type: ignore[attr-defined]
                yield item

        with pytest.raises(RankFailed, match=r"trainer rank \d"):
            engine.update_weights(WeightStream(stream.manifest, killing()), version=2)
        assert engine.weight_version == 1
        with pytest.raises(TornWeights):
            engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        ranks.close()


def test_options_of_the_ranks_are_refused_in_one_process_by_name() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing=True .*world_size > 1"):
        TrainerConfig(activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"trainer\.cpu_offload .* trainer\.device is cpu"):
        TrainerConfig(world_size=2, cpu_offload=True)


def test_a_killed_rank_stops_the_step_with_an_error_naming_it(model_dir: Path) -> None:
    ranks = RankedTrainer(model_dir, config(world_size=2))
    processes = ranks.link
    assert isinstance(processes, ProcessRanks)
    os.kill(processes.pids[1], signal.SIGKILL)
    with pytest.raises(RankFailed, match=r"trainer rank 1 \(pid \d+\) died \(killed by signal 9\)"):
        ranks.step(*batch(4))
    ranks.close()
    assert not any(p.is_alive() for p in processes._processes)


def test_an_error_on_a_rank_other_than_the_first_stops_the_step_at_once_naming_it(
    model_dir: Path,
) -> None:
    # Rows are dealt longest first, each to the lightest rank: the second longest goes to rank
    # 1. A token id past the vocabulary fails its embedding there, while rank 0 waits for rank
    # 1 in a collective: the error must come from rank 1 now, not rank 0's timeout later.
    trajectories, advantages = batch(7, rows=4)
    lengths = sorted(range(4), key=lambda i: -len(trajectories[i].token_ids))
    second = trajectories[lengths[1]]
    second.token_ids[1] = load_model(model_dir).config.vocab_size + 5
    ranks = RankedTrainer(model_dir, config(world_size=2, rank_timeout_s=600))
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"trainer rank 1 failed in 'step'") as failed:
        ranks.step(trajectories, advantages)
    assert time.monotonic() - started < 60
    assert "IndexError" in str(failed.value)  # the rank's own traceback, for the user
    ranks.close()


@pytest.mark.slow  # 15-50 s on 2 shared cores: two sets of ranks start
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_sharded_checkpoint_resumes_with_the_same_weights_and_optimizer_state(
    model_dir: Path, tmp_path: Path, lora_rank: int
) -> None:
    # With LoRA the consolidated model holds merged weights; the shards, base and adapters.
    cfg = config(world_size=2, lora_rank=lora_rank)
    ranks = RankedTrainer(model_dir, cfg)
    try:
        ranks.step(*batch(5))
        saved = ranks.save_checkpoint(tmp_path, RunState(step=0, weight_version=1), model_dir)
        after = ranks.step(*batch(6))  # the second moments of step 1 shape this one
        expected = dict(ranks.hf_weights())
    finally:
        ranks.close()
    assert latest_checkpoint(tmp_path) == saved
    load_model(saved)  # the consolidated model loads as it is (`venusrl serve`)
    resumed = RankedTrainer(saved, cfg, version=1, resume=True)
    try:
        again = resumed.step(*batch(6))
        weights = dict(resumed.hf_weights())
    finally:
        resumed.close()
    assert again.version == 2 and again.loss == pytest.approx(after.loss, abs=1e-6)
    assert_same_weights(weights, expected)


def test_two_lora_ranks_step_as_one_lora_process_and_publish_merged_weights(
    model_dir: Path,
) -> None:
    # The adapters move (imitation) before the first step freezes the KL reference: the ranks'
    # reference must compute with the adapters of then, as one process's merged copy does.
    cfg = config(world_size=2, lora_rank=4, lora_alpha=8.0, lr=1e-3, kl_coef=0.5)
    one = GRPOTrainer(load_model(model_dir), cfg)
    one.imitation_step(batch(3)[0], lr=1e-3)
    expected = [one.step(*batch(4)), one.step(*batch(5))]
    ranks = RankedTrainer(model_dir, cfg)
    try:
        ranks.imitation_step(batch(3)[0], lr=1e-3)
        got = [ranks.step(*batch(4)), ranks.step(*batch(5))]
        weights = dict(ranks.hf_weights())
    finally:
        ranks.close()
    for e, g in zip(expected, got, strict=True):
        for field in ("loss", "grad_norm", "clip_fraction", "mean_ratio", "entropy"):
            want = pytest.approx(getattr(e, field), rel=1e-5, abs=1e-5)
            assert getattr(g, field) == want, field
    merged = one.model.hf_state_dict()
    base = load_model(model_dir).hf_state_dict()
    moved = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert moved and all("proj" in n for n in moved)  # the adapters trained, nothing else
    assert_same_weights(weights, merged)
