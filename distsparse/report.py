"""What every report of the project prints and writes (DESIGN s6): the machine description, an aligned table and
atomic JSON. The user tools in distsparse/cli and tools/ and the benchmarks in bench/ (bench/core.py) share them."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch


def _version(package: str) -> str | None:
    # Read from package metadata: importing deepspeed just to learn its version costs seconds.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: cpu model, cores, torch threads, library versions, GPU if any."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "gpu": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Plain aligned text: text columns left-aligned, numbers right-aligned, floats with 3 decimals."""
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in cells:
        print(line(row))


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write `payload` atomically: a temp file in the same folder, then rename, so readers never see half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    """The `--json PATH` option every benchmark takes."""
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results as JSON (machine, config and the named figures)")
