"""Row tasks: the rows of a batch loaded in this process, a run of rows a call.

A task loads rows ``lo..hi`` of a batch in a plain loop: no future, lock or
event-loop hop per sample.  Each row goes into its batch through
:class:`~.samples.SampleRows` (written into the batch's buffers, or kept for the
collate); the batch's bookkeeping is updated once per task
(``RowHost.rows_done``).  Failures are noted per row.  A task runs in a decode
thread, or in the consumer's thread when rows run inline: both take it from the
decode pool's queue (``executors.ThreadRows``).

Every task passes the pass's :class:`~.tasksize.Gate` (how many tasks run at
once, in the pool) and reports its rows, wall and CPU time to the loader's
:class:`~.tasksize.RowCost` (which sizes the tasks).
"""

from __future__ import annotations

import time
from typing import Any

from .accounting import ASSEMBLE, DECODE
from . import gcpauses
from .batch import NO_RAW, WRITTEN, Batch, BatchMode
from .samples import RowHost, write_run

__all__ = ["load_rows", "run_rows", "run_sample"]


def run_rows(p: RowHost, b: Batch, lo: int, hi: int) -> None:
    """Load rows ``lo..hi`` of ``b`` (a decode-pool task; the pool passes the pass's
    gate), report the task's rows, wall and CPU time to the row cost means, and
    report the rows done (the last completes ``b``).  Returns at once when the
    pass is stopping.  Once the pass has started its process stage
    (``RowHost.stage``), a task that had not started yet sends its rows there
    instead (they come back pickled: the batch's buffers are not in shared memory)."""
    if p.stopping:
        return
    stage = p.stage
    if stage is not None and stage.submit(p, b, lo, hi, None):
        return
    done, cpu = load_rows(p, b, lo, hi)
    if done == hi - lo:
        p.rows_done(b, lo, hi, cpu)


def load_rows(p: RowHost, b: Batch, lo: int, hi: int) -> tuple[int, float]:
    """Rows ``lo..hi`` of ``b`` loaded in this thread (a task's work, or the inline
    consumer's, ``Pipeline.wait``), their rows, wall and CPU time reported to the
    row cost means; returns (rows gone through, thread CPU seconds).  Fewer rows
    than asked when the pass stopped meanwhile."""
    try:
        done, wall, cpu = _rows(p, b, lo, hi)
    except BaseException as e:  # noqa: BLE001 - a bug of ours: the batch fails with it
        with p.rows.cond:       # (the pool only logs what a task raises: the consumer
            b.error = b.error or e  # would wait for these rows for ever)
        done, wall, cpu = hi - lo, 0.0, 0.0
    p.row_cost.record(done, wall, cpu)
    return done, cpu


def _rows(p: RowHost, b: Batch, lo: int, hi: int) -> tuple[int, float, float]:
    """The work of :func:`run_rows`: (rows gone through, wall s, thread CPU s).

    With a plain ``__getitem__`` the rows are loaded first (the decode stage)
    and then written into the batch's buffers (the assemble stage, see
    ``samples.write_run``), in runs short enough that the rows held between
    the two do not set off a young collection (``gcpauses.rows_held``): one
    clock reading per stage and run, not per row.  Its locals (the samples, a
    failure's exception) die with its frame, before the batch is reported done:
    the batch's buffers must not outlive the batch."""
    ring = b.mode is BatchMode.RING
    rows = p.rows
    caps = rows.caps
    acct = p.acct
    t0 = acct.begin()
    if caps.read is not None or (ring and caps.decode_into is not None):
        done = _loaded_rows(p, b, lo, hi, ring)
        t = acct.begin()
        return done, t[0] - t0[0], t[1] - t0[1]
    whole = ring and hi - lo == b.n  # else the thread that completes b writes its rows
    step = gcpauses.rows_held(b.layout.gc_objects, hi - lo) \
        if whole and b.layout is not None else hi - lo
    t = t0
    for start in range(lo, hi, step):
        end = min(start + step, hi)
        failed = _get_rows(p, b, start, end)
        if failed is _STOPPED:
            return start - lo, 0.0, 0.0
        t = acct.end(DECODE, t, end - start - (len(failed) if failed is not None else 0))
        if ring:
            if b.mismatch:
                pass  # collated anyway
            elif not whole:
                b.deferred = True  # the thread that completes b writes every row at once
            else:  # in bulk, as its completing thread would (write_deferred)
                write_run(rows, b, start, end, failed, bulk=True)
                if end < hi and not b.mismatch:
                    _let_go(b, start, end, failed)  # (the last run's go with the batch)
            t = acct.end(ASSEMBLE, t, 0)  # counted per batch, at its completion
        elif not rows.layouts.decided:
            for row in range(start, end):
                if failed is None or row not in failed:
                    rows.layouts.offer(b.samples[row])
                    break
    return hi - lo, t[0] - t0[0], t[1] - t0[1]


def _let_go(b: Batch, lo: int, hi: int, failed: list[int] | None) -> None:
    """Rows ``lo..hi`` of ``b`` are written: let go of their samples (the rows hold
    them now; a failed row has none)."""
    b.samples[lo:hi] = [WRITTEN] * (hi - lo)
    for r in failed or ():
        b.samples[r] = None


_STOPPED: list[int] = []  # what _get_rows returns when the pass stopped meanwhile


def _get_rows(p: RowHost, b: Batch, lo: int, hi: int) -> list[int] | None:
    """``dataset[idx]`` for rows ``lo..hi`` of ``b``, kept in ``b.samples``; the
    rows that failed (noted), None when none did, ``_STOPPED`` when the pass
    stopped meanwhile."""
    get = p.rows.getitem
    samples, indices = b.samples, b.indices
    failed: list[int] | None = None
    for row in range(lo, hi):
        if p.stopping:
            return _STOPPED
        idx = indices[row]
        try:
            samples[row] = get(idx)
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            p.rows.note_failure(b, row, idx, e)
            if failed is None:
                failed = []
            failed.append(row)
    return failed


def _loaded_rows(p: RowHost, b: Batch, lo: int, hi: int, ring: bool) -> int:
    """Rows ``lo..hi`` loaded by ``SampleRows.load`` (``read`` + ``decode``, or
    ``decode_into`` a row), one at a time; returns the rows it went through."""
    rows = p.rows
    indices = b.indices
    acct = p.acct  # load records its own stages
    writer = rows.writer_for(b.layout) if ring and b.layout is not None else None
    for row in range(lo, hi):
        if p.stopping:
            return row - lo
        idx = indices[row]
        try:
            sample = rows.load(b, row, idx, NO_RAW)
            t = acct.begin()
            rows.place(b, row, sample, writer)
            if ring:
                acct.end(ASSEMBLE, t, 0)  # counted per batch, at its completion
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            rows.note_failure(b, row, idx, e)
    return hi - lo


def run_sample(p: RowHost, b: Batch, row: int, idx: Any, raw: Any) -> None:
    """Decode one sample fetched on the event loop (a decode-pool task): its row
    placed (or its failure noted), its time reported to the row cost means, and
    the row reported done with the CPU it took (as a task of ``run_rows`` reports
    its rows').  Returns at once when the pass is stopping."""
    if p.stopping:
        return
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        _load_and_place(p, b, row, idx, raw)
    except BaseException as e:  # noqa: BLE001 - travels to the consumer
        p.rows.note_failure(b, row, idx, e)
    del raw
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    p.row_cost.record(1, wall, cpu)
    # reported done only now, once the sample's locals are gone (they died with
    # _load_and_place's frame, and the exception with its handler): this thread
    # may wait a while for the GIL after handing the batch over, and must not hold
    # its decoded row (a view of the batch's buffer) or an exception (whose
    # traceback holds that row) meanwhile
    p.rows_done(b, row, row + 1, cpu)


def _load_and_place(p: RowHost, b: Batch, row: int, idx: Any, raw: Any) -> None:
    """Sample ``idx`` decoded from ``raw`` and placed in row ``row`` of ``b``."""
    sample = p.rows.load(b, row, idx, raw)
    del raw
    t = p.acct.begin()
    p.rows.place(b, row, sample)
    if b.mode is BatchMode.RING:
        p.acct.end(ASSEMBLE, t, 0)  # counted per batch, at its completion
