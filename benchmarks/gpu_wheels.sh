#!/usr/bin/env bash
# Download into .whl/ the wheels that benchmarks/gpu_check.sh installs on the GPU machine, which
# has torch, triton, transformers, numpy, safetensors, tokenizers, jinja2, pytest and hypothesis
# but not pydantic (the config sections) and has no network. Pure-Python wheels and pydantic-core's
# cp312 manylinux x86_64 build, at the versions of this checkout's .venv/ (typing_extensions too:
# pydantic-core needs a newer one than an older torch image may carry).
#   bash benchmarks/gpu_wheels.sh [PYTHON]     # PYTHON: whose versions to take (default .venv/)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
[ -x "$python" ] || python="$(git rev-parse --git-common-dir)/../.venv/bin/python"  # a worktree
[ -x "$python" ] || { echo "no $python: run scripts/bootstrap.sh first, or pass a python" >&2; exit 1; }
mkdir -p .whl
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  version="$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
ls -l .whl
