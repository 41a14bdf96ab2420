"""The harness every benchmark shares (DESIGN s6): settings, figures, paired timing and the report.

A benchmark declares its settings as a dataclass whose defaults are the full-size run and whose `QUICK` mapping is
the smoke run (`--quick`); `key=value` overrides go through the project's strict config loader, so an unknown key or
a wrong type fails naming the key. It returns its figures as `Figure(name, value, target)`: `finish` prints the
benchmark's own tables, then the met/missed table of the figures last, and writes the JSON: the figures as
top-level keys, then `machine` and `config`. The machines are noisy (shared VMs), so comparisons are paired: both
callables run in every round, in alternating order, and the statistic is the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from distsparse.config import build_dataclass, parse_override
from distsparse.report import machine_info, print_table, write_json

S = TypeVar("S", bound="Settings")


@dataclass
class Settings:
    """Base of every benchmark's settings; subclasses add their fields (full-size defaults) and `QUICK`."""
    quick: bool = False
    QUICK: ClassVar[dict[str, Any]] = {}

    def one_of(self, **choices: Sequence[Any]) -> None:
        """Refuse a field outside its choices, naming it and them (called from `__post_init__`)."""
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}: got {getattr(self, key)!r}; allowed: {', '.join(map(str, allowed))}")

    def at_least(self, **bounds: int) -> None:
        """Refuse a field below its bound, naming it (called from `__post_init__`)."""
        for key, least in bounds.items():
            if getattr(self, key) < least:
                raise ValueError(f"{key}: got {getattr(self, key)!r}; allowed: >= {least}")


def parse(cls: type[S], argv: Sequence[str] | None, description: str) -> tuple[S, str | None]:
    """(settings, JSON path) from `[--quick] [key=value ...] [--json PATH]`; the preset first, overrides on top."""
    keys = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls) if f.name != "quick")
    module = cls.__module__ if cls.__module__ != "__main__" else f"bench.{Path(sys.argv[0]).stem}"
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                epilog=f"keys (full-size defaults): {keys}")
    p.add_argument("--quick", action="store_true", help=f"the smoke run: {cls.QUICK or 'the defaults'}")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the results as JSON (the figures, machine and config)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="a setting (keys below)")
    args = p.parse_intermixed_args(argv)   # settings before and after --json alike
    data: dict[str, Any] = dict(cls.QUICK) if args.quick else {}
    text_fields = {name for name, tp in typing.get_type_hints(cls).items() if tp is str}
    try:
        for item in args.overrides:
            key, _, text = item.partition("=")
            if key == "quick":   # the field records --quick; as a setting it would be taken and the preset not
                raise ValueError(f"{item}: allowed: --quick (the smoke run's preset)")
            # A text setting takes the text as given (rows=dense_adamw, world_sizes=8); others are read as YAML.
            data.update({key: text} if key in text_fields else parse_override(item))
        return build_dataclass(cls, {**data, "quick": args.quick}, ""), args.json
    except ValueError as err:
        p.error(str(err))


@dataclass(frozen=True)
class Figure:
    """A named figure and its target. `value` is a number or {case: number}, `target` a number or {case: number};
    with cases the worst one (relative to its target) is shown and judged."""
    name: str
    value: Any
    target: Any = None
    sense: str = "<="     # "<=": lower is better; ">=": higher is better

    def worst(self) -> tuple[str | None, Any, Any]:
        """(case or None, its value, its target); nested cases are named by their keys joined with '/'."""
        if not isinstance(self.value, Mapping):
            return None, self.value, self.target
        values = _flat(self.value)
        targets = _flat(self.target) if isinstance(self.target, Mapping) else dict.fromkeys(values, self.target)

        def badness(case: str) -> float:
            value, bound = values[case], targets.get(case)
            if value is None or bound is None:
                return -float("inf")
            return value / bound if self.sense == "<=" else bound / value
        case = max(values, key=badness)
        return case, values[case], targets.get(case)

    def verdict(self) -> str:
        _, value, target = self.worst()
        if target is None or value is None:
            return ""
        return "met" if (value <= target if self.sense == "<=" else value >= target) else "MISSED"

    def row(self) -> list[Any]:
        case, value, target = self.worst()
        if case is not None and target is None:   # no case to judge: show every case
            return [self.name, ", ".join(f"{k} {v:.3g}" for k, v in _flat(self.value).items()), "", ""]
        shown = value if isinstance(value, (int, float)) else str(value)
        return [self.name if case is None else f"{self.name} (worst: {case})", shown,
                "" if target is None else f"{self.sense} {target:g}", self.verdict()]


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + "/") if isinstance(value, Mapping) else {name: value})
    return out


def finish(json_path: str | None, figures: Sequence[Figure], rest: dict[str, Any], config: dict[str, Any] | None,
           tables: Sequence[tuple[Sequence[str], Sequence[Sequence[Any]]]] = (), head: str = "",
           machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the JSON ({figures, **rest, machine (with `machine` added), config}), print `head`, `tables` and the
    figures table last; returns the payload."""
    payload = {**{f.name: f.value for f in figures}, **rest, "machine": {**machine_info(), **(machine or {})}}
    if config is not None:   # None: the settings are in `rest` (estimate_h200 keeps its committed layout)
        payload["config"] = config
    if json_path:
        write_json(json_path, payload)
    if head:
        print(f"\n{head}")
    for headers, rows in tables:
        print_table(headers, rows)
        print()
    print_table(["figure", "value", "target", "verdict"], [f.row() for f in figures])
    return payload


def progress(name: str, rank: int = 0) -> Callable[[str], None]:
    """A `log(msg)` that prints `name: [seconds] msg` to stderr on rank 0."""
    start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"{name}: [{time.perf_counter() - start:.0f}s] {msg}", file=sys.stderr, flush=True)
    return log


# ---- paired timing -----------------------------------------------------------------------------------------------

class Timed:
    """A callable that records the wall and the process CPU seconds of each of its calls (`sync` around each)."""

    def __init__(self, fn: Callable[[], Any], sync: Callable[[], None] | None = None):
        self.fn, self.sync, self.wall, self.cpu = fn, sync, [], []

    def __call__(self) -> None:
        if self.sync is not None:
            self.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        self.fn()
        if self.sync is not None:
            self.sync()
        self.wall.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)


def median_time(fn: Callable[[], Any], warmup: int, repeats: int, sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    timed = Timed(fn, sync)
    for _ in range(repeats):
        timed()
    return statistics.median(timed.wall)


def paired_cpu_and_wall(fn_a: Callable[[], Any], fn_b: Callable[[], Any], warmup: int, repeats: int,
                        sync: Callable[[], None] | None = None) -> dict[str, Any]:
    """Paired rounds of a and b, alternating which goes first, so that a burst of noise hits one round's pair, not
    one side. Returns "ratio" (median per-round ratio of process CPU seconds), "ratios" (the per-round ones),
    "cpu_a", "cpu_b" (medians) and "wall_ratio", "wall_a", "wall_b". On a shared machine whose load exceeds its
    cores, a call that waits for a core accrues wall time but no CPU time; with one thread CPU time is the call's
    busy time. (On a GPU the CPU clock sees only the host: use the wall figures with `sync`.)"""
    if repeats < 1:
        raise ValueError(f"repeats: got {repeats}; allowed: >= 1")
    for _ in range(warmup):
        fn_a()
        fn_b()
    a, b = Timed(fn_a, sync), Timed(fn_b, sync)
    for i in range(repeats):
        for side in ((a, b) if i % 2 == 0 else (b, a)):
            side()
    cpu = [x / y for x, y in zip(a.cpu, b.cpu)]
    return {"ratio": statistics.median(cpu), "ratios": cpu, "cpu_a": statistics.median(a.cpu),
            "cpu_b": statistics.median(b.cpu), "wall_ratio": statistics.median(x / y for x, y in zip(a.wall, b.wall)),
            "wall_a": statistics.median(a.wall), "wall_b": statistics.median(b.wall)}


def paired_ratio(fn_a: Callable[[], Any], fn_b: Callable[[], Any], warmup: int, repeats: int,
                 sync: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(median of t_a / t_b per round, median t_a, median t_b) on the wall clock (`paired_cpu_and_wall`)."""
    r = paired_cpu_and_wall(fn_a, fn_b, warmup, repeats, sync)
    return r["wall_ratio"], r["wall_a"], r["wall_b"]
