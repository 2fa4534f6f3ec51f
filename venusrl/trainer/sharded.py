"""One trainer rank: the model sharded over the ranks' process group with FSDP2 (`fully_shard`
per decoder layer and at the root), and the GRPO trainer that steps it.

The step is `GRPOTrainer`'s, over this rank's share of the rows, with three differences that make
N ranks' update the 1-rank update: the rows' loss weights sum to 1 over the whole batch (the
driver computes them) and FSDP sums the ranks' gradients instead of averaging them; every rank
runs as many micro-batches (FSDP's gathers and reductions are collectives); the gradient norm is
of the whole gradient (its shards are DTensors).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from venusrl.model.architecture import CausalLM, Linear, ModelConfig
from venusrl.model.directory import load_model, read_model_config
from venusrl.model.weight_stream import WeightStream
from venusrl.trainer.checkpoint import SHARDED, write_weights_dir
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.lora import LoRALinear, add_adapters
from venusrl.trainer.trainer import GRPOTrainer, _Row
from venusrl.types import Trajectory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_model(model: CausalLM, config: TrainerConfig) -> CausalLM:
    """`model`, its parameters now this rank's shards (in place)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module._packed = None  # an inference copy of the whole weight: not on a rank
    mixed = MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype], reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()
    for layer in model.layers:
        if config.activation_checkpointing:
            # Inside the layer's FSDP unit, as torchtitan does: the recomputation in the
            # backward runs while the layer's parameters are gathered for its gradients.
            forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
            setattr(layer, "forward", forward)  # noqa: B010 - an instance's, not the class's
        fully_shard(layer, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)
    register_fsdp_forward_method(model, "forward_rows")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss weights already sum to 1 over all ranks' tokens: the ranks' gradients
            # add up to the whole batch's, where FSDP's default would average them.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def empty_sharded_model(
    model_config: ModelConfig, config: TrainerConfig, device: torch.device, adapters: bool = False
) -> CausalLM:
    """A model sharded over the ranks' group, each rank's shards allocated and not yet filled;
    with `adapters` (`trainer.lora_rank`), LoRA adapters attached before sharding and sharded
    like the weights."""
    with torch.device("meta"):
        model = CausalLM(model_config)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if adapters:  # its A, drawn on the host then moved to meta, is filled by the caller
        add_adapters(model, config.lora_rank, config.lora_alpha, config.lora_targets)
    shard_model(model, config)
    # Offloaded shards live in host memory (FSDP2 refuses them on the device); the rotary
    # table is computed where the forward runs.
    model.to_empty(device="cpu" if config.cpu_offload else device)
    model.rotary.reset_cache(device)
    return model


def load_sharded_model(
    model_dir: Path, config: TrainerConfig, device: torch.device, adapters: bool = False
) -> CausalLM:
    """The model of `model_dir`, sharded: rank 0 reads the weights and sends each rank its
    shards; the others never hold the whole model. With `adapters` (`trainer.lora_rank`), LoRA
    adapters are attached before sharding, initialised by rank 0 as one process would (same
    seed), and sharded like the weights."""
    whole = {}
    if dist.get_rank() == 0:
        full = load_model(model_dir, "cpu")
        if adapters:
            add_adapters(full, config.lora_rank, config.lora_alpha, config.lora_targets)
        whole = full.state_dict()
    model = empty_sharded_model(read_model_config(model_dir), config, device, adapters)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole, options=options)
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: a shard's gathered from every rank (collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _padding_row() -> _Row:
    """A row that trains nothing (weight 0), for a rank with fewer micro-batches than another."""
    t = Trajectory.start("padding", "padding", "padding", [0])
    t.add_model_turn([0], [0.0], [0])
    return t, 0.0, 0.0


class ShardedTrainer(GRPOTrainer):
    """`GRPOTrainer` on one rank of a sharded model; every call is collective (all ranks make
    it, in the same order)."""

    @classmethod
    def load(
        cls,
        model_dir: Path,
        config: TrainerConfig,
        device: torch.device,
        version: int,
        temperature: float,
        resume: bool,
    ) -> ShardedTrainer:
        """The model of `model_dir`, sharded; on `resume` (a checkpoint's directory), with the
        model and optimizer shards saved there."""
        model = load_sharded_model(model_dir, config, device, adapters=config.lora_rank > 0)
        trainer = cls(model, config, version, temperature=temperature)
        if resume:
            trainer.load_sharded(model_dir / SHARDED)
        return trainer

    def _compute_precision(self) -> AbstractContextManager[object]:
        return nullcontext()  # FSDP2's mixed-precision policy casts (`shard_model`)

    def freeze_reference(self) -> CausalLM:
        """The current weights become the KL reference, sharded as the policy is: each rank
        copies its own shards (no gather, never a whole model on a rank), adapters too (the
        reference computes with the merged weights of now)."""
        compute_device = self.model.rotary.cos.device
        adapters = self.config.lora_rank > 0
        reference = empty_sharded_model(self.model.config, self.config, compute_device, adapters)
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), reference.parameters(), strict=True):
                theirs.copy_(mine)  # shard to shard: the same placements on every rank
        self.reference = reference.requires_grad_(False).eval()
        return self.reference

    def use_reference(self, model_dir: Path) -> None:
        reference = load_sharded_model(model_dir, self.config, self.device)
        self.reference = reference.requires_grad_(False).eval()

    def hf_weights(self) -> WeightStream:
        """The whole weights under Hugging Face names, gathered one parameter at a time (fp32
        master weights, whatever the compute dtype)."""

        def gathered(name: str) -> torch.Tensor:
            module_name, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            if leaf == "weight" and isinstance(module, LoRALinear):
                return module.merged_weight(_whole)  # what the engines and checkpoints get
            return _whole(self.model.get_parameter(name).detach())

        return WeightStream(self.model.hf_manifest(), self.model.hf_named(gathered))

    def write_model_dir(self, out: Path, like: Path) -> None:
        """Rank 0 writes the consolidated model directory (one whole copy, in host memory)."""
        weights = self.hf_weights()
        if dist.get_rank() == 0:
            write_weights_dir(out, weights, like)
        else:
            for _ in weights:  # the gathers are collective
                pass

    def save_sharded(self, out: Path) -> None:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=out)

    def load_sharded(self, path: Path) -> None:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.load({"model": model, "optimizer": optimizer}, checkpoint_id=path)  # in place
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model, optim_state_dict=optimizer
        )

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        batches = super()._micro_batches(rows)
        # On the model's device: an NCCL group reduces device tensors only.
        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return batches + [[_padding_row()]] * (int(count) - len(batches))

    def _update(
        self, rows: list[_Row], total: int, proximal: list[torch.Tensor]
    ) -> tuple[dict[str, float], float]:
        sums, grad_norm = super()._update(rows, total, proximal)
        values = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        return dict(zip(sums, values.tolist(), strict=True)), grad_norm

    def _clip_grads(self) -> float:
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        if isinstance(norm, DTensor):  # a partial norm on each rank, reduced here
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, self.config.max_grad_norm, norm)
        return float(norm)

    def _summed(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total)
