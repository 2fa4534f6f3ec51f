#!/usr/bin/env bash
# The main job: set up .venv/, then `venusrl train` on the built-in CPU example (a from-scratch
# micro Qwen3 model learns treasure_hunt in real sandboxes: warm start, then GRPO). Needs root for
# the sandboxes (namespaces, cgroups). Extra arguments go to `venusrl train` (k=v overrides,
# --run-dir, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $EUID -ne 0 ]]; then  # as a user: ask for root once, here, rather than fail in a sandbox
    if ! command -v sudo >/dev/null; then
        echo "scripts/train.sh: training needs root for its sandboxes (namespaces, cgroups)," \
            "and sudo is not installed: run it as root" >&2
        exit 1
    fi
    exec sudo --preserve-env=OMP_NUM_THREADS "$0" "$@"
fi
scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/venusrl train "$@"
