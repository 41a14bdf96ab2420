#!/usr/bin/env bash
# Fresh machine -> a short 1:4 row-wise sparse pre-training on 2 DeepSpeed ranks (CPU) on the embedded
# stdlib-docs corpus. Extra arguments are key=value overrides for the run config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
PY=.venv/bin/python
[ -f data/stdlib/meta.json ] || $PY -m data_prep.prepare --source stdlib-docs --out data/stdlib --vocab-size 4096
NPROC=${NPROC:-2}
# Ranks x threads <= cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
.venv/bin/deepspeed --num_gpus "$NPROC" launch/pretrain.py --ds_config configs/ds/zero2.json \
  --config configs/experiments/quickstart.yaml "$@"
echo "TensorBoard: .venv/bin/tensorboard --logdir runs/quickstart/tb"
