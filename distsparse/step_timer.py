"""Phase times of one optimizer step, measured by marks at its phase boundaries (issue 25 item 4).

    timer.start(enabled)   at the step's start; enabled on logging steps only
    timer.mark("forward")  the time since the previous mark is the phase `forward`'s (summed when repeated, e.g.
                           over micro-batches); mark(None) ends an interval that belongs to no phase
    timer.read()           {"time/<phase>": seconds} for every phase of PHASES ({} when disabled)

On CUDA a mark records an event on the current stream (no sync) and `read` waits for the last one: a logging step's
one extra sync. Elsewhere a mark reads `perf_counter` (CPU ops run as they are dispatched). Disabled, a mark is one
attribute test: no event, no clock read, no sync. `use_clock(fn)` measures with another monotone counter for a
while (bench/train.py: the OpCounter's op count, i.e. aten ops per phase); `at_mark(phase, fn)` calls fn at a phase's
mark for a while (bench/scale_check.py: bytes held after the backward, gradients included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

PHASES = ("data", "forward", "backward", "reduce", "dense_step", "backbone_step", "gather", "refresh")


class StepTimer:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = False
        self.clock: Callable[[], float] | None = None   # None: CUDA events or perf_counter
        self._points: list[tuple[str | None, object]] = []
        self._probes: dict[str, Callable[[], None]] = {}

    @contextmanager
    def use_clock(self, clock: Callable[[], float]) -> Iterator[None]:
        """Measure with `clock` (a monotone counter) instead of time inside the block."""
        self.clock = clock
        try:
            yield
        finally:
            self.clock = None

    @contextmanager
    def at_mark(self, phase: str, fn: Callable[[], None]) -> Iterator[None]:
        """Call `fn` right after each mark of `phase` on the timed steps inside the block (its time is charged to
        the next phase)."""
        assert phase in PHASES, phase
        self._probes[phase] = fn
        try:
            yield
        finally:
            del self._probes[phase]

    def _events(self) -> bool:
        return self.cuda and self.clock is None

    def _now(self):
        if self.clock is not None:
            return self.clock()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, enabled: bool) -> None:
        """Begin a step; with `enabled` False every mark of the step is a no-op."""
        self.enabled = enabled
        self._points = [(None, self._now())] if enabled else []

    def mark(self, phase: str | None) -> None:
        """End the current interval, charged to `phase` (one of PHASES) or, with None, to no phase."""
        if not self.enabled:
            return
        assert phase is None or phase in PHASES, phase
        self._points.append((phase, self._now()))
        if phase in self._probes:
            self._probes[phase]()

    def read(self) -> dict[str, float]:
        """Seconds per phase since `start` (every phase present, 0.0 when it did not run); {} when disabled.
        Ends the measurement."""
        if not self.enabled:
            return {}
        self.enabled = False
        out = {f"time/{phase}": 0.0 for phase in PHASES}
        events = self._events()
        if events:
            self._points[-1][1].synchronize()
        for (_, begin), (phase, end) in zip(self._points, self._points[1:]):
            if phase is not None:
                out[f"time/{phase}"] += begin.elapsed_time(end) / 1000.0 if events else end - begin
        return out


NULL_TIMER = StepTimer()   # never started: marks are no-ops (the default of code that may be timed)
