#!/usr/bin/env bash
# Every GPU check of the project in one call (DESIGN s6; issue 15 item 3); tools/gpu_check.py holds the steps.
#   tools/gpu_check.sh OUTDIR          # on the GPU machine, with .gpu_wheels/ (tools/gpu_wheels.sh) carried along
#   tools/gpu_check.sh --plan OUTDIR   # print the steps, their time limits and commands; run nothing
# Installs the carried wheels without any index, then runs the GPU-marked tests, the real Trainer on NCCL with a
# bit-identical resume (tools/gpu_train_check.py), bench_layer (bf16), bench_inference (2:4 kernels) and
# bench_train (dense AdamW vs CHTs 1:4 + TANS at 60m and 350m), each under its own time limit (a measured budget
# with margin, under 8 minutes in all; NCCL_DEBUG=WARN on the GPU steps). OUTDIR receives three files, also when a
# step or the check itself fails: gpu_check.tar.gz (every log and JSON), summary.txt (the table printed at the
# end) and gpu_h200.json (docs/results/ shape). Exits non-zero if any step failed.
# Python: $PYTHON if set, else .venv/bin/python if present, else python3. The repository root goes on PYTHONPATH,
# so an uninstalled checkout works.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: tools/gpu_check.sh [--plan] OUTDIR" >&2
  exit 2
fi
args=()
for a in "$@"; do
  case $a in
    --*) args+=("$a") ;;
    *) args+=("$(realpath -m "$a")") ;;   # OUTDIR as the caller meant it, before the cd below
  esac
done
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" tools/gpu_check.py "${args[@]}"
