"""`venusrl show`: the trajectories of a run's `trajectories.jsonl` as people read them, decoded
with the run's tokenizer, turn by turn: what the model wrote, the tool calls parsed from it, what
the environment answered, the weight version that sampled each turn and how stale it was when
trained on, and the episode's reward, finish and failure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.rule import Rule
from rich.text import Text

from venusrl.config import load_config
from venusrl.model.tokenizer import Tokenizer
from venusrl.model.tool_calls import ToolCall
from venusrl.model.tool_formats import ToolParser, resolve_tool_parser, tool_parser
from venusrl.runtime import record
from venusrl.trainer.checkpoint import checkpoints


def run_tokenizer(run_dir: Path) -> Tokenizer:
    """The tokenizer of the model directory the run trained: its start policy (`start-model/`),
    else its newest checkpoint, the `model` it was given, or the model it made
    (`initial-model/`)."""
    config = run_dir / "config.yaml"
    given = load_config(config).model if config.exists() else None
    candidates = [
        run_dir / "start-model",
        *reversed(checkpoints(run_dir)),
        *([Path(given)] if given else []),
        run_dir / "initial-model",
    ]
    for model_dir in candidates:
        tokenizer = Tokenizer.load(model_dir)
        if tokenizer is not None:
            return tokenizer
    raise ValueError(
        f"{run_dir}: no tokenizer.json in {', '.join(str(c) for c in candidates)}: the run's"
        " model directories are gone, and the token ids cannot be read"
    )


@dataclass(frozen=True)
class Selection:
    """Which trajectories to show: a step's (the last one by default), or one by its id."""

    step: int | None = None
    trajectory_id: str | None = None
    limit: int = 4


def select(run_dir: Path, which: Selection) -> tuple[list[dict[str, Any]], int]:
    """The records to show, and how many matched before `limit`."""
    if not (run_dir / record.FILE).exists():
        raise ValueError(f"{run_dir} has no {record.FILE}: not the directory of a run that trained")
    records = list(record.read_records(run_dir))
    if which.trajectory_id is not None:
        chosen = [r for r in records if r["trajectory_id"] == which.trajectory_id]
        if not chosen:
            raise ValueError(f"--trajectory: no trajectory {which.trajectory_id!r} in {run_dir}")
    else:
        steps = sorted({r["step"] for r in records})
        if not steps:
            raise ValueError(f"{run_dir}/{record.FILE} is empty: no step has finished yet")
        step = steps[-1] if which.step is None else which.step
        if step not in steps:
            raise ValueError(f"--step: {run_dir} has steps {steps[0]}..{steps[-1]}, not {step}")
        chosen = [r for r in records if r["step"] == step]
    return chosen[: which.limit], len(chosen)


def visible(text: str) -> str:
    """Control characters a model may sample, escaped (`\\x05`): printed, they would move the
    cursor or ring the terminal; newlines and tabs stay."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def transcripts(run_dir: Path, records: list[dict[str, Any]]) -> Iterator[Group]:
    """A transcript per record, decoded with the run's tokenizer."""
    tokenizer = run_tokenizer(run_dir)
    config = run_dir / "config.yaml"
    setting = load_config(config).rollout.tool_parser if config.exists() else "auto"
    parser = resolve_tool_parser(setting, tokenizer.chat_template)
    # The trainer's version when it trained each step: staleness is how far behind it a turn's
    # weights were (as `staleness_mean` in metrics.jsonl).
    trained_at = {m["step"]: m["weight_version"] - 1 for m in record.read_metrics(run_dir)}
    for r in records:
        yield transcript(r, tokenizer, trained_at.get(r["step"]), parser)


def transcript(
    r: dict[str, Any],
    tokenizer: Tokenizer,
    trained_at: int | None,
    parser: ToolParser | None = None,
) -> Group:
    """A title rule, then the episode's outcome, its prompt, and each turn: the model's text,
    the tool calls parsed from it (in `parser`'s format; Hermes when not given), the
    observation; text decoded as the model saw it, special tokens included."""
    ids, starts = r["token_ids"], r["turn_starts"]

    def text(a: int, b: int) -> str:
        return visible(tokenizer.decode(ids[a:b], skip_special_tokens=False))

    reward = "masked" if r["reward"] is None else f"{r['reward']:g}"
    title = (
        f"{r['trajectory_id']}  step {r['step']}  {r['env']}  group {r['group_id']}"
        f"  prompt {r['prompt_id']}"
    )
    parts: list[Rule | Text] = [
        Rule(title, align="left"),
        Text.assemble(
            ("reward ", "bold"), reward, ("  finish ", "bold"), r["finish"] or "-",
            ("  tool calls ", "bold"), str(r["tool_calls"]),
            ("  trained at version ", "bold"), "-" if trained_at is None else str(trained_at),
        ),
    ]  # fmt: skip
    if r["failure"]:
        parts.append(Text(f"failure ({r['failure_kind']}): {r['failure']}", style="bold red"))
    first = starts[0] if starts else len(ids)
    parts += [Text(f"prompt ({first} tokens)", style="bold"), Text(text(0, first), style="dim")]
    bounds = [*starts, len(ids)]
    for i, turn in enumerate(r["turns"]):
        start, end = bounds[i], bounds[i + 1]
        action_end = start + turn["action_tokens"]
        versions = turn.get("weight_versions")  # older records do not have them
        stale = (
            "-"
            if versions is None or trained_at is None
            else ",".join(str(trained_at - v) for v in versions)
        )
        shown = "-" if versions is None else ",".join(map(str, versions))
        parts.append(
            Text(
                f"turn {i + 1}  version {shown}  staleness {stale}  {turn['action_tokens']} model"
                f" tokens, {turn['observation_tokens']} observation tokens",
                style="bold",
            )
        )
        model_text = text(start, action_end)
        parts.append(Text.assemble(("model  ", "bold green"), (model_text, "green")))
        for call in (parser or tool_parser("hermes")).parse(
            tokenizer.decode(ids[start:action_end])
        ):
            if isinstance(call, ToolCall):
                args = json.dumps(call.arguments)
                parts.append(Text(f"tool call  {call.name}({args})", style="bold magenta"))
            else:
                parts.append(Text(f"tool call, malformed  {call.message}", style="bold red"))
        if end > action_end:
            observation = text(action_end, end)
            parts.append(Text.assemble(("observation  ", "bold cyan"), (observation, "cyan")))
    return Group(*parts)
