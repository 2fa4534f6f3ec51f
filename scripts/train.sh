#!/usr/bin/env bash
# The main job: set up .venv/, then `venusrl train` on the built-in CPU example (a from-scratch
# micro Qwen3 model learns treasure_hunt in real sandboxes: warm start, then GRPO). Needs root for
# the sandboxes (namespaces, cgroups). Extra arguments go to `venusrl train` (k=v overrides,
# --run-dir, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/venusrl train "$@"
