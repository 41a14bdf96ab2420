#!/usr/bin/env bash
# Create .venv and install distsparse with its test extras at the tested versions of requirements/lock.txt
# (DESIGN decision 20; scripts/refresh_lock.py rewrites the lock). Idempotent: a rerun brings .venv back to the lock.
# torch comes first, at the lock's version, from the configured pip index: where that index serves CUDA builds and
# the machine has no NVIDIA GPU, point TORCH_INDEX_URL at PyTorch's CPU wheel index. GPU users may install their
# CUDA build of the same version (pip install torch==<lock's version>) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
TORCH_VERSION=$(sed -n 's/^torch==//p' "$LOCK")
[ -n "$TORCH_VERSION" ] || { echo "setup: no torch==VERSION line in $LOCK" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
torch_installed() { python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
                      >/dev/null 2>&1; }
if ! torch_installed; then
  pip install -q "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  if ! has_gpu && [ "$(python -c 'import torch; print(torch.version.cuda is not None)' 2>/dev/null)" = "True" ]; then
    echo "setup: the configured index gave a CUDA build of torch on a machine without an NVIDIA GPU; rerun with" >&2
    echo "  .venv/bin/pip uninstall -y torch && TORCH_INDEX_URL=<PyTorch's CPU wheel index> bash scripts/setup.sh" >&2
    exit 1
  fi
fi
pip install -q -r "$LOCK"
pip install -q --no-deps -e ".[dev,eval]"
pip check
python -c "import torch, deepspeed, transformers; print(f'setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
