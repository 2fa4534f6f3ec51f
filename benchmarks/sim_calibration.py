"""Does the simulator's cost model describe our engine? Fit it, then check it on held-back shapes.

Times decode iterations over (batch, context) and prefill iterations over (new tokens, cached
prefix) on the real engine with a random-weight model (`--preset`, default `tiny`: 4 layers,
hidden 256), fits the cost model's constants by least squares (`venusrl/sim/calibrate.py`) and
prints one JSON object: the constants, each held-back shape's measured and predicted time and
relative error, and the largest error (the simulator issue's target: within 25 %).

    python benchmarks/sim_calibration.py [--preset tiny] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from venusrl.model.directory import init_model_dir
from venusrl.sim.calibrate import calibrate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--rounds", type=int, default=3, help="visits of every shape; the fastest counts"
    )
    p.add_argument("--model-dir", type=Path, help="where the random model goes (default: tmp)")
    args = p.parse_args()
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out = args.model_dir or Path(tempfile.mkdtemp(prefix="venusrl-calib-")) / args.preset
    if not (out / "config.json").exists():
        init_model_dir(out, preset=args.preset, seed=0)
    result = calibrate(out, threads=args.threads, rounds=args.rounds)
    print(
        json.dumps(
            {"preset": args.preset, "threads": args.threads, "rounds": args.rounds, **result}
        )
    )


if __name__ == "__main__":
    main()
