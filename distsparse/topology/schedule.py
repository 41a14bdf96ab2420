"""When the topology refreshes and how hard: the zeta_t, temperature and refresh-step schedules.

Pure functions of the optimizer step (no state to checkpoint). Sources: research/cht_topology.md s2a
(temperature: an exponent on |w|, linear from start_T to end_T over T_end, the LLM repo's
`T = start_T + step * (end_T - start_T) / T_end`, README values 1 -> 9) and s2b (adaptive zeta: RigL's
cosine decay zeta_t = zeta0/2 (1 + cos(pi t / T_end)); T_end = 0.75 x total steps; masks frozen after T_end).
`step` counts optimizer steps taken so far: the first refresh happens after `interval` steps, never at step 0
(the initial random mask has nothing learned to select on).
"""

from __future__ import annotations

import math

T_END_FRACTION = 0.75


def t_end_for(total_steps: int, fraction: float = T_END_FRACTION) -> int:
    """T_end = int(fraction * total_steps), as the lab's LLM code (`int(num_training_steps * 0.75)`)."""
    if total_steps < 1:
        raise ValueError(f"total_steps: got {total_steps}; allowed: an integer >= 1")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"t_end fraction: got {fraction}; allowed: 0 < fraction <= 1")
    return max(1, int(fraction * total_steps))


def _check_step(step: int, t_end: int) -> None:
    if t_end < 1:
        raise ValueError(f"t_end: got {t_end}; allowed: an integer >= 1")
    if step < 0:
        raise ValueError(f"step: got {step}; allowed: an integer >= 0")


def zeta_at(step: int, t_end: int, zeta0: float = 0.1) -> float:
    """Refresh fraction zeta_t = zeta0/2 (1 + cos(pi min(t, T_end) / T_end)); 0 from T_end on."""
    _check_step(step, t_end)
    return zeta0 / 2.0 * (1.0 + math.cos(math.pi * min(step, t_end) / t_end))


def temperature_at(step: int, t_end: int, start: float = 1.0, end: float = 9.0) -> float:
    """Soft-selection exponent T, linear from `start` at step 0 to `end` at T_end, held there after."""
    _check_step(step, t_end)
    return start + (end - start) * min(step, t_end) / t_end


def is_refresh_step(step: int, interval: int, t_end: int) -> bool:
    """True every `interval` optimizer steps (step > 0) while step <= T_end; masks are frozen after."""
    if interval < 1:
        raise ValueError(f"update_interval: got {interval}; allowed: an integer >= 1")
    _check_step(step, t_end)
    return 0 < step <= t_end and step % interval == 0
