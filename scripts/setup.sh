#!/usr/bin/env bash
# Create .venv and install distsparse with its test extras. Idempotent.
# On a machine without an NVIDIA GPU it installs a CPU build of torch first, so that no dependency can pull
# a multi-GB CUDA build; GPU users install their CUDA torch (pip install torch==2.13.0) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if ! python -c "import torch" >/dev/null 2>&1; then
  if has_gpu; then
    pip install "torch==${TORCH_VERSION}"
  else
    # Prefer the official CPU index when it is reachable; otherwise the configured index (a local wheel
    # cache here). Either way the result is checked below.
    cpu_index=https://download.pytorch.org/whl/cpu
    if python -c "import urllib.request as u; u.urlopen('$cpu_index/', timeout=5)" >/dev/null 2>&1; then
      pip install "torch==${TORCH_VERSION}" --index-url "$cpu_index" --extra-index-url https://pypi.org/simple
    else
      pip install "torch==${TORCH_VERSION}"
    fi
    if [ "$(python -c 'import torch; print(torch.version.cuda is not None)')" = "True" ]; then
      echo "setup: a CUDA build of torch was installed on a machine without a GPU; run" >&2
      echo "  .venv/bin/pip uninstall -y torch && .venv/bin/pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu" >&2
      exit 1
    fi
  fi
fi
pip install -q -e ".[dev,eval]"
python -c "import torch, deepspeed, transformers; print(f'setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
