"""Checkpoints a run can resume from after any crash, `kill -9` included.

A checkpoint is a directory `checkpoints/step-NNNNNN/` in Hugging Face layout (`config.json`,
`model.safetensors`, the tokenizer files: `venusrl serve` and `transformers` load it as it is) plus
`optimizer.pt` and `state.json` (the step it follows, the weight version, the coordinator's data
position). It is written under a temporary name, flushed, then renamed: a directory with the final
name is always complete, whatever moment the process dies at. The newest complete one wins.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from venusrl.engine.model import CausalLM

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


def write_model_dir(out: Path, model: CausalLM, like: Path) -> None:
    """`model`'s weights as a Hugging Face model directory, with `like`'s config and tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (like / name).exists():
            shutil.copy2(like / name, out / name)
    weights = {k: v.to("cpu", copy=True).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))


def save_checkpoint(
    run_dir: Path,
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    state: RunState,
    model_dir: Path,
    keep: int = 2,
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    tmp = root / f".tmp-step-{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model_dir(tmp, model, model_dir)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob("step-*"))
    complete = [p for p in found if (p / "state.json").exists()]
    return complete[-1] if complete else None


def load_run_state(checkpoint: Path) -> RunState:
    data: dict[str, Any] = json.loads((checkpoint / "state.json").read_text())
    return RunState(**data)
