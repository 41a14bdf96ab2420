"""Progress figures of the log line and the metrics writers (issue 26 item 2), true across resumes:

    progress/tokens_seen    the data state's consumed samples x seq_len (restored by a resume, any world size)
    time/tokens_per_s       tokens over the step time of this process's last `window` steps (not one step)
    progress/eta_s          wall time since this process's loop started / the steps it took x the steps left: a
                            resumed run is timed by its own steps only (evaluation and checkpoints included)
    perf/mfu_dense_equiv    MFU of the dense-equivalent FLOPs, perf/mfu_active of the active FLOPs
                            (distsparse/perf/flops.py), over the window's mean step time; left out without a peak

`StepWindow` holds the arithmetic and takes its clock readings as arguments (no clock of its own), so it is
tested with numbers.
"""

from __future__ import annotations

from collections import deque

from distsparse.perf.flops import StepFlops, mfu

WINDOW_STEPS = 20   # time/tokens_per_s and MFU over this process's last 20 steps


class StepWindow:
    """This process's steps: the last `window` step times and token counts, and every step's end on the clock that
    `start_time` was read from."""

    def __init__(self, window: int, start_time: float):
        if window < 1:
            raise ValueError(f"window: got {window}; allowed: >= 1 steps")
        self.start_time = start_time
        self.steps_done = 0
        self.last_time = start_time
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)   # (step seconds, tokens)

    def add(self, step_s: float, tokens: int, now: float) -> None:
        """A step of `step_s` seconds over `tokens` tokens that ended at `now`."""
        self._recent.append((step_s, tokens))
        self.steps_done += 1
        self.last_time = now

    @property
    def mean_step_s(self) -> float:
        return sum(s for s, _ in self._recent) / len(self._recent)

    @property
    def tokens_per_s(self) -> float:
        return sum(t for _, t in self._recent) / sum(s for s, _ in self._recent)

    def eta_s(self, remaining_steps: int) -> float:
        """Seconds to go for `remaining_steps` at this process's mean wall time per step so far."""
        assert self.steps_done, "no step taken in this process yet"
        return (self.last_time - self.start_time) / self.steps_done * remaining_steps


def progress_metrics(window: StepWindow, *, tokens_seen: int, remaining_steps: int, flops: StepFlops,
                     peak_flops: float | None, world_size: int) -> dict[str, float]:
    """The progress scalars after a step (module docstring); the MFU pair only with a known `peak_flops`."""
    out = {"progress/tokens_seen": float(tokens_seen), "time/tokens_per_s": window.tokens_per_s,
           "progress/eta_s": window.eta_s(remaining_steps)}
    if peak_flops is not None:
        step_s = window.mean_step_s
        out["perf/mfu_dense_equiv"] = mfu(flops.dense_equivalent, step_s, peak_flops, world_size)
        out["perf/mfu_active"] = mfu(flops.active, step_s, peak_flops, world_size)
    return out
