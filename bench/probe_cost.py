"""What the GIL probe costs a thread that holds the GIL: workload (f)'s
``__getitem__`` (tiny NumPy samples, GIL held but for NumPy's brief releases)
in a loop on the main thread, beside no probe, a probe at 100 ms, at 100 ms
with the quiet budget (what a pinned thread count runs) and at 20 ms, each for
``SECONDS`` with one long-lived probe, alternating A B C D, rounds repeated.

Prints each variant's median rate, its median ratio to "none" (round by
round), the probe's held share and the share of the time it spent awake
waiting for the GIL: while it waits, each release of the GIL by the loop
wakes it (a futex wake-up the loop pays), so that share is what the cost
follows; the budget bounds it.

    PYTHONPATH=src python bench/probe_cost.py          # 8 rounds
    PYTHONPATH=src python bench/probe_cost.py 16
"""
from __future__ import annotations

import statistics
import sys
import time

from asyncfeed._bench.workloads import CifarLike
from asyncfeed._engine.gilprobe import BUDGET, PERIOD_S, GilProbe

SECONDS = 2.0
VARIANTS: dict[str, tuple[float, float | None] | None] = {
    "none": None,
    "100 ms": (PERIOD_S, None),
    "100 ms, budget": (PERIOD_S, BUDGET),
    "20 ms": (0.02, None),
}


def loop(ds: CifarLike, seconds: float) -> float:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for i in range(100):
            ds[i]
        n += 100
    return n / (time.perf_counter() - t0)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ds = CifarLike(2_000)
    rates: dict[str, list[float]] = {k: [] for k in VARIANTS}
    held: dict[str, list[float]] = {k: [] for k in VARIANTS}
    awake: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(rounds):
        for name, spec in VARIANTS.items():
            probe = None
            if spec is not None:
                probe = GilProbe(period=spec[0], budget=spec[1])
                probe.start()
            t0 = time.perf_counter()
            rates[name].append(loop(ds, SECONDS))
            if probe is not None:
                probe.close()
                awake[name].append(probe.awake_s / (time.perf_counter() - t0))
                if probe.probes:
                    held[name].append(probe.held / probe.probes)
    base = rates["none"]
    med = statistics.median
    for name in VARIANTS:
        ratio = med(a / b for a, b in zip(rates[name], base))
        extra = (f"held {med(held[name]):.2f}, awake waiting {med(awake[name]):.1%} of the time"
                 if awake[name] else "")
        print(f"{name:16s} {med(rates[name]):9,.0f}/s  x none {ratio:.3f}  {extra}")


if __name__ == "__main__":
    main()
