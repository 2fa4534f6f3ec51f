"""Where each step's metrics go (`run.loggers`): `metrics.jsonl`, the run's record, always;
TensorBoard event files in `RUN/tensorboard/` and a W&B run in `RUN/wandb/` on request.

Each backend is a `Logger`; `RunLoggers` writes to all of them. The record comes first and its
failure stops the run; another backend that fails is dropped with a message, so a full disk
under TensorBoard or a W&B outage never costs a step, `metrics.jsonl` or a checkpoint.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from venusrl.config import Config
from venusrl.runtime import record

log = logging.getLogger(__name__)

# The section of a metrics.jsonl key in TensorBoard and W&B (`trainer/loss`); nested dicts
# (`engine`, `pool`, `since_last_step`, `by_env`) are sections of their own.
SECTIONS = {
    "trainer": (
        "loss", "entropy", "kl", "clip_fraction", "ratio_mean", "grad_norm", "tokens",
        "weight_version", "is_weight_mean", "is_capped_fraction", "sampler_kl",
    ),
    "rollout": (
        "reward_mean", "wins", "tool_calls_mean", "tool_calls_per_win", "staleness_mean",
        "staleness_max", "groups", "groups_started", "groups_running", "episodes_resumed",
        "admission_window", "window_kv_tokens", "window_pauses", "window_waits", "episodes_active",
        "episodes_held_back", "sandboxes_running", "versions_per_trajectory_max",
        "tool_calls_seen", "groups_uniform",
    ),
    "failures": ("infra_failures", "env_failures", "masked", "groups_dropped"),
}  # fmt: skip
SECTION_OF = {key: section for section, keys in SECTIONS.items() for key in keys}


class Logger(Protocol):
    """One place a step's metrics go."""

    def log(self, line: dict[str, Any]) -> None:
        """A step's `metrics.jsonl` line (its `step` included)."""
        ...

    def close(self, failed: bool) -> None:
        """The run is over; `failed`: it stopped on an error (or Ctrl-C)."""
        ...


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """A metrics line as named scalars: `trainer/loss`, `engine/generated_tokens`,
    `by_env/guess_number/reward_mean`; missing values (None) and lists are left out."""
    out: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{name}/{key}", inner)
        elif isinstance(value, int | float):  # bools included, as 0 and 1
            out[name] = float(value)

    for key, value in line.items():
        if key == "step":
            continue
        add(key if isinstance(value, dict) else f"{SECTION_OF.get(key, 'run')}/{key}", value)
    return out


class JsonlLogger:
    """`metrics.jsonl`: one JSON line a step, read by `--resume`, plots and `venusrl show`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / record.METRICS_FILE

    def log(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self, failed: bool) -> None:
        pass


class TensorBoardLogger:
    """Event files in `RUN/tensorboard/`, stepped by the trainer step. A resumed run writes on
    in the same directory from the step after its checkpoint; the events the killed run wrote
    for the steps redone are purged (`purge_step`), so each step shows once."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        SummaryWriter = _require("tensorboard")
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step or None)

    def log(self, line: dict[str, Any]) -> None:
        for name, value in scalars(line).items():
            self.writer.add_scalar(name, value, line["step"])
        self.writer.flush()  # a step is minutes apart: show it now, not in two minutes

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run with the run's config, its files in `RUN/wandb/`. Its id is kept in
    `RUN/wandb-run-id`, so a resumed run continues the same W&B run; charts are drawn over
    `step` (W&B's own step only goes forward: a step redone after a resume is a second point)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        wandb = _require("wandb")
        id_file = run_dir / "wandb-run-id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(6))  # W&B ids: lowercase letters, digits
        try:
            self.run = wandb.init(
                project=cfg.run.wandb_project,
                name=cfg.run.wandb_name or run_dir.resolve().name,
                mode=cfg.run.wandb_mode,
                dir=str(run_dir),
                config=cfg.model_dump(),
                id=id_file.read_text().strip(),
                resume="allow",
                allow_val_change=True,  # a resume may change keys (run.steps=N to train longer)
            )
        except Exception as e:
            raise ValueError(
                f"run.loggers: wandb could not start a run ({type(e).__name__}: {e}); `wandb"
                " login`, or run.wandb_mode=offline and `wandb sync RUN/wandb/offline-run-*`"
                " later"
            ) from e
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, line: dict[str, Any]) -> None:
        self.run.log({"step": line["step"], **scalars(line)})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # W&B shows the run failed, or finished


def _require(logger: str) -> Any:
    """The writer class (TensorBoard) or module (W&B) of a logger, or an error naming the key
    and what to install."""
    try:
        if logger == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as e:
        raise ValueError(
            f"run.loggers: {logger} needs the {logger} package ({e}): pip install {logger}"
            " (or pip install 'venusrl[loggers]')"
        ) from None


class RunLoggers:
    """Every logger of the run: the record first, whose failure stops the run; another that
    fails is dropped, saying so, and the run goes on without it."""

    def __init__(self, loggers: dict[str, Logger], say: Callable[[str], None]) -> None:
        self.loggers, self.say = loggers, say

    def log(self, line: dict[str, Any]) -> None:
        for name, logger in list(self.loggers.items()):
            if name == "jsonl":
                logger.log(line)
                continue
            try:
                logger.log(line)
            except Exception as e:
                log.info("logger %s failed", name, exc_info=True)
                self.say(
                    f"warning: the {name} logger failed at step {line['step']} ({type(e).__name__}:"
                    f" {e}); the run goes on without it (metrics.jsonl has every step)"
                )
                del self.loggers[name]
                self._close(name, logger, failed=True)

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        for name, logger in self.loggers.items():
            self._close(name, logger, failed=error is not None)
        self.loggers = {}

    def _close(self, name: str, logger: Logger, failed: bool) -> None:
        try:
            logger.close(failed)
        except Exception:
            log.warning("logger %s failed to close", name, exc_info=True)


def open_loggers(
    cfg: Config, run_dir: Path, first_step: int, say: Callable[[str], None]
) -> RunLoggers:
    """The loggers `run.loggers` names, for a run whose next step is `first_step`."""
    loggers: dict[str, Logger] = {}
    try:
        for name in sorted(cfg.run.loggers, key=lambda name: name != "jsonl"):  # the record first
            if name == "jsonl":
                loggers[name] = JsonlLogger(run_dir)
            elif name == "tensorboard":
                loggers[name] = TensorBoardLogger(run_dir, first_step)
            else:
                loggers[name] = WandbLogger(cfg, run_dir)
    except BaseException:
        with RunLoggers(loggers, say):
            raise
    return RunLoggers(loggers, say)
