"""Rewrite README.md's "Results" section from benchmark JSON files (issue 9 item 7).

    python -m bench.update_readme_results                          # runs/bench/*.json and runs/q/quality.json
    python -m bench.update_readme_results out/a.json out/b.json    # these files only
    python -m bench.update_readme_results --glob 'runs/**/*.json' --readme README.md

A benchmark file is a JSON object with top-level `machine` and `config` (DESIGN s6; distsparse/report.py); other JSON
files (training runs' config.json, result.json) are skipped and named on stderr. The section lies between the
marker comments `<!-- results:start -->` and `<!-- results:end -->`; when README.md has no markers, a
"## Results" heading and the markers are appended at its end. Text outside the markers is never changed, and a
second run with the same files gives the same README.

Generic rendering, per file (sorted by path), under a heading naming the file and a line naming its machine:
  - top-level numbers (and lists of numbers) form a "figure | value" table;
  - top-level objects whose values are scalars are grouped by their key set into one table (a column each);
  - top-level objects of objects become a two-dimensional table (inner objects flattened to dotted columns);
  - anything deeper or mixed is flattened to dotted figures; lists of non-numbers are left out;
  - `details` (raw measurements) is left out, and a 2-D table wider than 12 columns is only named.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from pathlib import Path
from typing import Any

START, END = "<!-- results:start -->", "<!-- results:end -->"
HEADING = "## Results"
DEFAULT_GLOBS = ("runs/bench/*.json", "runs/q/quality.json")   # benchmark JSON; the quality table if present
SKIP_KEYS = ("machine", "config")
DETAIL_KEYS = ("details",)   # raw measurements behind the headline figures: in the JSON, not the README
MAX_TEXT = 80     # characters of a text value (e.g. a skip reason) kept in a cell
MAX_COLUMNS = 14  # a wider 2-D table (per-shape timings) is named with its width, not printed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.update_readme_results",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="benchmark JSON files (default: the --glob pattern)")
    p.add_argument("--glob", dest="pattern", default=None,
                   help="recursive glob of JSON files, relative to the current directory (default when no paths "
                        f"are given: {', '.join(DEFAULT_GLOBS)})")
    p.add_argument("--readme", default="README.md", help="the README to rewrite (default README.md)")
    return p.parse_args(argv)


# ---- values -------------------------------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    """A cell: a number, None, text, a boolean, or a list of numbers."""
    return v is None or isinstance(v, (int, float, str, bool)) or \
        (isinstance(v, list) and bool(v) and all(_is_number(x) for x in v))


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    text = str(v).replace("|", "/").replace("\n", " ")
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to scalar leaves; lists that are not lists of numbers are left out."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        elif _is_scalar(value):
            out[path] = value
    return out


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


# ---- one file -----------------------------------------------------------------------------------------------------

def machine_line(machine: dict) -> str:
    gpu = machine.get("gpu") or "none"
    parts = [f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)", f"GPU {gpu}",
             f"torch {machine.get('torch', '?')}", f"deepspeed {machine.get('deepspeed', '?')}"]
    if machine.get("cuda"):
        parts.append(f"CUDA {machine['cuda']}")
    return "Machine: " + ", ".join(parts) + "."


def render_file(label: str, payload: dict) -> list[str]:
    """Markdown lines for one benchmark file."""
    lines = [f"### {label}", "", machine_line(payload.get("machine") or {}), ""]
    figures: dict[str, Any] = {}
    groups: dict[tuple, dict[str, dict]] = {}      # key set -> {figure: object}
    grids: dict[str, dict[str, dict]] = {}         # figure -> {row: flattened inner object}
    for key, value in payload.items():
        if key in SKIP_KEYS or key in DETAIL_KEYS:
            continue
        if _is_number(value) or (isinstance(value, list) and _is_scalar(value)):
            figures[key] = value
        elif isinstance(value, dict) and value and all(_is_scalar(v) for v in value.values()):
            groups.setdefault(tuple(value), {})[key] = value
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            grids[key] = {row: flatten(inner) for row, inner in value.items()}
        elif isinstance(value, dict):
            figures.update(flatten(value, key + "."))
    if figures:
        lines += _table(["figure", "value"], [[name, fmt(v)] for name, v in figures.items()])
    for keys, members in groups.items():
        lines += _table(["", *members], [[k, *(fmt(obj[k]) for obj in members.values())] for k in keys])
    for name, rows in grids.items():
        columns = list(dict.fromkeys(c for inner in rows.values() for c in inner))
        if len(columns) > MAX_COLUMNS:
            lines += [f"{name}: {len(rows)} rows x {len(columns)} columns, in the JSON file.", ""]
            continue
        lines += [f"{name}:", ""]
        lines += _table(["", *columns], [[row, *(fmt(inner.get(c)) for c in columns)] for row, inner in rows.items()])
    return lines


# ---- the README ---------------------------------------------------------------------------------------------------

def collect(paths: list[str], pattern: str | None) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(benchmark files with their payloads, sorted by path; notes on skipped files)."""
    names = list(paths)
    if pattern:
        names += glob.glob(pattern, recursive=True)
    elif not paths:
        names += [name for default in DEFAULT_GLOBS for name in glob.glob(default)]
    found, notes = [], []
    for name in sorted(set(names)):
        path = Path(name)
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            notes.append(f"{path}: skipped ({err})")
            continue
        if not (isinstance(payload, dict) and all(k in payload for k in SKIP_KEYS)):
            notes.append(f"{path}: skipped (no top-level 'machine' and 'config': not a benchmark file)")
            continue
        found.append((path, payload))
    return found, notes


def _label(path: Path, base: Path) -> str:
    try:
        shown = path.resolve().relative_to(base.resolve())
    except ValueError:
        shown = path
    return f"{path.stem} (`{shown}`)"


def render_section(files: list[tuple[Path, dict]], base: Path) -> str:
    note = (f"_Written by `bench/update_readme_results.py` from {len(files)} benchmark file(s); rerun it instead "
            "of editing this section._")
    lines = [START, "", note, ""]
    for path, payload in files:
        lines += render_file(_label(path, base), payload)
    lines.append(END)
    return "\n".join(lines)


def replace_section(readme: str, section: str) -> str:
    """README text with the marked section replaced, or appended under a Results heading when absent."""
    start, end = readme.find(START), readme.find(END)
    if start == -1 and end == -1:
        return readme.rstrip("\n") + f"\n\n{HEADING}\n\n{section}\n"
    if start == -1 or end < start:
        raise ValueError(f"README: found {'only ' + END if start == -1 else END + ' before ' + START}; "
                         f"allowed: both markers, {START} first, or neither")
    return readme[:start] + section + readme[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    readme = Path(args.readme)
    if not readme.is_file():
        print(f"error: --readme: got {str(readme)!r}; the file does not exist", file=sys.stderr)
        return 2
    files, notes = collect(args.paths, args.pattern)
    for note in notes:
        print(note, file=sys.stderr)
    try:
        text = replace_section(readme.read_text(), render_section(files, readme.parent))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    readme.write_text(text)
    print(f"{readme}: Results section rewritten from {len(files)} benchmark file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
