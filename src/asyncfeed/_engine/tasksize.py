"""How a pass's rows are cut into decode tasks, and how many tasks run at once.

:class:`Gate`: at most ``limit`` decode tasks of a pass run at once (the
execution policy sets the limit: the thread count it measures, 0 while the
consumer loads the rows itself).  :class:`RowCost`: the running means of what a
row costs (wall and thread CPU time per row, from every task), from which
:func:`rows_per_task` sizes the tasks: tiny samples in batch-sized tasks,
expensive ones a few rows at a time.
"""

from __future__ import annotations

import math
import threading

TASK_TARGET_S = 2e-3   # a task this long makes its ~20 us of overhead negligible
WAITING_ROW_CPU_SHARE = 0.1  # a row on a core less than this share of its time waits ...
WAITING_ROWS_PER_TASK = 2    # ... and shares a task with another: its own Python is
                             # most of what it costs the process


class Gate:
    """At most ``limit`` decode tasks of one pass run at once; the rest wait.

    ``open()`` (at the end of the pass) lets every waiter through and makes the
    gate a no-op, so no thread stays blocked in it when the pool is joined.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active = 0
        self._open = False
        self._cond = threading.Condition(threading.Lock())

    def enter(self) -> None:
        with self._cond:
            while self._active >= self.limit and not self._open:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify()

    @property
    def held(self) -> int:
        """The places held now: tasks running, and threads waiting for a task with a
        place kept from their last (read without the lock)."""
        return self._active

    def over(self) -> bool:
        """Whether more tasks hold the gate than its limit allows now: a holder that
        keeps its place between tasks (``TaskPool``) should leave (read without
        the lock: a stale answer only delays that by one task)."""
        return self._active > self.limit and not self._open

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self.limit = limit
            self._cond.notify_all()

    def open(self) -> None:
        """Let every waiting and future task through (idempotent, any thread)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()


class RowCost:
    """Running means of a row's wall and thread CPU time, over every task (any
    thread; a race between two reports loses one report, never corrupts)."""

    def __init__(self) -> None:
        self.wall_s: float | None = None
        self.cpu_s: float | None = None

    def record(self, rows: int, wall: float, cpu: float) -> None:
        """A task ran ``rows`` rows in ``wall`` seconds, ``cpu`` of them on a core."""
        if rows <= 0:
            return
        c, u = wall / rows, cpu / rows
        self.wall_s = c if self.wall_s is None else 0.8 * self.wall_s + 0.2 * c
        self.cpu_s = u if self.cpu_s is None else 0.8 * self.cpu_s + 0.2 * u


def rows_per_task(n: int, running: int, row_cost_s: float | None,
                  row_cpu_s: float | None = None) -> int:
    """Rows of an ``n``-row batch per decode task, with ``running`` threads running.

    Before any measurement, a quarter of a thread's share of the batch.  Then
    enough rows for a task to last ``TASK_TARGET_S`` (the whole batch when
    samples are tiny), but no more than one running thread's share, so that
    every running thread works on each batch -- except for rows whose CPU
    (``row_cpu_s``) is under ``WAITING_ROW_CPU_SHARE`` of their wall time
    (``row_cost_s``): ``WAITING_ROWS_PER_TASK`` of those go in a task.
    """
    running = max(1, running)
    if row_cost_s is None or row_cost_s <= 0:
        return max(1, n // (4 * running))
    k = math.ceil(TASK_TARGET_S / row_cost_s)
    k = max(1, min(k, math.ceil(n / running)))
    if row_cpu_s is not None and row_cpu_s < WAITING_ROW_CPU_SHARE * row_cost_s:
        # rows that mostly wait (I/O, a remote call): a task's own Python (queue
        # wake-up, report, bookkeeping) is most of what they cost the process, so
        # two rows share it; the loader keeps twice the rows in flight for that
        # (``AsyncLoader._default_prefetch``), and every thread stays busy
        k = max(k, WAITING_ROWS_PER_TASK)
    return k
