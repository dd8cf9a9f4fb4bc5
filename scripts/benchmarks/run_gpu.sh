#!/usr/bin/env bash
# The timing benchmarks and the long-document accuracy table on one accelerator, sized to finish in under 8 minutes
# on one GPU (each step prints its wall time; the figures land in $OUT, one folder per script).
#
#   bash scripts/benchmarks/run_gpu.sh                       # cuda, bf16 autocast, into scripts/benchmarks/results/gpu
#   DEVICE=cuda DTYPE=fp32 OUT=/tmp/gpu bash scripts/benchmarks/run_gpu.sh
#   DEVICE=cpu QUICK=1 OUT=/tmp/smoke bash scripts/benchmarks/run_gpu.sh   # tiny settings (what the test runs)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-scripts/benchmarks/results/gpu}"
PY="${PYTHON:-python}"
dev=(--device "$DEVICE")
if [[ -n "${DTYPE:-}" ]]; then dev+=(--dtype "$DTYPE"); fi
if [[ "${QUICK:-0}" == "1" ]]; then
  long=(--quick); layers=(--quick); peers=(--quick --no-memory); gen=(--quick --contexts 16,48)
else
  # One process on one chip: the long-document runs go one after another (each in a fresh process).
  long=(--workers 1 --threads 4)
  layers=(--threads 4 --max-n 8192)
  peers=(--only peers --threads 4 --max-n 8192)
  gen=(--threads 4)
fi
mkdir -p "$OUT"
step() {
  local name="$1"; shift
  local start=$SECONDS
  echo "== $name: $*"
  "$@"
  echo "== $name done in $((SECONDS - start)) s"
}
step long_documents "$PY" -m scripts.benchmarks.long_documents "${long[@]}" "${dev[@]}" --out-dir "$OUT/long_documents"
step layers "$PY" -m scripts.benchmarks.layers "${layers[@]}" "${dev[@]}" --out-dir "$OUT/layers"
step peers "$PY" -m scripts.benchmarks.peers "${peers[@]}" "${dev[@]}" --out-dir "$OUT/peers"
step generation "$PY" -m scripts.benchmarks.generation "${gen[@]}" "${dev[@]}" --out-dir "$OUT/generation"
echo "all done in $SECONDS s; results in $OUT"
