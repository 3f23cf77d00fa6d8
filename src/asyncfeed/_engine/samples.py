"""The rows stage of a map-style pass: a sample loaded, and put into its row.

:class:`SampleRows` is what every executor (decode threads, the consumer inline,
worker processes' results) uses to turn an index into a row of its batch:

* :meth:`SampleRows.load` runs the dataset's code for one sample (``__getitem__``,
  or ``read`` + ``decode``, or ``decode`` of fetched bytes, or ``decode_into`` the
  row itself);
* :meth:`SampleRows.place` keeps the sample and, for a ring batch, writes it into
  the batch's host buffers (taken from the pool on first use, :meth:`buffers`);
* a sample that does not fit the layout turns its batch to collating, and the
  loader to collating from then on (:meth:`SampleRows.write`, the one place that
  handles ``LayoutMismatch``).

:class:`RowHost` is what the row stages need of their pass; the map-style
``Pipeline`` is one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._memory.layout import Layout, LayoutMismatch
from .accounting import DECODE, FETCH, Accounting
from .batch import NO_RAW, WRITTEN, Batch, BatchMode
from .firstcall import FirstCall, retry_racing_first
from .rowwrite import FlatWriter, write_one

if TYPE_CHECKING:  # pragma: no cover
    from .capabilities import Capabilities
    from .handoff import BatchMemory
    from .runtime import Runtime
    from .tasksize import RowCost

__all__ = ["LayoutHolder", "RowHost", "SampleRows", "restored", "write_deferred", "write_run"]


class LayoutHolder:
    """The layout read off the first sample, shared by every epoch of a loader."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.layout: Layout | None = None
        self.decided = not enabled
        self._lock = threading.Lock()

    def give_up(self) -> None:
        """Samples do not share one shape: collate every batch from now on."""
        self.layout = None
        self.decided = True

    def offer(self, sample: Any) -> None:
        """Read the layout off ``sample`` unless it is decided already (any thread)."""
        if self.decided:
            return
        with self._lock:
            if not self.decided:
                self.layout = Layout.infer(sample)
                self.decided = True


def _settle(ref: weakref.ReferenceType[SampleRows], name: str, fn: Callable[..., Any],
            first_call: FirstCall, returned: bool) -> None:
    """The dataset's own method ``fn`` in place of its wrapper ``name`` (the first
    call ended), where the rows object still lives; the loader's ``first_call``
    notes a first call that ``returned``."""
    if returned:
        first_call.returned = True
    rows = ref()
    if rows is not None:
        setattr(rows, name, fn)


class SampleRows:
    """Loads the samples of one pass and puts them into their rows (any thread).

    ``cond`` is the pass's lock: it guards a batch's ``failures`` and the moment
    a ring batch takes its host buffers.  ``getitem`` and ``getitems`` are the
    dataset's ``__getitem__`` and ``__getitems__`` (None without one); until a
    pass's first call of one has returned in the loader's life (``first_call``), a
    call that raced it and raised is made once more after it returned
    (:func:`~.firstcall.retry_racing_first`)."""

    def __init__(self, *, dataset: Any, caps: Capabilities, layouts: LayoutHolder,
                 memory: BatchMemory, acct: Accounting, cond: threading.Condition,
                 first_call: FirstCall) -> None:
        self.dataset = dataset
        self.caps = caps
        self.getitem: Callable[[Any], Any] = dataset.__getitem__
        self.getitems: Callable[[list[Any]], Any] | None = caps.getitems
        if not first_call.returned:
            # the wrappers reach this object weakly: a bound method of it would make
            # a cycle (it holds them) that only the garbage collector frees
            me = weakref.ref(self)
            self.getitem = retry_racing_first(
                self.getitem, lambda fn, ok: _settle(me, "getitem", fn, first_call, ok))
            if self.getitems is not None:
                self.getitems = retry_racing_first(
                    self.getitems, lambda fn, ok: _settle(me, "getitems", fn, first_call, ok))
        self.layouts = layouts
        self.memory = memory
        self.acct = acct
        self.cond = cond
        self._writer: tuple[Layout, FlatWriter | None] | None = None

    def writer_for(self, layout: Layout) -> FlatWriter | None:
        """The pass's flat writer for ``layout`` (made once per layout; None when
        its samples are not flat)."""
        cached = self._writer
        if cached is not None and cached[0] is layout:
            return cached[1]
        w = FlatWriter.for_layout(layout)
        self._writer = (layout, w)
        return w

    def buffers(self, b: Batch) -> list[Any]:
        """Ring batch ``b``'s buffers, taken from the host pool on first use.

        Taken as late as this (the batch's first row), the consumer has usually
        dropped an older batch by then, whose buffers the pool hands out again."""
        if b.bufs is None:
            with self.cond:
                if b.bufs is None:
                    assert b.layout is not None  # a ring batch's layout is known
                    bufs, b.views = self.memory.host_buffers(b.layout, b.n)
                    b.bufs = bufs
        return b.bufs

    def load(self, b: Batch, row: int, idx: Any, raw: Any) -> Any:
        """Sample ``idx`` (row ``row`` of ``b``) from the dataset's code: decoded from
        ``raw`` (fetched on the event loop), or read and decoded here (``raw`` is
        ``NO_RAW``), or ``dataset[idx]``.  Records its fetch and decode times; raises
        what the dataset raises."""
        caps = self.caps
        out = None
        if b.mode is BatchMode.RING and caps.decode_into is not None:
            assert b.layout is not None  # a ring batch's layout is known
            out = b.layout.row_out(self.buffers(b), row)
        acct = self.acct
        t = acct.begin()
        if raw is NO_RAW:
            if caps.read is None:
                sample = self.getitem(idx)
                acct.end(DECODE, t)
                return sample
            raw = caps.read(idx)
            t = acct.end(FETCH, t)
        if out is not None:
            sample = caps.decode_into(raw, idx, out)  # type: ignore[misc]
        else:
            sample = caps.decode(raw, idx)  # type: ignore[misc]
        acct.end(DECODE, t)
        return sample

    def write(self, b: Batch, row: int, sample: Any, writer: FlatWriter | None = None) -> bool:
        """Write ``sample`` into row ``row`` of ring batch ``b``.  False when it does
        not fit the layout: ``b`` is then collated like DataLoader collates, and so
        is every later batch (the samples' shapes vary).  Raises what a copy raises."""
        assert b.layout is not None  # a ring batch's layout is known
        try:
            write_one(b.layout, writer, self.buffers(b), b.views, row, sample)
        except LayoutMismatch:
            b.mismatch = True
            self.layouts.give_up()
            return False
        return True

    def place(self, b: Batch, row: int, sample: Any, writer: FlatWriter | None = None) -> None:
        """Keep ``sample`` as row ``row`` of ``b``: written into its buffers (a ring
        batch not turned to collating; ``b.samples`` then says ``WRITTEN``), else
        kept for the collate (the first such sample offers its layout).  Raises
        what writing the row raises."""
        ring = b.mode is BatchMode.RING
        if ring and not b.mismatch and self.write(b, row, sample, writer):
            # its row holds it: let go of it (read back from the row, should b be
            # collated after all: ``restored``)
            b.samples[row] = WRITTEN
            return
        b.samples[row] = sample
        if not ring and not self.layouts.decided:
            self.layouts.offer(sample)

    def note_failure(self, b: Batch, row: int, idx: Any, e: BaseException) -> None:
        """Sample ``idx`` (row ``row`` of ``b``) failed with ``e`` (any thread): the
        consumer raises or skips it at ``b``."""
        with self.cond:
            b.failures.append((row, idx, e))


def write_run(rows: SampleRows, b: Batch, lo: int, hi: int, failed: list[int] | None,
              bulk: bool = False) -> None:
    """Write the loaded rows ``lo..hi`` of ring batch ``b`` (but ``failed``) into its
    buffers: a whole run at once where every row is a flat sample of the batch's
    layout (``bulk``: see ``FlatWriter.write_rows``), else row by row.  A row of
    another shape turns the batch to collating (:meth:`SampleRows.write`); any
    other error writing a row is that row's."""
    layout = b.layout
    assert layout is not None  # a ring batch's layout is known
    bufs = rows.buffers(b)
    samples = b.samples
    writer = rows.writer_for(layout)
    if writer is not None and failed is None:
        try:
            views: Any = b.views  # set with bufs
            if writer.write_rows(bufs, views, lo, hi, samples, bulk):
                return
        except Exception:  # noqa: BLE001 - written row by row below, where it finds its row
            pass
    for row in range(lo, hi):
        if failed is not None and row in failed:
            continue
        try:
            if not rows.write(b, row, samples[row], writer):
                return
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            rows.note_failure(b, row, b.indices[row], e)


def write_deferred(rows: SampleRows, b: Batch) -> None:
    """Write every loaded row of ring batch ``b`` (the thread that completes ``b``,
    when its rows were loaded by several tasks that left the writing to it).

    Copying each row in the task that loaded it costs the most where rows are
    slow and threads many: a hundred threads copying rows into ten batches'
    buffers at once miss the caches, and each copy either holds the GIL or
    hands it over.  Here one thread copies the batch's rows in one go."""
    failed = [r for r, _, _ in b.failures] if b.failures else None
    if any(s is None or s is WRITTEN for s in b.samples):
        # rows written already (by a worker process into shared memory, a batch
        # split between the stage and the threads): nothing to write for them here
        failed = (failed or []) + [r for r, s in enumerate(b.samples)
                                   if s is None or s is WRITTEN]
    write_run(rows, b, 0, b.n, failed, bulk=True)


def restored(b: Batch) -> list[Any]:
    """``b.samples`` with the rows written and let go of (``WRITTEN``) read back
    from the batch's buffers: what the collate function gets for a ring batch
    whose samples did not all fit its layout (DataLoader's collate then
    raises its own error for them, or collates them as it would have)."""
    if b.layout is None or b.bufs is None:
        return b.samples
    return [b.layout.row_sample(b.bufs, r) if s is WRITTEN else s
            for r, s in enumerate(b.samples)]


class RowHost(Protocol):
    """What the row stages (row tasks, the fetch stage, the process stage) need of
    their pass; the map-style ``Pipeline`` is one."""

    stopping: bool      # the pass is over: no new row starts
    exhausted: bool     # no new batch will be planned
    batch_size: int | None
    acct: Accounting
    rows: SampleRows
    row_cost: RowCost
    runtime: Runtime
    stage: Any          # the process stage rows go to now (None: this process)
    collate: Callable[[list[Any]], Any]  # the pass's collate function
    worker_collate: bool  # a worker may collate a whole batch of the pass (no skipping:
                          # a batch is never re-made of other rows; a user's collate_fn)
    workers_cpu_s: float  # CPU seconds worker processes took on the pass's rows

    def rows_done(self, b: Batch, lo: int, hi: int, cpu: float = 0.0) -> None:
        """Rows ``lo..hi`` of ``b`` are done (loaded or failed); the last completes ``b``."""
        ...

    def abandon(self, b: Batch) -> None:
        """``b`` cannot be loaded (the loader is closing): it is ready with that error."""
        ...

    def ahead(self) -> int:
        """How many batches may be outstanding now (a process stage sizes its
        tasks to fill its workers from them)."""
        ...
