#!/usr/bin/env bash
# Set up (idempotent) and run the test suite on CPU; GPU tests are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec .venv/bin/python -m pytest "$@"
