"""The hand-over from a pass to its process stage: a batch's rows sent to the
workers (into shared memory where the batch is written in place), and the row
tasks still queued for the threads taken over when the stage starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import rowtasks
from ..batch import Batch, BatchMode
from ..samples import RowHost
from .taskrows import rows_to_threads

if TYPE_CHECKING:  # pragma: no cover
    from .stage import ProcessStage

__all__ = ["submit_batch", "take_over_queued"]


def submit_batch(p: RowHost, stage: ProcessStage, b: Batch) -> bool:
    """Send every row of ``b`` to the worker processes.  False (nothing sent) when
    the stage cannot take work: the caller runs the batch in threads."""
    path = None
    if b.mode is BatchMode.RING and b.slot is None:
        if b.bufs is None:
            assert b.layout is not None  # a ring batch's layout is known
            try:
                bufs, path = stage.take(b.layout, max(b.n, p.batch_size or b.n))
            except OSError:  # no shared memory left: the threads take the batch
                return False
            b.views = b.layout.numpy_views(bufs)
            b.bufs = bufs
        else:
            path = stage.buffers.path_of(b.bufs)
    step = stage.task_rows(b.n, p.row_cost, p.ahead())
    spans = [(lo, min(lo + step, b.n)) for lo in range(0, b.n, step)]
    for i, (lo, hi) in enumerate(spans):
        if not stage.submit(p, b, lo, hi, path):
            if i == 0:
                return False
            rows_to_threads(p, b, spans[i:])  # the stage broke mid-batch
            return True
    return True


def take_over_queued(p: RowHost, stage: ProcessStage) -> int:
    """(once, as ``p`` starts using ``stage``) Send the row tasks of ``p`` still
    queued for its threads to the stage in the stage's task sizes: a batch none
    of whose rows has started goes whole (``submit_batch``: into shared memory),
    the queued rows of a started batch in runs of ``rows_per_process_task``
    (they come back pickled).  Left to the threads, each of those tasks -- sized
    for a thread, often one row -- would wake a thread to send it on, and the
    workers would wait between them.  Returns the rows moved; rows
    the stage cannot take (it broke) are queued for the threads again."""
    run_rows = rowtasks.run_rows
    taken = p.runtime.pool.take_queued(
        lambda fn, args: fn is run_rows and bool(args) and args[0] is p)
    if not taken:
        return 0
    runs: dict[int, tuple[Batch, list[tuple[int, int]]]] = {}
    for _, (_, b, lo, hi) in taken:
        runs.setdefault(b.k, (b, []))[1].append((lo, hi))
    moved = 0
    for b, spans in runs.values():
        spans.sort()
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        whole = merged == [[0, b.n]] and b.bufs is None
        if whole and submit_batch(p, stage, b):
            moved += b.n
            continue
        path = stage.buffers.path_of(b.bufs) if b.bufs else None
        step = stage.task_rows(b.n, p.row_cost, p.ahead())
        chunks = [(lo, min(lo + step, hi0)) for lo0, hi0 in merged
                  for lo in range(lo0, hi0, step)]
        for i, (lo, hi) in enumerate(chunks):
            if not stage.submit(p, b, lo, hi, path):
                rows_to_threads(p, b, chunks[i:])
                break
            moved += hi - lo
    return moved
