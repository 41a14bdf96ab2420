#!/usr/bin/env bash
# Collect the wheels the GPU machine lacks into one folder that travels with the working tree (issue 15 item 3):
#   tools/gpu_wheels.sh [--dry-run] [DIR]        (DIR default: .gpu_wheels, ignored by git)
# The GPU machine (tools/gpu_check.sh) has CPython 3.12 with torch, numpy, transformers, scipy, safetensors,
# sentencepiece, tensorboard and pytest, and reaches no package registry; tools/gpu_check.sh installs from DIR with
# `pip install --no-index --find-links DIR`. What goes in:
#   - deepspeed==0.19.8 built here as a wheel with DS_BUILD_OPS=0 (it is an sdist; no op is compiled: pure Python)
#   - deepspeed's requirements read from the built wheel's metadata (Requires-Dist without extras), except torch
#     and numpy (on the machine; their wheels are hundreds of MB), with their dependencies
#   - submitit (launch/slurm.py) and nvidia-ml-py (bench_train's energy counter), with their dependencies
# Binary wheels are chosen for CPython 3.12 manylinux2014 x86_64 through the index pip is configured with; each
# package is pinned to the version installed in this script's Python where there is one (what the CPU suite ran
# against). DIR/MANIFEST.txt lists the files and sizes; the folder must stay under 40 MiB (the run tool carries at
# most 64 MiB). --dry-run prints the plan (the commands) without downloading.
# Python: $PYTHON if set, else .venv/bin/python if present, else python3 (it needs pip, nothing else).
set -euo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -gt 1 ]; then
  echo "usage: tools/gpu_wheels.sh [--dry-run] [DIR]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_wheels}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
DEEPSPEED=deepspeed==0.19.8
EXTRA=(submitit nvidia-ml-py)
ON_THE_MACHINE="torch numpy"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64)
LIMIT_MIB=40

# pinned NAME...: NAME==VERSION where this Python has NAME installed, else NAME.
pinned() {
  "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
EOF
}

# requirements WHEEL: deepspeed's own requirements (no extras, markers evaluated for Linux CPython 3.12) minus the
# packages the machine has.
requirements() {
  "$PY" - "$1" "$ON_THE_MACHINE" <<'EOF'
import sys
import zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wheel, skip = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    message = Parser().parsestr(z.read(meta).decode())
target = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
for text in message.get_all("Requires-Dist") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate(target):
        continue
    if req.name.lower() not in skip:
        print(req.name)
EOF
}

if [ "$DRY" = 1 ]; then
  echo "DS_BUILD_OPS=0 $PY -m pip wheel --no-deps --no-binary deepspeed $DEEPSPEED -w $DEST"
  echo "$PY -m pip download ${TARGET[*]} -d $DEST <deepspeed's Requires-Dist minus: $ON_THE_MACHINE> ${EXTRA[*]}"
  echo "(versions pinned to $PY's installed ones where present; $DEST/MANIFEST.txt; limit ${LIMIT_MIB} MiB)"
  exit 0
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST"/MANIFEST.txt
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-binary deepspeed "$DEEPSPEED" -w "$DEST"
ds_wheel=$(ls "$DEST"/deepspeed-*.whl)
mapfile -t needs < <(requirements "$ds_wheel")
mapfile -t wanted < <(pinned "${needs[@]}" "${EXTRA[@]}")
echo "deepspeed needs: ${needs[*]}"
"$PY" -m pip download "${TARGET[@]}" -d "$DEST" "${wanted[@]}"

(cd "$DEST" && ls -l *.whl | awk '{printf "%10d  %s\n", $5, $9}') > "$DEST/MANIFEST.txt"
total=$(du -sm "$DEST" | cut -f1)
echo "total ${total} MiB" >> "$DEST/MANIFEST.txt"
cat "$DEST/MANIFEST.txt"
for name in torch numpy; do
  if ls "$DEST" | grep -qi "^${name}-"; then
    echo "error: $DEST holds a $name wheel: the GPU machine has its own" >&2
    exit 1
  fi
done
if [ "$total" -ge "$LIMIT_MIB" ]; then
  echo "error: $DEST is ${total} MiB; allowed: under ${LIMIT_MIB} MiB" >&2
  exit 1
fi
