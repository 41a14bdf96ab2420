"""A real preemption signal in a training test, delivered through the trainer's own handler: SIGUSR1 during a chosen
step, so every rank saves at that step's boundary and stops."""

import os
import signal


def signal_during_step(trainer, step: int, deliver: bool) -> None:
    """SIGUSR1 to this process during step `step`, before its boundary, when `deliver` (the signalled rank)."""
    original = trainer.train_step

    def step_then_signal(batches):
        if deliver and trainer.step + 1 == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(batches)
    trainer.train_step = step_then_signal
