"""Importing the user tools in tools/ from tests (they are scripts, not a package: their folder goes on sys.path).
The shared multi-rank fixture is bench/ranks.py's RankPool (tests/conftest.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[1] / "tools")


def import_tool(module: str):
    """tools/<module>.py as a module."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return importlib.import_module(module)
