"""The tuning curve: throughput against workers or threads, and where it bends.

This is the experiment people run by hand (0, 4, 8, 12 workers...), done for
them.  The knee of a curve is the smallest setting that reaches
``KNEE_FRACTION`` of the best throughput seen on that curve: adding workers
past it buys less than the last few percent, and costs memory and CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

KNEE_FRACTION = 0.95


def knee(points: Sequence[tuple[int, float | None]], fraction: float = KNEE_FRACTION) -> dict | None:
    """``{"knob", "rate", "best_knob", "best_rate"}`` for ``[(knob, rate), ...]``."""
    pts = sorted((k, r) for k, r in points if r is not None and r)
    if not pts:
        return None
    best_k, best_r = max(pts, key=lambda p: p[1])
    for k, r in pts:
        if r >= fraction * best_r:
            return {"knob": k, "rate": r, "best_knob": best_k, "best_rate": best_r,
                    "fraction": fraction}
    return None  # unreachable: the best point always qualifies
