"""The trainer's config section (`trainer.*`): the GRPO step's knobs, checked once, here."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from venusrl.sections import Section, torch_device

LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[LoRATarget, ...] = get_args(LoRATarget)

OffPolicy = Literal["ppo", "tis", "mis", "decoupled"]
"""How the loss corrects for tokens the sampler drew from another policy than the trainer's (older
weights within the staleness bound, or the same weights through other kernels and precision).

`ppo`: PPO-clip with the ratio taken against the sampler's logprobs. The others take it against
the trainer's own logprobs before the step (the proximal policy) and weigh each token by the
importance weight w = pi_trainer / pi_sampler, detached: `tis` truncates it at `is_cap`
(truncated IS, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"), `mis` masks the tokens whose w passes it (masked IS), `decoupled` keeps it whole
(decoupled PPO, Hilton et al. 2022; AReaL). When sampler and trainer agree (w = 1) every one is
the `ppo` loss."""

LossAggregation = Literal["token_mean", "seq_mean"]
"""How the per-token objective is averaged over a batch.

`token_mean`: every model token of the batch weighs the same (DAPO, Dr. GRPO), so long trajectories
are not down-weighted. `seq_mean`: each trajectory weighs the same, its tokens share its weight
(the original GRPO). The difference matters when length goes with the reward: on guess_number the
losers are the long episodes (all six guesses), so under `token_mean` the tokens that every
episode writes (the tool-call syntax) collect more negative advantage from the losers than positive
from the winners, and a fast learning rate wrecks the format; under `seq_mean` a trajectory's
weight does not grow with its length, so on those tokens a group's advantages (which sum to zero)
roughly cancel."""


class TrainerConfig(Section):
    """The GRPO step: optimiser, loss, memory, LoRA and the sharded ranks."""

    device: str = Field(
        "cpu", description="torch device of the trained model (fp32 weights and AdamW state)"
    )
    lr: float = Field(5e-4, gt=0, description="AdamW's learning rate of the RL steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    clip_eps: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="the importance ratio is clipped to [1 - clip_eps, 1 + clip_eps]",
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    kl_coef: float = Field(
        0.1,
        ge=0,
        description="k3 KL penalty to the policy RL starts from: it keeps the tool-call format"
        " where the start policy had it while the advantages move the decisions (without it the"
        " CPU example's losers, taking the format down with them, make the reward dip early)",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    micro_batch_tokens: int = Field(
        8192, ge=2, description="most tokens of the rows in one forward and backward"
    )
    # -- memory: logits in chunks, LoRA (trainer/chunked_logprobs.py, trainer/lora.py) --
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="positions projected onto the vocabulary at a time, in forward and backward:"
        " the [tokens, vocab] logits never exist whole",
    )
    lora_rank: int = Field(
        0, ge=0, description="rank of the LoRA adapters (0: off, every weight trains)"
    )
    lora_alpha: float = Field(16.0, gt=0, description="LoRA's update is (alpha / rank) B A")
    lora_targets: list[LoRATarget] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="the projections of each layer that get adapters",
    )
    updates_per_batch: int = Field(1, ge=1, description="PPO epochs: gradient steps per batch")
    off_policy: OffPolicy = Field(
        "ppo",
        description="the off-policy correction: ppo (ratio to the sampler's logprobs), tis, mis"
        " or decoupled (ratio to the trainer's own, times the importance weight to the sampler:"
        " truncated at is_cap, masked past it, or whole)",
    )
    is_cap: float = Field(
        2.0, ge=1, description="tis truncates, mis masks, importance weights above this"
    )
    loss_aggregation: LossAggregation = Field(
        "token_mean", description="weigh every model token alike, or every trajectory alike"
    )
    overlong_buffer_tokens: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong penalty: a trajectory whose model tokens pass"
        " overlong_max_tokens minus this loses reward linearly, up to overlong_penalty at the"
        " limit (0: off)",
    )
    overlong_max_tokens: int | None = Field(
        None,
        ge=1,
        description="the length limit of the overlong penalty, in model tokens of a trajectory"
        " (None: rollout.max_episode_tokens)",
    )
    overlong_penalty: float = Field(
        1.0, gt=0, description="what the overlong penalty takes off a reward at the limit"
    )
    mask_truncated: bool = Field(
        False,
        description="leave trajectories cut at a length limit (finish token_cap or context_cap)"
        " out of the loss, as DAPO's overlong filtering does",
    )

    world_size: int = Field(
        1,
        ge=1,
        description="trainer ranks: 1 trains in the driver's process; N > 1 starts N processes"
        " (Ray actors with runtime.kind=ray) in one torch.distributed group (gloo on CPU, NCCL on"
        " CUDA, one GPU each) sharding the model with FSDP2",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute dtype of the forward and backward (autocast in one process,"
        " FSDP2's mixed precision on the ranks); master weights, gradient reduction and AdamW"
        " state stay float32",
    )
    activation_checkpointing: bool = Field(
        False, description="ranks recompute each decoder layer's activations in the backward"
    )
    cpu_offload: bool = Field(
        False, description="ranks keep sharded weights, gradients and AdamW state in host memory"
    )
    rank_threads: int = Field(1, ge=1, description="torch threads of each trainer rank")
    publish_bucket_mib: float = Field(
        256.0,
        gt=0,
        description="published weights cross processes (the ranks' pipes, Ray's object store)"
        " packed in buckets of at most this size (a larger tensor alone), a few at a time",
    )
    rank_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="longest wait on the trainer ranks for one command (a step, a checkpoint)"
        " before the run stops",
    )

    _device = field_validator("device")(torch_device)

    @field_validator("lora_targets")
    @classmethod
    def _targets_once(cls, targets: list[str]) -> list[str]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"each projection at most once, got {targets}")
        return targets

    @model_validator(mode="after")
    def _ranks_only(self) -> TrainerConfig:
        """The sharded ranks' options, refused where they would be silently ignored."""
        if self.world_size == 1:
            for key, default in (
                ("activation_checkpointing", False),
                ("cpu_offload", False),
            ):
                if getattr(self, key) != default:
                    raise ValueError(
                        f"trainer.{key}={getattr(self, key)} applies to the sharded ranks:"
                        " set trainer.world_size > 1"
                    )
        if self.cpu_offload and not self.device.startswith("cuda"):
            raise ValueError(
                "trainer.cpu_offload keeps a CUDA trainer's shards in host memory; trainer.device"
                f" is {self.device}"
            )
        return self
