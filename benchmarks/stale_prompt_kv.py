"""What reusing the first version's prompt KV does to the policy the engine samples from.

Every episode of a run starts from the same prompt (instructions, tools, task), so its KV stays
hot in the engine's prefix cache. Unless the cache is salted by weight version
(`engine.salt_cache_by_version`, on by default), trajectories started under later weights read
that KV, computed by the weights of the first version that cached it: the engine then samples
from the new weights on top of old prompt KV, a policy the trainer never scores.

This measures how far apart the two are. For trajectories a run trained on at a checkpoint's step,
it computes the next-token distributions at every model token twice with the checkpoint's
weights: once on its own (what the trainer computes), once reading the whole pages of the prompt
from KV computed by the run's start policy (`start-model/`, what an unsalted engine computes for
a prompt cached before RL started). Hugging Face `transformers` runs both, as the reference.

Prints one JSON object: the checkpoint, the prompt tokens read from the old KV, the model tokens
compared, the mean, 99th percentile and largest total-variation distance between the two
distributions, and the share of positions whose most likely token differs.

    python benchmarks/stale_prompt_kv.py RUN_DIR [--checkpoint step-000099] [--trajectories 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM

from venusrl.trainer.checkpoint import checkpoints, load_run_state


def compare(run_dir: Path, checkpoint: Path, trajectories: int, page_size: int) -> dict[str, Any]:
    start = AutoModelForCausalLM.from_pretrained(run_dir / "start-model").eval()
    later = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    step = load_run_state(checkpoint).step
    records = []
    with (run_dir / "trajectories.jsonl").open() as f:
        for line in f:
            t = json.loads(line)
            if t["step"] == step and t["turn_starts"] and not t.get("replaced"):
                records.append(t)
            if len(records) == trajectories:
                break
    if not records:
        raise SystemExit(f"{run_dir}: no trajectory trained at step {step}")
    distances: list[torch.Tensor] = []
    flips = 0
    reused = 0
    for t in records:
        ids = torch.tensor([t["token_ids"]])
        # The engine caches whole pages, and always computes a request's last prompt token.
        reused = (t["turn_starts"][0] - 1) // page_size * page_size
        model_positions = [
            p - 1  # the logits at p - 1 predict token p
            for s, turn in zip(t["turn_starts"], t["turns"], strict=False)
            for p in range(s, s + turn["action_tokens"])
        ]
        with torch.no_grad():
            fresh = torch.softmax(later(ids).logits[0], -1)
            old_kv = start(ids[:, :reused], use_cache=True).past_key_values
            mixed = torch.softmax(later(ids[:, reused:], past_key_values=old_kv).logits[0], -1)
        rows = torch.tensor(model_positions)
        a, b = fresh[rows], mixed[rows - reused]
        distances.append(0.5 * (a - b).abs().sum(-1))
        flips += int((a.argmax(-1) != b.argmax(-1)).sum())
    tv = torch.cat(distances)
    return {
        "checkpoint": checkpoint.name,
        "trajectories": len(records),
        "prompt_tokens_from_old_kv": reused,
        "model_tokens": int(tv.numel()),
        "tv_mean": round(float(tv.mean()), 4),
        "tv_p99": round(float(tv.quantile(0.99)), 4),
        "tv_max": round(float(tv.max()), 4),
        "argmax_differs": round(flips / tv.numel(), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--checkpoint", help="a directory name under checkpoints/ (default: latest)")
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = checkpoints(args.run_dir)
    if args.checkpoint:
        saved = [args.run_dir / "checkpoints" / args.checkpoint]
    if not saved or not saved[-1].is_dir():
        raise SystemExit(f"{args.run_dir}: no such checkpoint")
    config = yaml.safe_load((args.run_dir / "config.yaml").read_text())
    page_size = int(config["engine"]["page_size"])
    print(json.dumps(compare(args.run_dir, saved[-1], args.trajectories, page_size)))


if __name__ == "__main__":
    main()
