"""The update rule's statistics for TensorBoard, per projection type (issue 28 item 2; TANS: paper s3.2).

The engine keeps, on logging steps, one value per matrix of each statistic its rule reports
(MatrixEngine.rule_stats: TANS's RMS scale s, its ramp gamma_t, the RMS of the base update U and of the corrected
update U' = U + gamma (s O_M - U), both before the step size lr sqrt(d_out / d_in)). Here they become
`{rule}/{projection}/{statistic}_{mean,min,max}` over every rank's own matrices of that projection type, e.g.
`tans/q_proj/rms_scale_mean`, `tans/down_proj/ramp_gamma_min`, `tans/up_proj/corrected_update_rms_max`.
A statistic no matrix of a type had this step (s when Newton-Schulz did not run, at tau = 0) is left out.
One collective (every rank's per-type summaries, a few floats), on logging steps only.
"""

from __future__ import annotations

from distsparse import dist as ddist

def _summaries(stats: dict[str, dict[str, float]]) -> dict[tuple[str, str], list[float]]:
    """(projection, statistic) -> [sum, count, min, max] over this rank's matrices."""
    out: dict[tuple[str, str], list[float]] = {}
    for name, values in stats.items():
        proj = name.rsplit(".", 1)[-1]
        for stat, value in values.items():
            s = out.setdefault((proj, stat), [0.0, 0, value, value])
            s[0] += value
            s[1] += 1
            s[2], s[3] = min(s[2], value), max(s[3], value)
    return out


def rule_metrics(stats: dict[str, dict[str, float]], rule: str) -> dict[str, float]:
    """Every rank calls it (a collective) with its own matrices' statistics; returns the same metrics on every rank."""
    merged: dict[tuple[str, str], list[float]] = {}
    for part in ddist.gather_objects(_summaries(stats)):
        for key, (total, count, low, high) in part.items():
            m = merged.setdefault(key, [0.0, 0, low, high])
            m[0] += total
            m[1] += count
            m[2], m[3] = min(m[2], low), max(m[3], high)
    out = {}
    for (proj, stat), (total, count, low, high) in sorted(merged.items()):
        prefix = f"{rule}/{proj}/{stat}"
        out.update({f"{prefix}_mean": total / count, f"{prefix}_min": low, f"{prefix}_max": high})
    return out
