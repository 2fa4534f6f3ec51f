"""One GRPO optimisation step over a batch of trajectories (token records).

The model is the engine's own architecture (`CausalLM.forward_rows`, the autograd path), so the
logprobs the trainer computes for a token are those the engine recorded when it sampled it, up to
float error (tested): on-policy, the importance ratio is 1. Rows are packed without padding, their
common prefix once (`PackedRows`), and grouped into micro-batches under a token budget; only the
positions that predict model tokens are projected onto the vocabulary. The loss is the mean over
the model tokens of the step's trajectories with a non-zero advantage (token-level, so long
trajectories are not down-weighted; `seq_mean` weighs trajectories alike instead), whatever the
micro-batching. A trajectory whose
advantage is 0 (its group scored alike) is left out, KL penalty included: it carries no policy
gradient, and the entropy or KL terms alone would move its tokens.

The vocabulary projection runs a chunk of positions at a time (`chunked_logprobs.py`); with
`trainer.lora_rank`, only LoRA adapters train (`lora.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from venusrl.model.architecture import CausalLM
from venusrl.model.directory import build_model, load_model
from venusrl.model.packed_rows import PackedRows
from venusrl.model.weight_stream import WeightStream
from venusrl.trainer.checkpoint import RunState, save_checkpoint, write_model_dir
from venusrl.trainer.chunked_logprobs import token_logprobs
from venusrl.trainer.config import LossAggregation, TrainerConfig
from venusrl.trainer.grpo import policy_loss, row_weights
from venusrl.trainer.lora import add_adapters
from venusrl.types import Trajectory

_Row = tuple[Trajectory, float, float]  # trajectory, advantage, weight of each of its model tokens


@dataclass(frozen=True)
class StepStats:
    version: int  # weight version after the step
    loss: float
    clip_fraction: float
    mean_ratio: float
    entropy: float
    kl: float
    tokens: int
    trajectories: int
    grad_norm: float
    is_weight: float  # mean importance weight trainer / sampler as applied (`trainer.off_policy`)
    is_capped: float  # fraction of tokens whose importance weight passed `trainer.is_cap`
    sampler_kl: float  # the sampler's k3 distance to the trainer's policy, per token


class GRPOTrainer:
    def __init__(
        self,
        model: CausalLM,
        config: TrainerConfig | None = None,
        version: int = 0,
        reference: CausalLM | None = None,
        temperature: float = 1.0,
    ):
        """`reference`: the frozen policy of the KL penalty (`kl_coef > 0`); without one, the
        first step freezes the weights it starts from (`freeze_reference`). `temperature`: what
        the engine sampled at (1 for greedy): its behaviour logprobs are those of
        softmax(logits / temperature), so the trainer's must be too, or the importance ratio is
        off 1 on-policy and the clip silences tokens that never moved."""
        if not temperature > 0:
            raise ValueError(f"the trainer's temperature must be > 0, got {temperature}")
        self.model = model
        self.device = next(model.parameters()).device  # the batch goes where the model is
        self.config = config or TrainerConfig()
        self.version = version
        self.temperature = temperature
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False).eval()
        c = self.config
        self.trained = (
            add_adapters(model, c.lora_rank, c.lora_alpha, c.lora_targets)
            if c.lora_rank
            else list(model.parameters())
        )
        self.optimizer = torch.optim.AdamW(self.trained, lr=c.lr, weight_decay=c.weight_decay)
        self._imitation: torch.optim.Optimizer | None = None  # the warm start's (imitation_step)

    def freeze_reference(self) -> CausalLM:
        """The current weights become the KL reference (a frozen copy)."""
        weight = next(self.model.parameters())
        reference = build_model(self.model.config, weight.device, weight.dtype)
        reference.load_weights(
            (k, v.detach().clone()) for k, v in self.model.hf_state_dict().items()
        )
        reference.requires_grad_(False).eval()
        self.reference = reference
        return reference

    def use_reference(self, model_dir: Path) -> None:
        """The KL penalty's reference: the model of `model_dir`, frozen."""
        self.reference = load_model(model_dir, self.device).requires_grad_(False)

    def hf_weights(self) -> WeightStream:
        """The weights under Hugging Face names (views, not copies)."""
        return self.model.hf_weights()

    def write_model_dir(self, out: Path, like: Path) -> None:
        write_model_dir(out, self.model, like)

    def save_checkpoint(self, run_dir: Path, state: RunState, model_dir: Path) -> Path:
        return save_checkpoint(run_dir, self.model, self.optimizer, state, model_dir)

    def close(self) -> None:
        """Nothing to release in one process (a sharded trainer stops its ranks)."""

    def step(self, trajectories: Sequence[Trajectory], advantages: Sequence[float]) -> StepStats:
        """`advantages[i]` applies to every model token of `trajectories[i]`; masked members
        (infrastructure failures) must be left out by the caller."""
        if len(trajectories) != len(advantages):
            raise ValueError("one advantage per trajectory")
        if self.config.kl_coef and self.reference is None:
            self.freeze_reference()  # the KL penalty holds the policy near where RL started
        rows = weighted_rows(trajectories, advantages, self.config.loss_aggregation)
        return self.train_rows(rows, sum(t.model_tokens for t, _, _ in rows), len(rows))

    def train_rows(self, rows: list[_Row], total: int, trajectories: int) -> StepStats:
        """The step over weighted rows: all of the batch's here, a share of them on a trainer
        rank (`total` model tokens and `trajectories` rows in the whole batch)."""
        self.model.train()
        # PPO's several passes over one batch: each pass recomputes the ratio against the
        # behaviour (or proximal) logprobs, and the clip stops a token once it has moved far
        # enough. Reported figures are those of the first pass (the policy that the batch
        # measured). Its logprobs, per micro-batch, are the proximal policy's: the weights
        # before this step.
        first: dict[str, float] = {}
        proximal: list[torch.Tensor] = []
        for _ in range(self.config.updates_per_batch):
            sums, grad_norm = self._update(rows, total, proximal)
            first = first or {**sums, "grad_norm": grad_norm}
        self.version += 1
        self.model.eval()
        return StepStats(
            self.version,
            first["loss"],
            first["clip"],
            first["ratio"],
            first["entropy"],
            first["kl"],
            total,
            trajectories,
            first["grad_norm"],
            first["is_weight"],
            first["is_capped"],
            first["sampler_kl"],
        )

    def _update(
        self, rows: list[_Row], total: int, proximal: list[torch.Tensor]
    ) -> tuple[dict[str, float], float]:
        """One gradient step over all rows; their token weights sum to 1 (`row_weights`). The
        first pass fills `proximal` with each micro-batch's logprobs; later passes read them."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(
            ("loss", "clip", "ratio", "entropy", "kl", "is_weight", "is_capped", "sampler_kl"),
            0.0,
        )
        reference = self.reference if self.config.kl_coef > 0 else None
        for i, rows_in_batch in enumerate(self._micro_batches(rows)):
            batch = _pack(rows_in_batch, self.device)
            reference_logprobs = None
            if reference is not None:
                with torch.no_grad():
                    reference_logprobs = self._logprobs(reference, batch, self.temperature)[0]
            logp, entropy = self._logprobs(self.model, batch, self.temperature)
            if i == len(proximal):
                proximal.append(logp.detach())
            loss, stats = policy_loss(
                logp,
                entropy,
                batch.behaviour,
                batch.advantages,
                batch.weights,
                self.config.clip_eps,
                self.config.entropy_coef,
                reference_logprobs,
                self.config.kl_coef,
                proximal[i],
                self.config.off_policy,
                self.config.is_cap,
            )
            loss.backward()
            sums["loss"] += stats.loss
            weight = stats.tokens / max(total, 1)
            sums["clip"] += stats.clip_fraction * weight
            sums["ratio"] += stats.mean_ratio * weight
            sums["entropy"] += stats.entropy * weight
            sums["kl"] += stats.kl * weight
            sums["is_weight"] += stats.is_weight * weight
            sums["is_capped"] += stats.is_capped * weight
            sums["sampler_kl"] += stats.sampler_kl * weight
        grad_norm = self._clip_grads()
        if total:
            self.optimizer.step()
        return sums, grad_norm

    def imitation_step(self, trajectories: Sequence[Trajectory], lr: float) -> float:
        """One supervised step on demonstrations at `lr`: the mean negative log-likelihood of their
        model tokens (the warm start). Does not change the weight version.

        It has an optimizer of its own. Sharing the RL one left Adam's second moments full of
        imitation gradients, which are far larger than policy gradients; with beta2 = 0.999 they
        took hundreds of RL steps to decay, and meanwhile every RL update was a small fraction of
        the configured learning rate (measured: a flat training reward over 150 steps)."""
        rows = [(t, 0.0, 1.0) for t in trajectories if t.model_tokens]
        return self.imitate_rows(rows, sum(t.model_tokens for t, _, _ in rows), lr)

    def imitate_rows(self, rows: list[_Row], total: int, lr: float) -> float:
        """`imitation_step` over rows weighted 1 (0: a rank's padding) of `total` tokens."""
        if self._imitation is None:
            self._imitation = torch.optim.AdamW(self.trained, lr=lr, weight_decay=0.0)
        for g in self._imitation.param_groups:
            g["lr"] = lr
        self.model.train()
        self._imitation.zero_grad(set_to_none=True)
        nll = 0.0
        for rows_in_batch in self._micro_batches(rows):
            batch = _pack(rows_in_batch, self.device)
            picked = self._logprobs(self.model, batch, 1.0)[0]
            loss = -(picked * batch.weights).sum() / max(total, 1)
            loss.backward()
            nll += float(loss.detach())
        self._clip_grads()
        self._imitation.step()
        self._imitation.zero_grad(set_to_none=True)
        self.model.eval()
        return self._summed(nll)

    def _clip_grads(self) -> float:
        """Clips the gradients to `max_grad_norm`; their norm before."""
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.config.max_grad_norm)
        return float(norm)

    def _summed(self, value: float) -> float:
        """`value` summed over the trainer's ranks: itself, in one process."""
        return value

    def _logprobs(
        self, model: CausalLM, batch: _Batch, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logprobs and entropies at the batch's trained tokens under softmax(logits /
        temperature), the logits a chunk at a time."""
        with self._compute_precision():
            hidden = model.forward_rows(batch.rows, batch.wanted)
            return token_logprobs(
                hidden,
                model.lm_head.weight,
                batch.tokens,
                temperature,
                self.config.logprob_chunk_tokens,
            )

    def _compute_precision(self) -> AbstractContextManager[object]:
        """`trainer.param_dtype=bfloat16`: matmuls in bf16 under autocast (softmaxes, norms'
        sums and the weights stay fp32). The sharded ranks cast through FSDP2 instead."""
        if self.config.param_dtype == "float32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """Rows in turn, cut so that their tokens stay within the token budget."""
        batches: list[list[_Row]] = []
        current: list[_Row] = []
        tokens = 0
        for row in rows:
            n = len(row[0].token_ids)
            if current and tokens + n > self.config.micro_batch_tokens:
                batches.append(current)
                current, tokens = [], 0
            current.append(row)
            tokens += n
        if current:
            batches.append(current)
        return batches


def weighted_rows(
    trajectories: Sequence[Trajectory], advantages: Sequence[float], aggregation: LossAggregation
) -> list[_Row]:
    """The rows a GRPO step trains, each with its tokens' loss weight (summing to 1)."""
    # A zero advantage (a group whose members all scored the same) carries no policy
    # gradient; leaving it in would let the entropy bonus alone push those tokens toward
    # uniform (measured: 15 such steps at lr 2e-3 turned a warm-started policy into noise).
    kept = [
        (t, a) for t, a in zip(trajectories, advantages, strict=True) if t.model_tokens and a != 0
    ]
    weights = row_weights([t.model_tokens for t, _ in kept], aggregation)
    return [(t, a, w) for (t, a), w in zip(kept, weights, strict=True)]


@dataclass(frozen=True)
class _Batch:
    """Rows packed (`PackedRows`), and what the loss reads at their trained tokens: the packed
    index of the token before each (whose logits predicted it), the token, its behaviour logprob,
    its weight and its row's advantage."""

    rows: PackedRows
    wanted: torch.Tensor
    tokens: torch.Tensor
    behaviour: torch.Tensor
    weights: torch.Tensor
    advantages: torch.Tensor


def _pack(rows: list[_Row], device: torch.device) -> _Batch:
    packed = PackedRows.pack([t.token_ids[:-1] for t, _, _ in rows], device)
    wanted: list[int] = []
    tokens: list[int] = []
    behaviour: list[float] = []
    weights: list[float] = []
    advantages: list[float] = []
    for i, (t, a, w) in enumerate(rows):
        trained = [p for p in range(1, len(t.token_ids)) if t.mask[p]]
        wanted += packed.index(i, [p - 1 for p in trained])
        tokens += [t.token_ids[p] for p in trained]
        behaviour += [t.logprobs[p] for p in trained]
        weights += [w] * len(trained)
        advantages += [a] * len(trained)
    return _Batch(
        packed,
        torch.tensor(wanted, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
        torch.tensor(behaviour, dtype=torch.float32, device=device),
        torch.tensor(weights, dtype=torch.float32, device=device),
        torch.tensor(advantages, dtype=torch.float32, device=device),
    )
