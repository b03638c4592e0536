#!/usr/bin/env bash
# Hardware validation of the cuda backend on a machine with one or more NVIDIA GPUs and a CUDA
# build of torch: install ds_core, the cuda backend and the conformance suite from this checkout
# (no network: --no-index, no build isolation), then record nvidia-smi, `ds-core report`, the
# conformance suite against `cuda`, and short ZeRO runs of examples/train_gpt.py at every stage.
#
#   tools/gpu_check.sh [OUTDIR]        (default out/gpu_check)
#
# Every step writes its log to OUTDIR and the script goes on after a failure, so one run shows
# everything; the last lines summarise each step's exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
declare -a SUMMARY=()

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$name rc=$rc $((SECONDS - start))s")
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n 15 "$OUT/$name.log"
}

step install 300 "$PY" -m pip install --no-deps --no-build-isolation --no-index \
  -e . -e backends/cuda -e backends/cpu -e conformance
step nvidia-smi 30 nvidia-smi
step report 120 env DS_ACCELERATOR=cuda "$PY" -m ds_core.cli report
step conformance 420 env DS_ACCELERATOR=cuda "$PY" -m ds_core.cli conformance --backend cuda \
  --report "$OUT/conformance"
for stage in 0 1 2 3; do
  step "train_s$stage" 180 env DS_ACCELERATOR=cuda "$PY" examples/train_gpt.py --ranks 1 \
    --stage "$stage" --bf16 --steps 30 --no-plot --out "$OUT/train_s$stage"
done
step train_s2_offload 240 env DS_ACCELERATOR=cuda "$PY" examples/train_gpt.py --ranks 1 \
  --stage 2 --bf16 --offload optimizer --steps 20 --no-plot --out "$OUT/train_s2_offload"

echo "== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
