"""The limit line: what the machine does with no loader at all.

``procs`` processes (one per core for the limit, one for the single-process
reference) each run the data set's own per-sample function (``dataset[i]``:
read, decode, resize, crop) over their own share of the sample order, started
together behind a barrier.  The rate is all samples over the time from the
common start to the last process's end.  Measuring it beats ``cores x`` a
single-thread rate, which overstates machines whose cores share execution
units (SMT siblings, shared caches, turbo budgets).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any, Callable


def _share(dataset: Any, indices: list[int], start: Any, end: Any, conn: Any) -> None:
    try:
        start.wait(timeout=120)
        t0 = time.perf_counter()
        for i in indices:
            dataset[i]
        conn.send(("ok", t0, time.perf_counter(), len(indices)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, never swallowed
        conn.send(("error", repr(e), 0.0, 0))
    finally:
        conn.close()
    end.wait(timeout=120)  # stay alive until the parent has had its memory read


def run_limit(dataset: Any, order: list[int], procs: int,
              pause: Callable[[], None] | None = None) -> dict:
    """Run ``dataset[i]`` for every ``i`` in ``order`` split over ``procs`` processes."""
    procs = max(1, procs)
    ctx = mp.get_context("fork")
    t = os.times()
    cpu0 = t.user + t.system + t.children_user + t.children_system
    barrier = ctx.Barrier(procs + 1)
    done = ctx.Barrier(procs + 1)
    workers, conns = [], []
    for k in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_share, args=(dataset, order[k::procs], barrier, done, send),
                        name=f"asyncfeed-bench-limit-{k}")
        p.start()
        send.close()
        workers.append(p)
        conns.append(recv)
    barrier.wait(timeout=120)
    start = time.perf_counter()
    results = [c.recv() for c in conns]
    if pause is not None:
        pause()  # every process is still alive: the parent reads the tree's memory now
    done.wait(timeout=120)
    for p in workers:
        p.join()
    t = os.times()
    cpu1 = t.user + t.system + t.children_user + t.children_system
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"limit process failed: {errors[0]}")
    end = max(r[2] for r in results)
    begin = min(min(r[1] for r in results), start)
    elapsed = end - begin
    n = sum(r[3] for r in results)
    return {
        "samples": n,
        "procs": procs,
        "elapsed_s": elapsed,
        "rate": n / elapsed,
        "steady_rate": n / elapsed,
        "per_proc_rate": [r[3] / (r[2] - r[1]) for r in results],
        "cpu_s": cpu1 - cpu0,
        "cpu_per_sample_ms": (cpu1 - cpu0) / n * 1e3,
        "process_cpu_s": cpu1,
    }
