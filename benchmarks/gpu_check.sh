#!/usr/bin/env bash
# The one prepared GPU check of issues 31 (the engine on a GPU) and 32 (the trainer's GPU figure):
# everything a session with one H200 has to run, in <= 7 minutes, results as files.
#
# With the device tool (torch 2.11 CUDA 13, triton, transformers there; no pydantic, no network):
#   1. here, once:  bash benchmarks/gpu_wheels.sh     # pydantic & co. into .whl/ (git-ignored)
#   2. run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   Back from $OUT (7 files): gpu_check.log (every part's stderr, what was skipped, a summary at
#   the end, also printed), parity.log, parity-triton.log, engine-qwen3-0.6b.json and
#   engine-qwen3-4b.json (engine_gpu.py), trainer.json (trainer_step.py --throughput),
#   kv_transfer.json.
# Here, the same pipeline at tiny sizes on the CPU (~2-3 minutes on 2 cores):
#   bash benchmarks/gpu_check.sh --cpu                # results in runs/gpu_check/ unless $OUT
#
# The parts, in order, each under its own timeout, and what each should cost on an H200 (guesses:
# this has never run on a GPU). A part starts only while 20 s of the budget (GPU_BUDGET_S, 420)
# are left, and its timeout is cut to what is left, so the whole stays within the budget; the
# engine parts write their JSON after each section, so one cut short keeps what it measured.
#   wheels         .whl/ into /tmp/site                                            ~5 s   cap  30
#   parity         pytest on CUDA, fp32: parity with transformers (5 shapes, prefix
#                  hits, preemption; torch backend), decode graphs captured and
#                  replayed, the triton kernels against the torch backend (Triton
#                  compiles each shape hypothesis draws: most of this part's time)  ~80 s   cap 120
#   engine 0.6B    engine_gpu.py, bf16: 32 groups x 8, ~1K prompt, 64-512 tokens.
#                  Model on the device ~2 s, warm-up (Triton compiles) ~15 s, the
#                  workload ~530 steps at 10-100 ms (launches and Python per layer
#                  set the pace; graphs skip steps with shared-prefix groups, i.e.
#                  most) ~10-60 s, profile ~5 s, HF generate in 2 static batches of
#                  128, ~510 steps each, ~20 s                                     ~50-100 s cap 150
#   trainer        0.6B shape, one process (bf16 autocast), 16 rows x ~1K tokens, 3 steps
#                  after a warm-up; the model drawn on the CPU first (~5 s)         ~25 s   cap  50
#   kv transfer    0.6B shape: host<->device page copies (512 pages), then decode
#                  with half the layers streamed against all on device (8 x 2K);
#                  writes and reads the model directory (2.4 GB) twice             ~35 s   cap  60
#   engine 4B      as the 0.6B part, ~1.3x its step times and HF time              ~80-150 s cap 180
#   parity triton  the parity-with-transformers tests again on the triton backend  ~30 s   cap  60
# Expected ~5-6 minutes; the 4B part gets what is left of the budget and may be cut short.
# An engine part that fails (not one that times out) runs again once on the torch backend
# without CUDA graphs, so that a failing kernel or capture still leaves throughput figures.
#
# Env: ATTENTION_BACKEND (auto: triton on CUDA), CUDA_GRAPHS (1; 0 for off), GPU_BUDGET_S (420),
# PYTHON (python3; the checkout's .venv/ with --cpu), PARTS (all; or some of parity,
# engine-qwen3-0.6b, trainer, kv-transfer, engine-qwen3-4b, parity-triton, comma-separated),
# ENGINE_ARGS (more engine_gpu.py flags). A second look with the device time left, say:
#   run(command="PARTS=engine-qwen3-0.6b ATTENTION_BACKEND=torch CUDA_GRAPHS=0
#       ENGINE_ARGS='--sections engine' bash benchmarks/gpu_check.sh", carry=[".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

cpu=0
[ "${1:-}" = "--cpu" ] && cpu=1
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
budget="${GPU_BUDGET_S:-420}"
backend="${ATTENTION_BACKEND:-auto}"
graphs=()
[ "${CUDA_GRAPHS:-1}" = "1" ] && graphs=(--cuda-graphs)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
if [ "$cpu" = 1 ]; then
  venv=".venv/bin/python"
  [ -x "$venv" ] || venv="$(git rev-parse --git-common-dir)/../.venv/bin/python"  # a worktree
  python="${PYTHON:-$venv}"
  export OMP_NUM_THREADS=1 VENUSRL_TEST_THREADS=1
else
  python="${PYTHON:-python3}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[gpu_check $(date -u +%T) +${SECONDS}s] $*" | tee -a "$log"; }

# run_part NAME CAP_S STDOUT_FILE CMD...: CMD under `timeout`, its stdout to STDOUT_FILE and its
# stderr to the log; skipped when the budget is spent (125) or PARTS leaves it out (126).
# Returns CMD's status otherwise (124: timed out).
run_part() {
  local name="$1" cap="$2" stdout="$3"
  shift 3
  local part="${name% (torch)}"
  part="${part// /-}"
  case "$part" in wheels | unpack-*) ;; *)
    if [[ ",${PARTS:-all}," != *",all,"* && ",${PARTS:-all}," != *",$part,"* ]]; then
      say "$name: left out (PARTS=$PARTS)"
      return 126
    fi
    ;;
  esac
  local left=$((budget - SECONDS))
  if [ "$left" -lt 20 ]; then
    say "$name: skipped, ${left}s of the ${budget}s budget left"
    return 125
  fi
  local limit=$((cap < left ? cap : left))
  say "$name: start (timeout ${limit}s): $*"
  local started=$SECONDS status
  timeout --kill-after=10 "$limit" "$@" >"$stdout" 2>>"$log"
  status=$?
  say "$name: exit $status after $((SECONDS - started))s$([ $status = 124 ] && echo ' (TIMED OUT)')"
  return $status
}

# engine LABEL CAP_S ARGS...: engine_gpu.py into engine-LABEL.json on $backend (ARGS may say
# otherwise), and if that failed, once more on the torch backend without graphs.
engine() {
  local label="$1" cap="$2"
  shift 2
  local cmd=("$python" benchmarks/engine_gpu.py --out "$out/engine-$label.json") extra
  read -ra extra <<<"${ENGINE_ARGS:-}"
  run_part "engine $label" "$cap" /dev/null "${cmd[@]}" --attention-backend "$backend" \
    "${graphs[@]}" "$@" "${extra[@]}"
  case $? in
    # done, a section beside the engine's failed (in the JSON), timed out (or killed after),
    # skipped, left out
    0 | 3 | 124 | 125 | 126 | 137) ;;
    *)
      say "engine $label: failed (see above); once more on the torch backend without graphs"
      run_part "engine $label (torch)" "$cap" /dev/null "${cmd[@]}" "$@" "${extra[@]}" \
        --attention-backend torch
      ;;
  esac
}

# A PARTS name that matches no part would leave everything out without a word: refuse it.
if [ "$cpu" = 1 ]; then
  known="parity,engine-tiny,engine-tiny-triton,trainer,kv-transfer,parity-triton"
else
  known="parity,engine-qwen3-0.6b,trainer,kv-transfer,engine-qwen3-4b,parity-triton"
fi
IFS=, read -ra asked <<<"${PARTS:-all}"
for part in "${asked[@]}"; do
  if [[ "$part" != all && ",$known," != *",$part,"* ]]; then
    echo "PARTS: unknown part '$part'; the parts are: all,$known" >&2
    exit 2
  fi
done

say "mode: $([ $cpu = 1 ] && echo cpu || echo gpu), python: $python, results: $out"
if [ -d .whl ] && [ "$cpu" = 0 ]; then
  # The GPU image lacks pydantic (every config section is a pydantic model). A wheel is a zip
  # of what goes on the path, so without pip it is unpacked as it is.
  if ! run_part wheels 30 /dev/null "$python" -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    for wheel in .whl/*.whl; do
      run_part "unpack $wheel" 30 /dev/null "$python" -m zipfile -e "$wheel" /tmp/site
    done
  fi
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
elif [ "$cpu" = 1 ]; then
  say "wheels: not installed in --cpu mode (.venv/ has them; .whl/ holds cp312 builds)"
else
  say "wheels: no .whl/ here (bash benchmarks/gpu_wheels.sh, then carry [\".whl\"]); going on"
fi
if ! "$python" - "$cpu" <<'EOF' 2>&1 | tee -a "$log"; then
import sys, pydantic, torch, transformers, triton
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "triton", triton.__version__, "transformers",
      transformers.__version__, "pydantic", pydantic.VERSION,
      "cuda:", torch.cuda.get_device_name() if cuda else "none")
sys.exit(0 if cuda or sys.argv[1] == "1" else "no CUDA device: run with --cpu on a CPU")
EOF
  say "the environment cannot run the check (above); stopping"
  exit 1
fi

pytest=("$python" -m pytest -p no:cacheprovider -q --timeout 120)
parity=(tests/engine/test_parity_hf.py tests/engine/test_decode_graphs.py)
if [ "$cpu" = 1 ]; then
  # The kernels' own tests belong to the default suite (interpreted); here the engine-level
  # triton parity below is the pipeline's check of the backend on the CPU.
  VENUSRL_TEST_DEVICE=cpu run_part parity 300 "$out/parity.log" "${pytest[@]}" "${parity[@]}"
  engine tiny 120 --cpu --threads 1
  # The triton backend and graphs' padded buffers at the smallest sizes: interpreted kernels
  # run at ~1 token/s.
  TRITON_INTERPRET=1 engine tiny-triton 120 --cpu --threads 1 --sections engine \
    --attention-backend triton --groups 2 --group-size 2 --prompt-tokens 16 --output-tokens 2,4
  run_part trainer 60 "$out/trainer.json" "$python" benchmarks/trainer_step.py --throughput \
    --device cpu --preset micro --rows 8 --tokens 160 --prefix 32 --steps 2 --threads 1
  run_part "kv transfer" 60 "$out/kv_transfer.json" "$python" benchmarks/kv_transfer.py \
    --device cpu --preset micro --requests 3 --context 64 --steps 4 --pages 16 --repeats 2 \
    --threads 1
  # Interpreted, one shape (~25 s a test): prefill over a cached prefix, siblings' cascade.
  TRITON_INTERPRET=1 VENUSRL_TEST_DEVICE=cpu VENUSRL_TEST_ATTENTION=triton \
    run_part "parity triton" 300 "$out/parity-triton.log" "${pytest[@]}" \
    tests/engine/test_parity_hf.py -k "qwen3-gqa2 and (prefix_cache_hits or siblings)"
else
  # With them, on CUDA: the tier copies' streams and events (their own tests, and outputs equal
  # with layer bands, offloads and preemption under random workloads).
  VENUSRL_TEST_DEVICE=cuda run_part parity 120 "$out/parity.log" "${pytest[@]}" "${parity[@]}" \
    tests/engine/test_triton_attention.py tests/engine/test_tier_copies.py \
    tests/engine/test_layer_residency.py \
    "tests/engine/test_engine.py::test_outputs_do_not_depend_on_paging_caching_preemption_or_layer_residency"
  engine qwen3-0.6b 150 --presets qwen3-0.6b
  run_part trainer 50 "$out/trainer.json" "$python" benchmarks/trainer_step.py --throughput \
    --device cuda --preset qwen3-0.6b --rows 16 --tokens 1024 --prefix 0 --steps 3 --threads 4
  run_part "kv transfer" 60 "$out/kv_transfer.json" "$python" benchmarks/kv_transfer.py \
    --device cuda --preset qwen3-0.6b --requests 8 --context 2048 --steps 16 --pages 512 \
    --repeats 5 --threads 4
  engine qwen3-4b 180 --presets qwen3-4b
  VENUSRL_TEST_DEVICE=cuda VENUSRL_TEST_ATTENTION=triton \
    run_part "parity triton" 60 "$out/parity-triton.log" "${pytest[@]}" \
    tests/engine/test_parity_hf.py
fi

say "summary (the files in $out have everything):"
"$python" benchmarks/gpu_summary.py "$out" 2>&1 | tee -a "$log"
say "done in ${SECONDS}s"
