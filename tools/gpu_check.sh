#!/usr/bin/env bash
# Every GPU check of the project in one call (DESIGN s6): the GPU-marked tests, then the GPU benchmarks.
#   tools/gpu_check.sh OUTDIR
# Writes into OUTDIR: pytest_gpu.xml (junit) and pytest_gpu.log; on a CUDA machine also NAME.json and NAME.log of
# each GPU benchmark step (bench_layer_gpu, bench_inference_gpu, bench_train_60m_gpu, bench_train_350m_gpu);
# summary.txt with one line per step and its exit code. Exits non-zero if any step failed.
# Budget: under 8 minutes on one H100/H200; every step runs under `timeout`, the limits below add up to 7 min.
# Every issue that writes GPU code adds its tests (marked @pytest.mark.gpu) and its benchmark steps here.
# Python: $PYTHON if set, else .venv/bin/python if present, else python3. The repository root goes on
# PYTHONPATH, so an uninstalled checkout works.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: tools/gpu_check.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$OUT/summary.txt"
failed=0

# step NAME SECONDS LOG CMD...: run CMD under a time limit, log to LOG, record the exit code (124: timed out).
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" 2>&1 | tee "$OUT/env.txt"
has_cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# Only the files that hold GPU tests are collected: the others may import packages a bare GPU image lacks
# (deepspeed). pytest's exit code 5 (nothing collected) counts as a failure: the marker must select tests.
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
step pytest_gpu 150 pytest_gpu.log "$PY" -m pytest -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml" "${gpu_files[@]}"

if [ "$has_cuda" = 1 ]; then
  step bench_layer_gpu 60 bench_layer_gpu.log "$PY" tools/bench_layer.py --device cuda --dtype bf16 \
    --json "$OUT/bench_layer_gpu.json"
  step bench_inference_gpu 70 bench_inference_gpu.log "$PY" tools/bench_inference.py --models 60m,350m \
    --skip-csr --json "$OUT/bench_inference_gpu.json"
  # Training speed (issue 9 item 3) with one rank per visible GPU (at most 2), bf16; fewer steps than the CPU
  # default: each row's warmup already absorbs CUDA/cuBLAS initialization.
  step bench_train_60m_gpu 60 bench_train_60m_gpu.log "$PY" tools/bench_train.py --model 60m --steps 3 \
    --warmup 1 --json "$OUT/bench_train_60m_gpu.json"
  step bench_train_350m_gpu 80 bench_train_350m_gpu.log "$PY" tools/bench_train.py --model 350m --steps 3 \
    --warmup 1 --json "$OUT/bench_train_350m_gpu.json"
else
  echo "bench_layer_gpu, bench_inference_gpu, bench_train_60m_gpu, bench_train_350m_gpu skipped: no CUDA device" \
    | tee -a "$OUT/summary.txt"
  failed=1
fi

echo "== summary"
cat "$OUT/summary.txt"
exit "$failed"
