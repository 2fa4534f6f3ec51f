"""The trainer computes what the engine sampled, and a GRPO step moves the policy the right way."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.model.architecture import CausalLM
from venusrl.model.directory import init_model_dir, load_model
from venusrl.model.packed_rows import PackedRows
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import SamplingParams, Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("m") / "tiny", preset="tiny", seed=0)


def record(prompt: list[int], out: list[int], logprobs: list[float]) -> Trajectory:
    t = Trajectory.start("t", "g", "p", prompt)
    t.add_model_turn(out, logprobs, [0] * len(out))
    return t


def row_logits(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """The training path's logits at every position of one row."""
    rows = PackedRows.pack([token_ids], torch.device("cpu"))
    return model.lm_head(model.forward_rows(rows, torch.arange(len(token_ids))))


def dense_logprobs(model: CausalLM, t: Trajectory) -> list[float]:
    ids = torch.tensor(t.token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(row_logits(model, t.token_ids[:-1]), -1)
    picked = logp.gather(-1, ids[1:, None]).squeeze(-1).tolist()
    return [picked[i - 1] for i, m in enumerate(t.mask) if m]


def test_trainer_logprobs_equal_the_engine_sampling_logprobs(model_dir: Path) -> None:
    engine = Engine.from_model_dir(model_dir, EngineConfig(threads=1, page_size=4))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    model = load_model(model_dir)
    for prompt, out in zip(prompts, outs, strict=True):
        t = record(prompt, out.token_ids, out.logprobs)
        assert dense_logprobs(model, t) == pytest.approx(out.logprobs, abs=1e-4)


def test_a_grpo_step_raises_the_rewarded_continuation_and_lowers_the_other(model_dir: Path) -> None:
    model = load_model(model_dir)
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=16, kl_coef=0.0))
    prompt = [5, 6, 7]
    good, bad = record(prompt, [20, 21, 22, 23], [0.0] * 4), record(prompt, [30, 31], [0.0] * 2)
    for t in (good, bad):  # behaviour = the current policy: on-policy
        t.logprobs[len(prompt) :] = dense_logprobs(model, t)
    before = sum(dense_logprobs(model, good)), sum(dense_logprobs(model, bad))
    stats = trainer.step([good, bad], [1.0, -1.0])
    after = sum(dense_logprobs(model, good)), sum(dense_logprobs(model, bad))
    assert after[0] > before[0] and after[1] < before[1]
    assert stats.version == 1 and stats.tokens == 6 and stats.trajectories == 2
    assert stats.mean_ratio == pytest.approx(1.0, abs=1e-4)  # on-policy
    assert stats.clip_fraction == 0.0
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(lr=0)


def test_groups_without_signal_leave_the_weights_alone_even_with_an_entropy_bonus(
    model_dir: Path,
) -> None:
    model = load_model(model_dir)
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-2, entropy_coef=0.1, kl_coef=0.0))
    t = record([5, 6, 7], [20, 21], [0.0, 0.0])
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    stats = trainer.step([t, t], [0.0, 0.0])
    assert stats.tokens == 0 and stats.version == 1
    assert all(torch.equal(before[k], v) for k, v in model.hf_state_dict().items())


def test_several_updates_per_batch_move_the_policy_further_and_publish_one_version(
    model_dir: Path,
) -> None:
    def moved(updates: int) -> float:
        model = load_model(model_dir)
        trainer = GRPOTrainer(model, TrainerConfig(lr=1e-3, updates_per_batch=updates, kl_coef=0.0))
        good = record([5, 6, 7], [20, 21, 22], [0.0] * 3)
        good.logprobs[3:] = dense_logprobs(model, good)
        bad = record([5, 6, 7], [30, 31], [0.0] * 2)
        bad.logprobs[3:] = dense_logprobs(model, bad)
        stats = trainer.step([good, bad], [1.0, -1.0])
        assert stats.version == 1  # one published version, whatever the passes
        assert stats.mean_ratio == pytest.approx(1.0, abs=1e-4)  # figures of the first pass
        return max(
            n - o for n, o in zip(dense_logprobs(model, good), good.logprobs[3:], strict=True)
        )

    assert 0 < moved(1) < moved(4)
    with pytest.raises(ValueError, match="updates_per_batch"):
        TrainerConfig(updates_per_batch=0)


def test_a_kl_penalty_holds_the_policy_near_the_weights_it_started_from(model_dir: Path) -> None:
    def moved(kl_coef: float) -> float:
        model = load_model(model_dir)
        # (At lr 1e-2 five steps overshoot and swing either way; the test once passed there only
        # because its no-grad logprobs read the weights as loaded.)
        trainer = GRPOTrainer(model, TrainerConfig(lr=1e-3, kl_coef=kl_coef))
        if kl_coef:
            trainer.freeze_reference()
        good = record([5, 6, 7], [20, 21, 22], [0.0] * 3)
        good.logprobs[3:] = dense_logprobs(model, good)
        bad = record([5, 6, 7], [30, 31], [0.0] * 2)
        bad.logprobs[3:] = dense_logprobs(model, bad)
        for _ in range(5):
            trainer.step([good, bad], [1.0, -1.0])
        return sum(
            n - o for n, o in zip(dense_logprobs(model, good), good.logprobs[3:], strict=True)
        )

    assert 0 < moved(1.0) < moved(0.0)
    # Given no reference, the first step freezes the weights it starts from.
    model = load_model(model_dir)
    start = {k: v.clone() for k, v in model.hf_state_dict().items()}
    trainer = GRPOTrainer(model, TrainerConfig(kl_coef=0.1))
    trainer.step([record([5, 6], [7], [0.0]), record([5, 6], [8], [0.0])], [1.0, -1.0])
    assert trainer.reference is not None
    reference = trainer.reference.hf_state_dict()
    assert all(torch.equal(start[k], reference[k]) for k in start)


def test_the_warm_start_leaves_the_rl_optimizer_state_empty(model_dir: Path) -> None:
    # Adam's second moments from imitation (large gradients) would shrink every RL update for
    # hundreds of steps; RL starts with moments of its own.
    model = load_model(model_dir)
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-4, kl_coef=0.0))
    demo = record([5, 6, 7], [20, 21, 22], [0.0] * 3)
    before = dense_logprobs(model, demo)
    for _ in range(3):
        trainer.imitation_step([demo], lr=1e-2)
    assert sum(dense_logprobs(model, demo)) > sum(before)  # it imitated
    assert trainer.optimizer.state_dict()["state"] == {}
    assert trainer.version == 0


def test_after_a_step_a_no_grad_forward_reads_the_new_weights(model_dir: Path) -> None:
    """The inference path's prepacked weight copies must not outlive an optimizer step (they
    once did: a no-grad forward of the trained model read the weights it was loaded with)."""
    model = load_model(model_dir)
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-2, kl_coef=0.0))
    t = record([5, 6, 7], [20, 21, 22], [0.0] * 3)
    t.logprobs[3:] = dense_logprobs(model, t)
    trainer.step([t, record([5, 6, 7], [30], [0.0])], [1.0, -1.0])
    with torch.no_grad():
        inference = row_logits(model, t.token_ids)
    assert torch.allclose(inference, row_logits(model, t.token_ids).detach(), atol=1e-5)


def test_tokens_sampled_below_temperature_one_are_on_policy_for_a_trainer_told_the_temperature(
    model_dir: Path,
) -> None:
    engine = Engine.from_model_dir(model_dir, EngineConfig(threads=1, page_size=4))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.5, seed=3))
    rows = [record(p, o.token_ids, o.logprobs) for p, o in zip(prompts, outs, strict=True)]
    # The engine's logprobs are those of softmax(logits / 0.5); read at temperature 1, on-policy
    # tokens have ratios off 1 and some are clipped before the policy has moved at all.
    untold = GRPOTrainer(load_model(model_dir), TrainerConfig(lr=1e-9, kl_coef=0.0)).step(
        rows, [1.0, -1.0]
    )
    assert untold.clip_fraction > 0
    told = GRPOTrainer(load_model(model_dir), TrainerConfig(lr=1e-9, kl_coef=0.0), temperature=0.5)
    stats = told.step(rows, [1.0, -1.0])
    assert stats.mean_ratio == pytest.approx(1.0, abs=1e-4) and stats.clip_fraction == 0
    with pytest.raises(ValueError, match="temperature"):
        GRPOTrainer(load_model(model_dir), temperature=0)


def test_one_process_bf16_compute_steps_near_the_fp32_step_and_keeps_fp32_weights(
    model_dir: Path,
) -> None:
    prompt = [5, 6, 7]
    batch = [record(prompt, list(range(20 + 4 * i, 26 + 4 * i)), [-6.0] * 6) for i in range(4)]
    advantages = [1.0, -1.0, 0.5, -0.5]
    full = GRPOTrainer(load_model(model_dir), TrainerConfig(lr=1e-4)).step(batch, advantages)
    trainer = GRPOTrainer(load_model(model_dir), TrainerConfig(lr=1e-4, param_dtype="bfloat16"))
    half = trainer.step(batch, advantages)
    assert half.loss == pytest.approx(full.loss, rel=2e-2, abs=1e-3)
    assert half.grad_norm == pytest.approx(full.grad_norm, rel=5e-2)
    assert half.mean_ratio != full.mean_ratio  # bf16 matmuls ran: not the fp32 arithmetic
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_a_stale_sampler_shows_in_the_step_and_tis_bounds_what_its_tokens_weigh(
    model_dir: Path,
) -> None:
    """The sampler found `good`'s tokens far less likely than the trainer does (older weights):
    the step reports how far apart they are; TIS weighs those tokens at most `is_cap`, and over
    several passes takes the ratio to the weights before the step, so its later passes see the
    policy move as PPO's do."""

    def step(off_policy: str, updates: int) -> tuple[object, float]:
        model = load_model(model_dir)
        config = TrainerConfig(
            lr=1e-3, kl_coef=0.0, off_policy=off_policy, is_cap=2.0, updates_per_batch=updates
        )
        good = record([5, 6, 7], [20, 21, 22], [0.0] * 3)
        good.logprobs[3:] = [lp - 3.0 for lp in dense_logprobs(model, good)]  # stale sampler
        before = sum(dense_logprobs(model, good))
        stats = GRPOTrainer(model, config).step([good, good], [1.0, 1.0])
        return stats, sum(dense_logprobs(model, good)) - before

    ppo, ppo_moved = step("ppo", 1)
    tis, tis_moved = step("tis", 1)
    for stats in (ppo, tis):
        assert stats.sampler_kl == pytest.approx(math.exp(-3) + 3 - 1, rel=1e-3)  # type: ignore[attr-defined]
        assert stats.is_capped == 1.0  # type: ignore[attr-defined]
    # PPO's ratio to the sampler, e^3, is past the clip: those tokens do not move. TIS moves
    # them, each weighed 2 (the cap), not e^3.
    assert ppo.clip_fraction == 1.0 and ppo_moved == pytest.approx(0.0, abs=1e-6)  # type: ignore[attr-defined]
    assert tis.is_weight == pytest.approx(2.0) and tis.clip_fraction == 0.0  # type: ignore[attr-defined]
    assert tis_moved > 0
    # More passes move further, and each later pass clips against the pre-step weights.
    assert step("tis", 4)[1] > tis_moved
    with pytest.raises(ValueError, match="off_policy"):
        TrainerConfig(off_policy="importance")  # type: ignore[arg-type]
