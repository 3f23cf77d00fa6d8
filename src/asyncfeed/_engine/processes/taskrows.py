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

__all__ = ["PROCESS_TASK_S", "WORKER_DEPTH", "apply_results", "batches_to_fill",
           "rows_per_process_task", "rows_to_threads", "task_message"]

PROCESS_TASK_S = 0.05  # the work a task sent to a worker aims at (rows_per_process_task)
WORKER_DEPTH = 2       # tasks a worker holds at once (one running, one queued); the rest
                       # wait in the stage's backlog for the first worker to free up


def apply_results(p: RowHost, b: Batch, lo: int, hi: int, out: list[tuple[int, str, Any]]) -> None:
    """Put a task's results into ``b`` (results thread) and report its rows done:
    rows written (``"w"``: rows ``row`` to ``payload``, exclusive), failed
    (``"e"``), sent back (``"s"``), or the whole batch collated by the worker
    (``"c"``, one result for every row)."""
    if p.stopping:
        return
    for row, kind, payload in out:
        if kind == "w":
            # read back from their rows if b is collated after all
            b.samples[row:payload] = [WRITTEN] * (payload - row)
        elif kind == "e":
            p.rows.note_failure(b, row, b.indices[row], rebuild(payload))
        elif kind == "s":
            try:
                p.rows.place(b, row, payload)
            except BaseException as e:  # noqa: BLE001
                p.rows.note_failure(b, row, b.indices[row], e)
        elif kind == "c":
            b.collated = payload  # the whole batch, collated in the worker
    del out, payload
    p.rows_done(b, lo, hi)


def _full_task(n: int, row_cost_s: float) -> int:
    return max(1, min(math.ceil(PROCESS_TASK_S / row_cost_s), n))


def rows_per_process_task(n: int, workers: int, row_cost_s: float | None,
                          ahead: int = 1) -> int:
    """Rows per task sent to a worker: about ``PROCESS_TASK_S`` of work, at most the
    batch, but no more than fills every worker's ``WORKER_DEPTH`` tasks from the
    rows of the ``ahead`` batches in flight (before the row cost is known: half a
    worker's share of one batch).  A task costs the loader's process its
    results thread's wake-up, receive and bookkeeping, on top of the worker's
    queue read and reply: the fewer tasks a row takes, the less of that (see
    docs/architecture.md)."""
    workers = max(1, workers)
    if row_cost_s is None or row_cost_s <= 0:
        return max(1, n // (2 * workers))
    fill = -(-max(1, ahead) * n // (workers * WORKER_DEPTH))
    return max(1, min(_full_task(n, row_cost_s), fill))


def batches_to_fill(n: int, workers: int, row_cost_s: float | None) -> int:
    """Batches of ``n`` rows in flight that give every one of ``workers`` its
    ``WORKER_DEPTH`` tasks of about ``PROCESS_TASK_S`` each (a task's hand-offs then
    stay a small part of it, and no worker waits for the next batch to be planned);
    1 before the row cost is known."""
    if row_cost_s is None or row_cost_s <= 0 or n <= 0:
        return 1
    return -(-max(1, workers) * WORKER_DEPTH * _full_task(n, row_cost_s) // n)


def task_message(b: Batch, lo: int, hi: int, path: str | None,
                 collate: bool = False) -> tuple[Any, ...]:
    """What a worker gets for rows ``lo..hi`` of ``b`` (see ``worker.worker_main``);
    ``collate``: the worker collates them, if every row loads, and sends the batch."""
    return (list(range(lo, hi)), b.indices[lo:hi], path, b.layout if path is not None else None,
            len(b.bufs[0]) if path is not None and b.bufs else 0, collate)


def rows_to_threads(p: RowHost, b: Batch, spans: list[tuple[int, int]]) -> None:
    """Queue the runs ``spans`` of ``b`` for the threads: rows the stage could not take
    (it broke), or gave back (the pass left it); ``b`` fails as abandoned (once) if
    the threads are closing too."""
    for lo, hi in spans:
        if p.runtime.submit(rowtasks.run_rows, p, b, lo, hi) is None:
            p.abandon(b)
            return
