"""A process-stage task's rows, on the loader's side: what a worker is sent for
them, how many go in one task, their results put into their batch, and rows
the stage cannot take given back to the decode threads."""

from __future__ import annotations

import math
from typing import Any

from .. import rowtasks
from ..batch import WRITTEN, Batch
from ..samples import RowHost
from .transport import rebuild

__all__ = ["PROCESS_TASK_S", "apply_results", "rows_per_process_task", "rows_to_threads",
           "task_message"]

PROCESS_TASK_S = 0.05  # the work a task sent to a worker aims at (rows_per_process_task)


def apply_results(p: RowHost, b: Batch, lo: int, hi: int, out: list[tuple[int, str, Any]]) -> None:
    """Put a task's results into ``b`` (results thread) and report its rows done."""
    if p.stopping:
        return
    for row, kind, payload in out:
        if kind == "w":
            b.samples[row] = WRITTEN  # read back from its row if b is collated after all
        elif kind == "e":
            p.rows.note_failure(b, row, b.indices[row], rebuild(payload))
        elif kind == "s":
            try:
                p.rows.place(b, row, payload)
            except BaseException as e:  # noqa: BLE001
                p.rows.note_failure(b, row, b.indices[row], e)
    del out, payload
    p.rows_done(b, lo, hi)


def rows_per_process_task(n: int, workers: int, row_cost_s: float | None) -> int:
    """Rows per task sent to a worker: about ``PROCESS_TASK_S`` of work, no more
    than one worker's share of a batch (before the row cost is known: half that
    share).  A task costs the loader's process about 0.4 ms of CPU (the results
    thread's wake-up, receive and bookkeeping) on top of the worker's queue read
    and reply: with 10 ms tasks that was 5% of a core, taken from the workers on
    a small machine (see docs/architecture.md)."""
    workers = max(1, workers)
    if row_cost_s is None or row_cost_s <= 0:
        return max(1, n // (2 * workers))
    return max(1, min(math.ceil(PROCESS_TASK_S / row_cost_s), -(-n // workers)))


def task_message(b: Batch, lo: int, hi: int, path: str | None) -> tuple[Any, ...]:
    """What a worker gets for rows ``lo..hi`` of ``b`` (see ``worker.worker_main``)."""
    return (list(range(lo, hi)), b.indices[lo:hi], path, b.layout if path is not None else None,
            len(b.bufs[0]) if path is not None and b.bufs else 0)


def rows_to_threads(p: RowHost, b: Batch, spans: list[tuple[int, int]]) -> None:
    """Queue the runs ``spans`` of ``b`` for the threads: rows the stage could not take
    (it broke), or gave back (the pass left it); ``b`` fails as abandoned (once) if
    the threads are closing too."""
    for lo, hi in spans:
        if p.runtime.submit(rowtasks.run_rows, p, b, lo, hi) is None:
            p.abandon(b)
            return
