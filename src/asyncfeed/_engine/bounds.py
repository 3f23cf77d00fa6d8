"""What a dearer candidate could deliver at most, read from window readings: the
bounds the execution policy (:mod:`.policy`) skips a duel by.  Pure functions of
readings (:mod:`.readings`), no rule: where a bound is compared, and against what
margin, is the policy's."""

from __future__ import annotations

import statistics

from .readings import Handoff, Window, rows_and_cpu

__all__ = ["handoff_bound", "row_cpu", "workers_bound", "workers_core_rate"]


def row_cpu(*searches: list[Window]) -> float:
    """CPU seconds a row takes where it runs in this process (threads or inline),
    pooled over the first of ``searches`` whose windows know it (a re-check that
    has run none yet reads the searches' before); 0 where none does."""
    for windows in searches:
        rows, cpu = rows_and_cpu(windows, inline=True)
        if rows:
            return cpu / rows
    return 0.0


def handoff_bound(h: Handoff | None, cpu_per_row: float, cores_left: float) -> float:
    """The most worker processes could deliver where they send rows back pickled
    (``Record.handoff``): the loader's process unpickles each one holding its GIL,
    so it reads at most ``1 / unpickle_s`` rows a second whatever the cores; and
    each row then costs its own CPU (``cpu_per_row``), its pickling and its
    unpickling, on at most ``cores_left``.  Infinite where rows are written in
    place or nothing is known."""
    if h is None or not h.unpickle_s:
        return float("inf")
    cpu_bound = cores_left / (cpu_per_row + h.pickle_s + h.unpickle_s) \
        if cpu_per_row else float("inf")
    return min(1.0 / h.unpickle_s, cpu_bound)


def workers_bound(windows: list[Window], workers: int, cores: int) -> float | None:
    """The most ``workers`` processes could deliver, read from the windows of fewer
    workers that know their workers' CPU (None where none does): the rows per CPU
    second those workers read, times the cores ``workers`` could have (the cores
    less what the loader's own process took meanwhile, at most ``workers``), and at
    most the rows per CPU second of the loader's own process (its share of a row --
    the results read, the batch assembled, the consumer's own work -- runs under
    one GIL: one core's worth at most)."""
    ws = [w for w in windows if w.workers_cpu > 0]
    if not ws:
        return None
    rows = sum(w.rows for w in ws)
    own = statistics.median(w.process_cpu / w.seconds for w in ws)
    usable = max(1.0, min(float(workers), cores - own))
    bound = workers_core_rate(ws) * usable
    own_cpu = sum(w.process_cpu for w in ws)
    return min(bound, rows / own_cpu) if own_cpu > 0 else bound


def workers_core_rate(windows: list[Window], less_s: float = 0.0) -> float:
    """Rows per CPU second of the worker processes, pooled over the windows of
    ``windows`` that know their workers' CPU (0 where none does): what one core
    runs the rows at in a worker, which runs them alone on its one thread.
    ``less_s``: CPU seconds a row costs there that are left out (the pickling of
    a row sent back, for what the rows cost where nothing is sent); none where
    that would leave no CPU."""
    ws = [w for w in windows if w.workers_cpu > 0]
    rows = sum(w.rows for w in ws)
    cpu = sum(w.workers_cpu for w in ws)
    if cpu - rows * less_s > 0:
        cpu -= rows * less_s
    return rows / cpu if cpu > 0 else 0.0
