#!/usr/bin/env bash
# Create or refresh the project's virtual environment .venv/ and install venusrl into it.
#   scripts/bootstrap.sh         runtime dependencies
#   scripts/bootstrap.sh dev     plus test, lint and reference dependencies
#   scripts/bootstrap.sh demo    plus the openai client (scripts/demo.sh)
# torch is pinned to the 2.13.0 CPU build: a plain `torch` requirement pulls a multi-GB CUDA
# build. On a GPU machine, install the CUDA torch you want first (VENUSRL_TORCH=skip keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "venusrl needs Python >= 3.11; $python is $("$python" --version 2>&1)" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
stamp=".venv/.venusrl-installed-${extras:-runtime}"
# Reinstall only when the dependency list changed since the last install.
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ "${VENUSRL_TORCH:-cpu}" = "cpu" ]; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".${extras:+[$extras]}"
echo "$want" > "$stamp"
