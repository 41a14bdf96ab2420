"""Preemption (DESIGN decision 14): signal handlers only set a flag; ranks agree on it at the step boundary
with one collective, all save, and every rank exits 0.

SIGTERM (SLURM's and torchrun's stop), SIGUSR1 (common `--signal` choice) and SIGUSR2 (submitit's timeout
signal, sent to rank 0 only) are handled. Handlers are installed after submitit's, and the previous handler
is kept so that launch/slurm.py can hand the requeue back to submitit after the checkpoint is written.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class PreemptionFlag:
    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    def install(self) -> "PreemptionFlag":
        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum   # only a flag: no I/O and no collectives inside a signal handler

    @property
    def set(self) -> bool:
        return self.received is not None

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
