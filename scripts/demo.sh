#!/usr/bin/env bash
# Write a tiny random-weight Qwen3 model, serve it with `venusrl serve`, and talk to it with the
# official openai client (installed into .venv/ with the `demo` extra).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh demo
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
model="runs/demo-model"
[ -f "$model/config.json" ] || .venv/bin/venusrl model init "$model" --preset tiny
port="${PORT:-8765}"
.venv/bin/venusrl serve --model "$model" --port "$port" engine.threads=2 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
.venv/bin/python examples/query_server.py --base-url "http://127.0.0.1:$port"
