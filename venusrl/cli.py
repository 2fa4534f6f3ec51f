"""`venusrl` command line: train | eval | serve | sim | plot | show | model init | generate |
swe validate."""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from venusrl.config import ConfigError, load_config
from venusrl.model.hub import model_path
from venusrl.model.presets import PRESETS

if TYPE_CHECKING:  # rich is imported by the commands that print with it
    from rich.console import Console

# Seconds `venusrl serve` waits for requests in flight when told to stop, before it cuts them.
SHUTDOWN_GRACE_S = 10

# What `add_subparsers` returns: each `_add_*` adds its command to it.
Subcommands = argparse._SubParsersAction


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    # argparse takes the positionals of `eval MODEL --json k=v` in one run: overrides after an
    # option come back unparsed.
    if rest and hasattr(args, "overrides") and all("=" in a and a[0] != "-" for a in rest):
        args.overrides += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"venusrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # What ran has cleaned up on its way out (sandboxes, engines, the run's files); a
        # traceback of where the signal landed would only hide that.
        hint = " (--resume continues from the last checkpoint)" if args.command == "train" else ""
        print(f"venusrl {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="venusrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_eval, _add_serve, _add_model, _add_generate, _add_plot,
                _add_show, _add_sim, _add_swe):  # fmt: skip
        add(sub)
    return parser


def _add_train(sub: Subcommands) -> None:
    train = sub.add_parser("train", help="train an agent with GRPO on an environment")
    train.add_argument(
        "--model",
        help="starting model directory or hub id in the local Hugging Face cache (default: a new"
        " micro model, tokenizer learnt from demos)",
    )
    train.add_argument(
        "--run-dir", help="where config, metrics and checkpoints go (default: runs/train-TIME)"
    )
    train.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    train.add_argument(
        "--runtime",
        choices=("local", "ray"),
        help="one process (default), or engines and sandbox pools as Ray actors (runtime.kind)",
    )
    _config_args(train)
    train.set_defaults(run=_train)


def _add_eval(sub: Subcommands) -> None:
    ev = sub.add_parser(
        "eval",
        help="play a model or checkpoint on an environment's tasks (its held-out stream, or a"
        " task file): reward, pass@k",
    )
    ev.add_argument(
        "model",
        metavar="MODEL_OR_CHECKPOINT",
        help="a model directory, a hub id in the local Hugging Face cache, a run's"
        " checkpoints/step-N, or a run (its newest checkpoint)",
    )
    ev.add_argument(
        "--env", metavar="NAME", help="built-in or path.py:Class (default: the run's rollout.env)"
    )
    ev.add_argument(
        "--episodes", metavar="N", type=int, help="tasks (default 32; of --tasks: all of them)"
    )
    ev.add_argument(
        "--tasks",
        metavar="FILE",
        help="play the tasks of a .jsonl or .parquet file, in order (default: the run's"
        " rollout.tasks (tasks it trained on), else the environment's held-out stream)",
    )
    ev.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="a --tasks line's field to read a task's NAME from, e.g. --field prompt=question",
    )
    ev.add_argument("--k", metavar="K", type=int, default=1, help="pass@1 and pass@K (default 1)")
    ev.add_argument("--samples", metavar="N", type=int, help="episodes per task, >= K (default K)")
    how = ev.add_mutually_exclusive_group()
    how.add_argument(
        "--temperature", metavar="T", type=float, help="default: the config's rollout.temperature"
    )
    how.add_argument("--greedy", action="store_true", help="temperature 0 (one sample per task)")
    ev.add_argument(
        "--seed",
        metavar="S",
        type=int,
        help="task stream and sampling seed (default: run.seed, engine.seed)",
    )
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument(
        "--out", metavar="FILE", help="write one JSON line per episode, its transcript decoded"
    )
    _config_args(ev)
    ev.set_defaults(run=_eval)


def _add_serve(sub: Subcommands) -> None:
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible + /generate)")
    serve.add_argument(
        "--model", help="Hugging Face-format model directory, or a hub id in the local cache"
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    _config_args(serve)
    serve.set_defaults(run=_serve)


def _add_model(sub: Subcommands) -> None:
    model = sub.add_parser("model", help="model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="write a random-weight Qwen3 model directory")
    init.add_argument("out", help="directory to write")
    init.add_argument("--preset", default="tiny", help="named shape: " + ", ".join(PRESETS))
    init.add_argument("--config", dest="hf_config", help="JSON file of config.json fields")
    init.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config.json field, e.g. --set num_hidden_layers=2",
    )
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--force", action="store_true", help="write into a directory that is not empty"
    )
    init.set_defaults(run=_model_init)


def _add_generate(sub: Subcommands) -> None:
    gen = sub.add_parser("generate", help="generate from a prompt in-process and print JSON")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    _config_args(gen)
    gen.set_defaults(run=_generate)


def _add_plot(sub: Subcommands) -> None:
    plot = sub.add_parser("plot", help="draw a run's reward, timeline and staleness plots")
    plot.add_argument("run_dir", help="the run directory of `venusrl train`")
    plot.set_defaults(run=_plot)


def _add_show(sub: Subcommands) -> None:
    show = sub.add_parser("show", help="print a run's trajectories as decoded transcripts")
    show.add_argument("run_dir", help="the run directory of `venusrl train`")
    which = show.add_mutually_exclusive_group()
    which.add_argument(
        "--step", type=int, help="the trainer step whose batch to show (default: the last)"
    )
    which.add_argument("--trajectory", help="one trajectory, by its trajectory_id")
    show.add_argument("--limit", type=int, default=4, help="trajectories shown at most (default 4)")
    show.set_defaults(run=_show)


def _add_sim(sub: Subcommands) -> None:
    sim = sub.add_parser("sim", help="compare schedulers at cluster scale in simulation")
    what = sim.add_mutually_exclusive_group()
    what.add_argument(
        "--scenario", default="swe-long", help="a built-in workload (default swe-long)"
    )
    what.add_argument("--workload", help="a workload YAML file (see venusrl/workloads.py)")
    sim.add_argument(
        "--policies",
        default="sync,async,venus",
        help=(
            "comma-separated: sync, async, concur, venus; NAME+offload gives a baseline the host"
            " tier ours has; NAME@N sets a staleness bound of N (and trains a group at most N"
            " versions after it started),"
            " NAME@N:L trains it up to L versions after (default: 1:4 for every policy but"
            " sync); NAME[KNOB=VALUE,...] sets its knobs (venus[leave_after_calls=5])"
        ),
    )
    sim.add_argument(
        "--cost",
        default="",
        help="KEY=VALUE,...: constants of the cost model set otherwise (gpu.pcie_h2d=inf)",
    )
    sim.add_argument(
        "--seeds",
        default="0",
        help="comma-separated workload seeds: figures per seed, their median and the worst",
    )
    sim.add_argument("--steps", type=int, default=4, help="trainer steps per policy")
    sim.add_argument(
        "--jobs",
        type=int,
        help="policies simulated at once, one process each (default: all of them)",
    )
    sim.add_argument(
        "--weight-update",
        choices=("keep", "flush", "drain"),
        default="keep",
        help=(
            "how engines take new weights: keep (between two iterations, requests in flight"
            " and trajectories between turns keeping their KV), flush (keep, then drop every KV"
            " no running request holds) or drain (their requests in flight run to the end of"
            " their turn first, none admitted)"
        ),
    )
    sim.add_argument(
        "--decide-every-iteration",
        action="store_true",
        help=(
            "ask the scheduler at every engine iteration (many times slower; the same figures,"
            " up to float rounding: a check that merging iterations changes nothing)"
        ),
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(run=_sim)


def _add_swe(sub: Subcommands) -> None:
    swe = sub.add_parser("swe", help="SWE task files: check them before training")
    swe_sub = swe.add_subparsers(dest="swe_command", required=True)
    check = swe_sub.add_parser(
        "validate",
        help="for each row: the image loads, FAIL_TO_PASS fails without the gold patch and"
        " passes with it, PASS_TO_PASS passes both ways",
    )
    check.add_argument("tasks", help="the task file (JSONL or Parquet, any SWE format)")
    check.add_argument("--jobs", type=int, default=2, help="rows checked at a time")
    check.add_argument("--limit", type=int, default=None, help="the first N rows only")
    check.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    check.add_argument("--json", action="store_true", help="one JSON object per row instead")
    check.add_argument(
        "--field", action="append", default=[], metavar="NAME=COLUMN",
        help="read a task field from another column (id=instance_id)",
    )  # fmt: skip
    _config_args(check)
    check.set_defaults(run=_swe_validate)


def _swe_validate(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import asdict

    from venusrl.envs.builtin.swe import Swe
    from venusrl.envs.pool import SandboxPool
    from venusrl.envs.swe.tasks import SweTask
    from venusrl.envs.swe.validate import validate
    from venusrl.envs.task_file import parse_fields, read_task_file

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    cfg = load_config(args.config, args.overrides)
    rows = read_task_file(Path(args.tasks), Swe, parse_fields(args.field))
    tasks = [SweTask.from_reference(t.reference) for t in rows[: args.limit]]

    async def run() -> list[Any]:
        async with SandboxPool.from_config(cfg.sandbox) as pool:
            return await validate(pool, tasks, args.jobs, args.timeout)

    checks = asyncio.run(run())
    if args.json:
        for c in checks:
            print(json.dumps({**asdict(c), "valid": c.valid}))
    else:
        _print_validation(checks, args.tasks)
    return 0 if all(c.valid for c in checks) else 1


def _print_validation(checks: list[Any], source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def frac(pair: tuple[int, int] | None) -> str:
        return "-" if pair is None else f"{pair[0]}/{pair[1]}"

    table = Table(title=f"{source}: {sum(c.valid for c in checks)} of {len(checks)} rows valid")
    for name in ("row", "instance", "image", "F2P fail before", "F2P pass after",
                 "P2P pass before", "P2P pass after", "s", "problem"):  # fmt: skip
        table.add_column(name, overflow="fold")
    for c in checks:
        table.add_row(
            str(c.row), c.instance_id, "ok" if c.image else "no", frac(c.fail_before),
            frac(c.pass_after), frac(c.p2p_before), frac(c.p2p_after), f"{c.seconds:.1f}",
            "; ".join(c.problems) or "valid",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. engine.page_size=32",
    )


def _train(args: argparse.Namespace) -> int:
    import asyncio

    from venusrl.runtime.train import train
    from venusrl.trainer.ranks import RankFailed

    flags = {"model": args.model, "runtime.kind": args.runtime}
    config = args.config
    if args.resume:
        if not args.run_dir:
            raise ValueError("--resume needs the --run-dir of the run to continue")
        if config is not None:
            raise ValueError(
                "--resume continues with the run's own config.yaml: give KEY=VALUE overrides"
                " (run.steps=...), not --config"
            )
        config = Path(args.run_dir) / "config.yaml"  # what the run last ran with
        if not config.exists():
            raise ValueError(f"--resume: {args.run_dir} holds no run (it has no config.yaml)")
    cfg = load_config(config, args.overrides, {k: v for k, v in flags.items() if v is not None})
    console = _console()
    show = _StepLine(cfg.run.steps, console.print)

    run_dir = Path(args.run_dir or time.strftime("runs/train-%Y%m%d-%H%M%S"))
    console.print(f"run directory {run_dir}")
    try:
        asyncio.run(train(cfg, run_dir, on_step=show, resume=args.resume, on_message=console.print))
    except RankFailed as e:  # the run stops; its checkpoints stay
        checkpoints = any((run_dir / "checkpoints").glob("step-*"))
        then = "--resume continues from the last checkpoint" if checkpoints else "no checkpoint yet"
        print(f"venusrl train: error: {e}\n{then}", file=sys.stderr)
        return 1
    console.print(f"metrics in {run_dir / 'metrics.jsonl'}")
    if "tensorboard" in cfg.run.loggers:
        console.print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    from venusrl.runtime.plots import plot_run

    console.print("plots: " + ", ".join(str(p) for p in plot_run(run_dir)))
    console.print(f"transcripts of the last step's trajectories: venusrl show {run_dir}")
    if "wandb" in cfg.run.loggers:
        console.print(
            f"W&B: the run's files in {run_dir / 'wandb'} (an offline run is uploaded by"
            f" `wandb sync {run_dir / 'wandb'}/offline-run-*`)"
        )
    console.print(f"play its last checkpoint: venusrl eval {run_dir} --k 4")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import asyncio

    from venusrl.envs.loading import environment_class
    from venusrl.envs.task_file import check_fields, parse_fields, read_task_file
    from venusrl.model.tokenizer import Tokenizer
    from venusrl.runtime import evaluate

    samples = args.k if args.samples is None else args.samples
    evaluate.check_k(args.k, samples)
    if args.episodes is not None and args.episodes < 1:
        raise ValueError(f"--episodes must be >= 1, got {args.episodes}")
    if args.field and not args.tasks:
        raise ValueError("--field maps the fields of a --tasks file: give the file")
    model_dir, run_dir = evaluate.resolve_model(model_path(args.model))
    config = args.config or (run_dir / "config.yaml" if run_dir else None)
    values = {} if args.seed is None else {"run.seed": args.seed, "engine.seed": args.seed}
    cfg = load_config(config, args.overrides, values)
    temperature = 0.0 if args.greedy else args.temperature
    if temperature is None:
        temperature = cfg.rollout.temperature
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if temperature == 0 and samples > 1:
        raise ValueError(
            "greedy sampling (temperature 0) plays a task the same way every time: --k and"
            " --samples > 1 need a --temperature > 0"
        )
    if args.env is not None:
        try:
            env = environment_class(args.env)
        except ValueError as e:
            raise ValueError(f"--env: {e}") from None
    elif cfg.rollout.mix:
        names = ", ".join(entry.env for entry in cfg.rollout.mix)
        raise ValueError(f"the run mixes environments ({names}): choose one with --env")
    else:
        env = environment_class(cfg.rollout.env)
    if args.out:  # refused now, not after the episodes
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).open("a").close()

    task_file = args.tasks
    if args.tasks:
        fields = parse_fields(args.field)
        try:
            check_fields(env, fields)
        except ValueError as e:
            raise ValueError(f"--{'field' if env.reference_fields else 'tasks'}: {e}") from None
        tasks = read_task_file(Path(args.tasks), env, fields)[: args.episodes]
    elif cfg.rollout.tasks and env.name == environment_class(cfg.rollout.env).name:
        # The run's own task file: its first tasks, in file order.
        task_file = cfg.rollout.tasks
        tasks = read_task_file(Path(task_file), env, cfg.rollout.task_fields)
        tasks = tasks[: args.episodes or 32]
    else:
        tasks = evaluate.evaluation_tasks(env, cfg.run.seed, args.episodes or 32)
    started = time.monotonic()
    played = asyncio.run(evaluate.play_policy(model_dir, env, tasks, cfg, temperature, samples))
    report = {
        "model": str(model_dir),
        "env": env.name,
        "temperature": temperature,
        "seed": cfg.run.seed,
        **({"task_file": task_file} if task_file else {}),
        **evaluate.summarize(played, samples, args.k),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.out:
        tokenizer = Tokenizer.load(model_dir)
        assert tokenizer is not None  # resolve_model checked it
        with Path(args.out).open("w") as f:
            for i, traj in enumerate(played):
                record = evaluate.episode_record(traj, i % samples, tokenizer)
                f.write(json.dumps(record) + "\n")
        report["out"] = args.out
    if args.json:
        print(json.dumps(report))
    else:
        _print_eval(report)
    return 0


def _print_eval(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def shown(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}"
        if isinstance(value, dict):
            return ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
        return str(value)

    console = Console()
    console.print(f"{report['model']} on {report['env']}", soft_wrap=True)
    table = Table("figure", "value")
    for key, value in report.items():
        if key == "wall_s":
            table.add_row(key, f"{value:.1f} s")
        elif key not in ("model", "env", "failure_examples"):
            table.add_row(key, shown(value))
    for message in report["failure_examples"]:
        table.add_row("failure", message)
    console.print(table)


def _console(file: IO[str] | None = None) -> Console:
    """The run's console on stderr: a log file (stderr redirected) gets whole lines, not lines
    wrapped at 80 columns."""
    from rich.console import Console

    return Console(stderr=file is None, file=file, soft_wrap=True)


class _StepLine:
    """A trainer step on the console: where the run is (`step i/N`, and when it will end at the
    pace of its recent steps), what the batch scored and what failed since the last step."""

    def __init__(self, steps: int, print_line: Callable[[str], object]) -> None:
        self.steps, self.print_line = steps, print_line
        self.walls: list[float] = []  # wall_s of the steps seen, for the pace

    def __call__(self, m: dict[str, Any]) -> None:
        reward = "-" if m["reward_mean"] is None else f"{m['reward_mean']:.3f}"
        # Model tokens trained per second of the run: the step's tokens over the step's time.
        elapsed = m["wall_s"] - (self.walls[-1] if self.walls else 0.0)
        rate = f"{m['tokens'] / elapsed:.0f}" if m["tokens"] and elapsed > 0 else "-"
        self.walls.append(m["wall_s"])
        failed = m.get("since_last_step", {})
        dropped = failed.get("groups_dropped", 0)
        self.print_line(
            f"step {m['step'] + 1}/{self.steps}  reward {reward}  tool calls"
            f" {m['tool_calls_mean']:.2f}  staleness {m['staleness_mean']:.2f}  tokens/s {rate}"
            f"  sandboxes {m['sandboxes_running']}  infra"
            f" {failed.get('infra_failures', m['infra_failures'])}"
            + (f"  dropped {dropped}" if dropped else "")
            + f"  {m['wall_s']:.0f} s  ETA {self._eta(m['step'])}"
        )

    def _eta(self, step: int) -> str:
        """The steps left at the mean pace of the last ten (the first steps also fill the
        pipeline)."""
        recent = self.walls[-11:]
        left = self.steps - 1 - step
        if left <= 0:
            return "0 s"
        if len(recent) < 2:
            return "-"
        seconds = left * (recent[-1] - recent[0]) / (len(recent) - 1)
        return f"{math.ceil(seconds / 60)} min" if seconds >= 120 else f"{seconds:.0f} s"


def _plot(args: argparse.Namespace) -> int:
    from venusrl.runtime.plots import plot_run

    print(json.dumps({"plots": [str(p) for p in plot_run(Path(args.run_dir))]}))
    return 0


def _show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from venusrl.runtime.transcripts import Selection, select, transcripts

    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    run_dir = Path(args.run_dir)
    records, matched = select(run_dir, Selection(args.step, args.trajectory, args.limit))
    console = Console(soft_wrap=True)
    for shown in transcripts(run_dir, records):
        console.print(shown)
    if matched > len(records):
        console.print(f"{len(records)} of {matched} trajectories shown (--limit {matched} for all)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from venusrl.engine.engine import Engine
    from venusrl.server.app import create_app

    flags = {
        "model": args.model,
        "server.host": args.host,
        "server.port": args.port,
        "server.api_key": args.api_key,
    }
    cfg = load_config(
        args.config, args.overrides, {k: v for k, v in flags.items() if v is not None}
    )
    if cfg.model is None:
        raise ConfigError("no model: pass --model DIR or set `model` in the config")
    if "seed" not in cfg.engine.model_fields_set:
        # As OpenAI's API: a request without a seed samples anew after a restart.
        cfg.engine.seed = secrets.randbelow(2**32)
    engine = Engine.from_model_dir(cfg.model, cfg.engine)
    name = cfg.server.model_name or Path(cfg.model).name
    app = create_app(engine, name, cfg.server.api_key, cfg.server.tool_parser)
    url = f"http://{cfg.server.host}:{cfg.server.port}"
    print(f"venusrl serve: {name} at {url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    uvicorn.run(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return 0


def _model_init(args: argparse.Namespace) -> int:
    import yaml

    from venusrl.model.directory import init_model_dir

    fields: dict[str, Any] = {}
    if args.hf_config:
        try:
            given = json.loads(Path(args.hf_config).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {args.hf_config}: not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError(f"--config {args.hf_config}: must hold a JSON object of fields")
        fields.update(given)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} must look like key=value")
        fields[key] = yaml.safe_load(value)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    path = init_model_dir(args.out, args.preset, fields, seed=args.seed, overwrite=args.force)
    print(json.dumps({"model_dir": str(path)}))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from venusrl.engine.engine import Engine
    from venusrl.types import SamplingParams

    cfg = load_config(args.config, args.overrides)
    engine = Engine.from_model_dir(model_path(args.model), cfg.engine)
    if engine.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json; use the server's token-id API")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    (out,) = engine.generate([engine.tokenizer.encode(args.prompt)], params)
    print(
        json.dumps(
            {
                "text": engine.tokenizer.decode(out.token_ids),
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
            }
        )
    )
    return 0


def _sim(args: argparse.Namespace) -> int:
    from venusrl.sim.cost_model import parse_overrides
    from venusrl.sim.executor import simulate, workload_cost
    from venusrl.sim.policies import sim_policies
    from venusrl.sim.report import over_seeds, parse_seeds
    from venusrl.sim.types import SimConfig
    from venusrl.workloads import SCENARIOS, load_workload

    if args.workload:
        workload = load_workload(args.workload)
    elif args.scenario in SCENARIOS:
        workload = SCENARIOS[args.scenario]
    else:
        raise ValueError(f"--scenario: unknown {args.scenario!r}; known: {', '.join(SCENARIOS)}")
    try:
        policies = sim_policies(args.policies)
    except ValueError as e:
        raise ValueError(f"--policies: {e}") from None
    seeds = parse_seeds(args.seeds)
    if args.steps < 2:
        raise ValueError("--steps must be >= 2 (the first step only fills the pipeline)")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    try:
        cost = parse_overrides(args.cost)
        workload_cost(workload, cost)  # refused now, not after the first policy's run
    except ValueError as e:
        raise ValueError(f"--cost: {e}") from None
    started = time.monotonic()
    config = SimConfig(
        args.steps,
        decide_every_iteration=args.decide_every_iteration,
        weight_update=args.weight_update,
    )
    runs = {seed: simulate(workload, policies, seed, config, args.jobs, cost) for seed in seeds}
    summary = over_seeds(runs)
    out: dict[str, Any] = {
        "workload": workload.name,
        "cost": cost,
        "seeds": seeds,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": {str(seed): results for seed, results in runs.items()},
        "summary": summary,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{workload.name}, seeds {args.seeds}, {args.steps} steps ({out['wall_s']} s)")
    for seed, results in runs.items():
        _print_seed(seed, results)
    names = [p.name for p in policies]
    print("over the seeds: step (s) and speedups, median (worst)")
    print("  ".join(f"{c:>16}" for c in ["policy", "mean_step_s", *names]))
    for name, row in summary.items():
        cells = [row.get(k) for k in ["mean_step_s", *(f"speedup_vs_{n}" for n in names)]]
        shown = [f"{c['median']:.4g} ({c['worst']:.4g})" if c else "" for c in cells]
        print(f"{name:>16}  " + "  ".join(f"{c:>16}" for c in shown))
    return 0


def _print_seed(seed: int, results: list[dict[str, Any]]) -> None:
    cols = ["policy", "mean_step_s", "gpu_busy", "reprefill_tokens", "offloaded_bytes",
            "group_completion_p50_s", "group_completion_p99_s", "staleness_mean"]  # fmt: skip
    cols += sorted({k for r in results for k in r if k.startswith("speedup_vs_")})
    print(f"seed {seed}")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in results:
        cells = [r.get(c) for c in cols]
        print("  ".join(f"{c:>14.4g}" if isinstance(c, float) else f"{c!s:>14}" for c in cells))
    print(
        "where the time goes: trainer, weight sync and the trainer's wait for its next batch"
        " per step (s), rollout GPU time (%)"
    )
    shares = list(results[0]["rollout_gpu_time"])
    head = ["policy", "train_s", "weight_sync_s", "batch_wait_s", *shares]
    print("  ".join(f"{c:>14}" for c in head))
    for r in results:
        cells = [r["train_s_per_step"], r["weight_sync_s_per_step"], r["batch_wait_s"] or 0.0]
        cells += [100 * r["rollout_gpu_time"][k] for k in shares]
        print(f"{r['policy']:>14}  " + "  ".join(f"{c:>14.4g}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
