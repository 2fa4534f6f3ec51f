"""Checkpoints a run can resume from after any crash, `kill -9` included.

A checkpoint is a directory `checkpoints/step-NNNNNN/` (after trainer step NNNNNN; `step-start/`
holds the warm-started policy, before the first step) in Hugging Face layout (`config.json`,
`model.safetensors`, the tokenizer files: `venusrl serve` and `transformers` load it as it is) plus
the optimizer's state (`optimizer.pt`; a sharded trainer's model and optimizer shards in
`sharded/`, written by `torch.distributed.checkpoint`, which any number of ranks read back) and
`state.json` (the step it follows, the weight version, the coordinator's data position); with
LoRA, the weights are merged and `lora_adapters.pt` holds the adapters. It is
written under a temporary name, flushed, then renamed: a directory with the final name is always
complete, whatever moment the process dies at. The newest one that reads back wins.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader

from venusrl.model.architecture import CausalLM
from venusrl.trainer.lora import ADAPTERS_FILE, save_adapters

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class RunState:
    step: int  # the last completed trainer step
    weight_version: int
    consumed_tasks: list[str] = field(default_factory=list)  # mixing.task_key of those trained


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    """The directory of the checkpoint after trainer step `step`; step -1 is the warm start's."""
    return "step-start" if step < 0 else f"step-{step:06d}"


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest first (by the step each follows, the warm start's first)."""

    def step(path: Path) -> int:
        digits = path.name.removeprefix("step-")
        return int(digits) if digits.isdigit() else -1

    return sorted((run_dir / "checkpoints").glob("step-*"), key=step)


SHARDED = "sharded"  # the directory of a sharded trainer's `torch.distributed.checkpoint`


def write_model_dir(out: Path, model: CausalLM, like: Path) -> None:
    """`model`'s weights as a Hugging Face model directory, with `like`'s config and tokenizer."""
    write_weights_dir(out, model.hf_state_dict().items(), like)


def write_weights_dir(out: Path, weights: Iterable[tuple[str, torch.Tensor]], like: Path) -> None:
    """Hugging Face-named `weights` as a model directory, with `like`'s config and tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (like / name).exists():
            shutil.copy2(like / name, out / name)
    tensors = {k: v.to("cpu", copy=True).contiguous() for k, v in weights}
    save_file(tensors, str(out / "model.safetensors"))


def save_checkpoint(
    run_dir: Path,
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    state: RunState,
    model_dir: Path,
    keep: int = 2,
) -> Path:
    def write(tmp: Path) -> None:
        write_model_dir(tmp, model, model_dir)
        save_adapters(model, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")

    return commit_checkpoint(run_dir, state, model_dir, write, keep)


def commit_checkpoint(
    run_dir: Path, state: RunState, model_dir: Path, write: Callable[[Path], None], keep: int = 2
) -> Path:
    """The checkpoint of `state`, its files written by `write(directory)`, then made durable and
    renamed into place; the oldest beyond `keep` go."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
    for f in tmp.rglob("*"):
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    for d in [*(d for d in tmp.rglob("*") if d.is_dir()), tmp]:
        _fsync_dir(d)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    for old in checkpoints(run_dir)[:-keep]:
        # A resumed run's `model_dir` is the checkpoint it resumed from, and every checkpoint it
        # writes copies its config and tokenizer from there: removed, the next ones lack them.
        if old.resolve() != model_dir.resolve():
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(
    run_dir: Path, on_skip: Callable[[Path, str], None] | None = None
) -> Path | None:
    """The newest checkpoint that reads back whole. A damaged one (a run directory copied or
    synced in part: the atomic rename rules out a torn write) is passed over, not removed, and
    `on_skip(path, why)` says so."""
    for path in reversed(checkpoints(run_dir)):
        try:
            check_checkpoint(path)
        except ValueError as e:
            if on_skip is not None:
                on_skip(path, str(e))
            continue
        return path
    return None


def check_checkpoint(checkpoint: Path) -> RunState:
    """Its state, after checking that every file of it reads back; ValueError naming the file
    that does not."""
    state = load_run_state(checkpoint)
    if not (checkpoint / "config.json").is_file():  # the model cannot be built without it
        raise ValueError(f"{checkpoint / 'config.json'}: missing")
    weights = checkpoint / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{weights}: unreadable ({e})") from None
    if (checkpoint / SHARDED).is_dir():
        try:  # the index of the shards, each shard's files named in it
            FileSystemReader(checkpoint / SHARDED).read_metadata()
        except Exception as e:
            raise ValueError(f"{checkpoint / SHARDED}: unreadable ({e})") from None
        return state
    for archive in (checkpoint / "optimizer.pt", checkpoint / ADAPTERS_FILE):
        if archive.name == ADAPTERS_FILE and not archive.exists():
            continue  # written without LoRA
        try:  # mapped, not read: the archive's structure is checked, the tensors are not loaded
            torch.load(archive, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise ValueError(f"{archive}: unreadable ({e})") from None
    return state


def load_run_state(checkpoint: Path) -> RunState:
    path = checkpoint / "state.json"
    try:
        data = json.loads(path.read_text())
        return RunState(
            step=int(data["step"]),
            weight_version=int(data["weight_version"]),
            consumed_tasks=[str(k) for k in data.get("consumed_tasks", [])],
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a run state ({type(e).__name__}: {e})") from None
