"""LoRA: only the adapters train, the model they make is the merged plain model (what the engine
gets, what a checkpoint holds, what `venusrl serve` loads), and a resume trains on from them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from tests.server.process import serving
from venusrl.model.architecture import CausalLM, Linear
from venusrl.model.directory import init_model_dir, load_model
from venusrl.model.packed_rows import PackedRows
from venusrl.trainer.checkpoint import RunState, latest_checkpoint, save_checkpoint
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.lora import LoRALinear, add_adapters, load_adapters
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import Trajectory

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9]
TARGET = [40, 41, 42, 43]  # the continuation the training below makes likely


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("m") / "micro", preset="micro", seed=0)


def logits(model: CausalLM, row: list[int]) -> torch.Tensor:
    rows = PackedRows.pack([row], torch.device("cpu"))
    return model.lm_head(model.forward_rows(rows, torch.arange(len(row))))


def target_logprob(model: CausalLM) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(logits(model, PROMPT + TARGET[:-1]), -1)
    at = range(len(PROMPT) - 1, len(PROMPT) + len(TARGET) - 1)
    return float(sum(logp[p, t] for p, t in zip(at, TARGET, strict=True)))


def randomise_adapters(model: CausalLM, seed: int) -> None:
    """B starts at 0 (the update is 0); give it values so that merging has something to merge."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def demo() -> Trajectory:
    t = Trajectory.start("t", "g", "p", PROMPT)
    t.add_model_turn(TARGET, [0.0] * len(TARGET), [0] * len(TARGET))
    return t


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["k_proj", "o_proj", "up_proj"]])
def test_the_merged_model_computes_what_the_adapted_one_does(
    model_dir: Path, targets: list[str]
) -> None:
    adapted = load_model(model_dir)
    add_adapters(adapted, rank=4, alpha=8.0, targets=targets)
    randomise_adapters(adapted, seed=1)
    merged = load_model(model_dir)
    merged.load_weights(adapted.hf_state_dict().items())  # as the engine gets them
    row = [*PROMPT, 20, 21, 22]
    plain = load_model(model_dir)
    assert not torch.allclose(logits(merged, row), logits(plain, row), atol=1e-3)
    with torch.no_grad():
        assert torch.allclose(logits(adapted, row), logits(merged, row), atol=1e-5)


def test_adapter_gradients_are_those_of_the_merged_weight() -> None:
    g = torch.Generator().manual_seed(0)
    base = Linear(12, 10, bias=True)
    layer = LoRALinear(base, {"a": (0, 4), "b": (7, 10)}, rank=3, alpha=6.0, generator=g)
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.copy_(torch.randn(b.shape, generator=g))
    x, w = torch.randn(5, 12, generator=g), torch.randn(5, 10, generator=g)
    (layer(x) * w).sum().backward()
    got = [p.grad for p in (*layer.lora_A.values(), *layer.lora_B.values())]
    params = [
        p.detach().clone().requires_grad_()
        for p in (*layer.lora_A.values(), *layer.lora_B.values())
    ]
    a1, a2, b1, b2 = params
    update = torch.zeros(10, 12)
    update = update.index_put((torch.arange(0, 4),), 2.0 * (b1 @ a1))
    update = update.index_put((torch.arange(7, 10),), 2.0 * (b2 @ a2))
    (F.linear(x, base.weight.detach() + update, base.bias) * w).sum().backward()
    for mine, want in zip(got, params, strict=True):
        assert mine is not None and torch.allclose(mine, want.grad, atol=1e-5)  # type: ignore[arg-type]
    assert base.weight.grad is None  # the base is frozen


def test_the_optimizer_holds_only_the_adapters_as_many_as_the_rank_says(model_dir: Path) -> None:
    model = load_model(model_dir)
    config = TrainerConfig(lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"])
    trainer = GRPOTrainer(model, config)
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    # rank x (in + out) for each adapted projection of each layer
    expected = cfg.num_layers * 4 * ((h + q) + (h + kv) + (inter + h))
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in params) == expected
    adapters = {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in m.parameters()}
    assert {id(p) for p in params} <= adapters
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    with pytest.raises(ValueError, match="lora_targets"):
        TrainerConfig(lora_targets=["q_proj", "qkv"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at most once"):
        TrainerConfig(lora_targets=["q_proj", "q_proj"])
    with pytest.raises(ValueError, match="lora_rank"):
        TrainerConfig(lora_rank=-1)


def lora_trainer(model_dir: Path) -> GRPOTrainer:
    config = TrainerConfig(lr=2e-2, lora_rank=4, lora_alpha=8.0, kl_coef=0.0)
    return GRPOTrainer(load_model(model_dir), config)


def test_lora_imitation_raises_the_target_continuation_and_leaves_the_base_alone(
    model_dir: Path,
) -> None:
    trainer = lora_trainer(model_dir)
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    before = target_logprob(trainer.model)
    for _ in range(10):
        trainer.imitation_step([demo()], lr=2e-2)
    after = target_logprob(trainer.model)
    assert after > before + 2.0, (before, after)  # e^2: over 7x likelier
    for k, v in trainer.model.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k
    assert target_logprob(load_model_from(trainer.model, model_dir)) == pytest.approx(
        after, abs=1e-4
    )


def load_model_from(model: CausalLM, model_dir: Path) -> CausalLM:
    plain = load_model(model_dir)
    plain.load_weights(model.hf_state_dict().items())
    return plain


def test_a_lora_grpo_step_raises_the_rewarded_continuation(model_dir: Path) -> None:
    trainer = lora_trainer(model_dir)
    good, bad = demo(), Trajectory.start("u", "g", "p", PROMPT)
    bad.add_model_turn([30, 31], [0.0, 0.0], [0, 0])
    before = target_logprob(trainer.model)
    for t in (good, bad):  # on-policy behaviour logprobs
        with torch.no_grad():
            logp = torch.log_softmax(logits(trainer.model, t.token_ids[:-1]), -1)
        for p in range(len(PROMPT), len(t.token_ids)):
            t.logprobs[p] = float(logp[p - 1, t.token_ids[p]])
    for _ in range(3):
        trainer.step([good, bad], [1.0, -1.0])
    assert target_logprob(trainer.model) > before + 0.5


def test_a_resumed_lora_run_computes_and_trains_as_the_uninterrupted_one(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = lora_trainer(model_dir)
    trainer.step([demo()], [1.0])  # one token of advantage: a step that moves the adapters
    trainer.imitation_step([demo()], lr=1e-2)
    checkpoint = save_checkpoint(
        tmp_path, trainer.model, trainer.optimizer, RunState(1, 1), model_dir
    )
    assert (checkpoint / "lora_adapters.pt").is_file()
    # What roles.new_trainer does on --resume: the merged model, then its adapters and optimizer.
    resumed = lora_trainer(checkpoint)
    load_adapters(resumed.model, checkpoint)
    resumed.optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt"))
    row = [*PROMPT, *TARGET]
    with torch.no_grad():
        assert torch.allclose(logits(resumed.model, row), logits(trainer.model, row), atol=1e-5)
    a, b = trainer.step([demo()], [1.0]), resumed.step([demo()], [1.0])
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    with torch.no_grad():
        assert torch.allclose(logits(resumed.model, row), logits(trainer.model, row), atol=1e-4)
    with pytest.raises(ValueError, match="written without LoRA"):
        load_adapters(lora_trainer(model_dir).model, model_dir)


@pytest.fixture()
def served_lora_checkpoint(model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, CausalLM]]:
    trainer = lora_trainer(model_dir)
    for _ in range(10):
        trainer.imitation_step([demo()], lr=2e-2)
    checkpoint = save_checkpoint(
        tmp_path, trainer.model, trainer.optimizer, RunState(0, 0), model_dir
    )
    overrides = ["engine.threads=1", "engine.page_size=4", "engine.device_kv_pages=64"]
    with serving(checkpoint, *overrides, "engine.max_context=128", "server.model_name=lora") as url:
        yield url, trainer.model


def test_venusrl_serve_loads_a_lora_checkpoint_and_completes_as_the_adapted_model(
    served_lora_checkpoint: tuple[str, CausalLM],
) -> None:
    url, adapted = served_lora_checkpoint
    body = {"model": "lora", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["token_ids"]
    row = list(PROMPT)  # the adapted model's own greedy continuation
    for _ in range(6):
        with torch.no_grad():
            row.append(int(logits(adapted, row)[-1].argmax()))
    assert served == row[len(PROMPT) :]
    assert served[:4] == TARGET  # what the LoRA training taught, served from the merged weights


def test_a_checkpoint_with_damaged_adapters_is_passed_over_by_name(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = lora_trainer(model_dir)
    older = save_checkpoint(tmp_path, trainer.model, trainer.optimizer, RunState(0, 1), model_dir)
    newer = save_checkpoint(tmp_path, trainer.model, trainer.optimizer, RunState(1, 2), model_dir)
    (newer / "lora_adapters.pt").write_bytes(b"\0" * 64)  # a run directory copied in part
    skipped: list[tuple[Path, str]] = []
    assert latest_checkpoint(tmp_path, lambda path, why: skipped.append((path, why))) == older
    assert skipped[0][0] == newer and "lora_adapters.pt" in skipped[0][1]
