"""The map-style pass's decode tasks: a run of rows of one batch in one call.

A task loads rows ``lo..hi`` of a batch in a plain loop: no future, lock or
event-loop hop per sample.  Each row is written into the batch's buffers (ring
mode) through :class:`FlatWriter` when the sample is a flat tuple of NumPy
arrays, tensors and Python scalars (the common ``(image, label)``), else
through :meth:`Layout.write_row`.  The batch's bookkeeping is updated once per
task.  Failures are noted per row, as the pipeline does for single samples.

Every task passes the pass's :class:`~.tasksize.Gate` (how many tasks run at
once) and reports its rows, wall and CPU time to the loader's
:class:`~.tasksize.RowCost` (which sizes the tasks).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .accounting import ASSEMBLE, DECODE
from .._memory.layout import _PY_SCALARS, Layout, LayoutMismatch, _Leaf

log = logging.getLogger("asyncfeed")

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Batch, Pipeline


#: rows of at most this many bytes are copied holding the GIL (a memcpy: ~10 us for a
#: 3x224x224 uint8 image).  NumPy lets go of the GIL for every copy; when other threads
#: wait for it, each release hands it over and taking it back costs two context
#: switches, more than the copy (the "ceiling" bench workload).  Bigger rows are
#: copied by NumPy, the GIL released.
HOLD_GIL_BYTES = 1 << 19
#: a batch written in bulk (see :func:`write_deferred`) copies array leaves of at
#: least this many bytes a row with one ``torch.stack`` that lets go of the GIL once;
#: smaller rows are copied one by one holding it (cheaper than torch's per-call cost)
BULK_ROW_BYTES = 1 << 15


class _Written:
    """The type of :data:`WRITTEN`."""

    def __repr__(self) -> str:
        return "WRITTEN"


#: what ``Batch.samples`` holds for a row a worker process wrote into the batch's
#: shared-memory buffers itself (its sample never came to this process): read back
#: from the row (:func:`restored`) when the batch must be collated after all
WRITTEN = _Written()


def _copy_row(dst: Any, row: int, x: Any, nbytes: int) -> None:
    """``dst[row] = x`` (same shape and dtype), holding the GIL when the row is small
    and both sides are C-contiguous; byte for byte what NumPy's assignment writes."""
    if nbytes <= HOLD_GIL_BYTES and x.flags.c_contiguous:
        try:
            memoryview(dst).cast("B")[row * nbytes:(row + 1) * nbytes] = \
                memoryview(x).cast("B")
            return
        except (TypeError, ValueError):
            pass  # a format memoryview cannot cast (complex): NumPy's copy below
    dst[row] = x


class FlatWriter:
    """Writes a sample that is one array, or a flat tuple/list of arrays and Python
    scalars, into its row with one copy per leaf (:meth:`write`), or the rows of a
    whole task column by column (:meth:`write_rows`).

    Both return False (having written nothing that matters) whenever a sample is
    not exactly of that kind; the caller then uses ``Layout.write_row``, which
    handles every other case and raises ``LayoutMismatch`` where it must.  The
    bytes written are the ones ``write_row`` writes.
    """

    def __init__(self, layout: Layout) -> None:
        skel = layout.skeleton
        self.single = isinstance(skel, _Leaf)
        self.container = None if self.single else type(skel)
        leaves = [skel] if self.single else list(skel)
        self.k = len(leaves)
        self.specs = []
        for leaf in leaves:
            s = layout.specs[leaf.j]
            nbytes = 0
            if s.kind in ("tensor", "ndarray") and s.dtype is not None:
                nbytes = math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size()
            self.specs.append((leaf.j, s.kind, s.shape, s.dtype, nbytes))

    @classmethod
    def for_layout(cls, layout: Layout) -> FlatWriter | None:
        skel = layout.skeleton
        flat = isinstance(skel, _Leaf) or (
            type(skel) in (tuple, list) and all(isinstance(x, _Leaf) for x in skel))
        return cls(layout) if flat else None

    def write(self, bufs: list[Any], views: list[Any], row: int, sample: Any) -> bool:
        if self.single:
            leaves: Any = (sample,)
        elif type(sample) is not self.container or len(sample) != self.k:
            return False
        else:
            leaves = sample
        for (j, kind, shape, dtype, nbytes), x in zip(self.specs, leaves):
            v = views[j]
            if kind == "list":
                if type(x) is not str and type(x) is not bytes:
                    return False
                bufs[j][row] = x
            elif v is None:
                return False
            elif kind == "scalar":
                if _PY_SCALARS.get(type(x)) != dtype:
                    return False
                v[row] = x
            elif type(x) is np.ndarray:
                if x.shape != shape or x.dtype != v.dtype:
                    return False
                _copy_row(v, row, x, nbytes)
            elif type(x) is torch.Tensor:
                if not _plain_tensor(x, shape, dtype):
                    return False
                buf = bufs[j]
                if x.data_ptr() == buf.data_ptr() + row * buf.stride()[0] * buf.element_size() \
                        and x.stride() == buf.stride()[1:]:
                    continue  # decode_into already wrote it
                _copy_row(v, row, x.numpy(), nbytes)
            else:
                return False
        return True

    def write_rows(self, bufs: list[Any], views: list[Any], lo: int, hi: int,
                   samples: list[Any], bulk: bool = False) -> bool:
        """Write ``samples[lo:hi]`` into rows ``lo..hi``, one leaf at a time: each
        leaf's values are checked for the whole run first, scalars go in with one
        NumPy assignment.  With ``bulk``, array leaves of at least
        ``BULK_ROW_BYTES`` a row go in with one ``torch.stack`` (one release of the
        GIL for the whole copy), else row by row (:func:`_copy_row`).  For samples
        ``__getitem__`` returned (never a view of the batch's own buffers).  May
        raise what a NumPy assignment raises (an int too large for int64): the
        caller then writes row by row."""
        rows = samples[lo:hi]
        if self.single:
            columns: Any = (rows,)
        else:
            container, k = self.container, self.k
            for s in rows:
                if type(s) is not container or len(s) != k:
                    return False
            columns = zip(*rows)
        for (j, kind, shape, dtype, nbytes), col in zip(self.specs, columns):
            v = views[j]
            if kind == "list":
                for x in col:
                    if type(x) is not str and type(x) is not bytes:
                        return False
                bufs[j][lo:hi] = col
            elif v is None:
                return False
            elif kind == "scalar":
                get = _PY_SCALARS.get
                for x in col:
                    if get(type(x)) != dtype:
                        return False
                v[lo:hi] = col
            else:
                vdtype = v.dtype
                stacked = bulk and nbytes >= BULK_ROW_BYTES
                arrays: list[Any] = []
                for x in col:
                    if type(x) is np.ndarray:
                        if x.shape != shape or x.dtype != vdtype:
                            return False
                        if stacked:
                            if not x.flags.writeable:
                                stacked = False  # torch would warn: NumPy copies it
                                arrays = [a.numpy() if type(a) is torch.Tensor else a
                                          for a in arrays]
                            else:
                                x = torch.from_numpy(x)
                    elif type(x) is torch.Tensor and _plain_tensor(x, shape, dtype):
                        if not stacked:
                            x = x.numpy()
                    else:
                        return False
                    arrays.append(x)
                if stacked:
                    torch.stack(arrays, out=bufs[j][lo:hi])
                    continue
                if nbytes < BULK_ROW_BYTES and _joined(v, lo, hi, nbytes, arrays):
                    continue
                row = lo
                for x in arrays:
                    _copy_row(v, row, x, nbytes)
                    row += 1
        return True


def _joined(dst: Any, lo: int, hi: int, nbytes: int, arrays: list[Any]) -> bool:
    """``dst[lo:hi] = arrays`` (rows of ``nbytes`` bytes, dtype and shape checked) as
    one ``bytes.join`` and one copy into ``dst``: a third of the time of a copy
    per row for small rows (0.16 against 0.5 us for a 3 KB row), the GIL held
    throughout (``bytes.join`` lets go of it once, above 1 MB).  False, nothing
    written, where a row is not C-contiguous (NumPy refuses the plain buffer
    ``bytes.join`` asks for, before anything is written) or ``dst`` has no byte
    view."""
    try:
        out = memoryview(dst).cast("B")
        out[lo * nbytes:hi * nbytes] = b"".join(arrays)
    except (TypeError, ValueError, BufferError, NotImplementedError):
        return False
    return True


def _plain_tensor(x: torch.Tensor, shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether NumPy can copy ``x`` as a row of ``shape`` and ``dtype``."""
    return (x.shape == shape and x.dtype == dtype and x.device.type == "cpu"
            and not x.requires_grad and not x.is_conj() and not x.is_neg())


def writer_for(p: Pipeline, layout: Layout) -> FlatWriter | None:
    """The pass's writer for ``layout`` (made once per layout)."""
    cached = p.row_writer
    if cached is not None and cached[0] is layout:
        return cached[1]
    w = FlatWriter.for_layout(layout)
    p.row_writer = (layout, w)
    return w


def run_rows(p: Pipeline, b: Batch, lo: int, hi: int) -> None:
    """Load rows ``lo..hi`` of ``b`` (a decode-pool task; the pool passes the pass's
    gate, see ``Pipeline.gate``), report the task's rows, wall and CPU time to the
    row cost means, and finish ``b`` if they were its last.  Returns at once when the pass
    is stopping.  Once the pass has started its process stage (``Pipeline.stage``),
    a task that had not started yet sends its rows there instead (they come back
    pickled: the batch's buffers are not in shared memory)."""
    if p.stopping:
        return
    stage = p.stage
    if stage is not None and stage.submit(p, b, lo, hi, None):
        return
    try:
        done, wall, cpu = _rows(p, b, lo, hi)
    except BaseException as e:  # noqa: BLE001 - a bug of ours: the batch fails with it
        with p.cond:            # (the pool only logs what a task raises: the consumer
            b.error = b.error or e  # would wait for these rows for ever)
        done, wall, cpu = hi - lo, 0.0, 0.0
    p.row_cost.record(done, wall, cpu)
    if done == hi - lo:
        rows_done(p, b, lo, hi)


def _gated(p: Pipeline, load: Callable[..., int], *args: Any) -> int:
    """``load(*args)`` (it returns the rows it loaded), its rows, wall and thread CPU
    time reported to the row cost means (the pass's gate is passed in the pool, see
    ``Pipeline.gate``)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    done = load(*args)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    p.row_cost.record(done, wall, cpu)
    return done


def _rows(p: Pipeline, b: Batch, lo: int, hi: int) -> tuple[int, float, float]:
    """The work of :func:`run_rows`: (rows gone through, wall s, thread CPU s).

    With a plain ``__getitem__`` the rows are loaded first (the decode stage,
    timed once for the run) and then written into the batch's buffers (the
    assemble stage, see :func:`_write`): one clock reading per stage and task,
    not per row.  Its locals (the samples, a failure's exception) die with its
    frame, before the batch is reported done: the batch's buffers must not
    outlive the batch."""
    ring = b.mode == "ring"
    caps = p.caps
    acct = p.acct
    t0 = acct.begin()
    if caps.read is not None or (ring and caps.decode_into is not None):
        done = _loaded_rows(p, b, lo, hi, ring)
        t = acct.begin()
        return done, t[0] - t0[0], t[1] - t0[1]
    get = p.dataset.__getitem__
    samples, indices = b.samples, b.indices
    failed: list[int] | None = None
    for row in range(lo, hi):
        if p.stopping:
            return row - lo, 0.0, 0.0
        idx = indices[row]
        try:
            samples[row] = get(idx)
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            p._note_failure(b, row, idx, e)
            if failed is None:
                failed = []
            failed.append(row)
    t = acct.end(DECODE, t0, hi - lo - (len(failed) if failed is not None else 0))
    if ring:
        if b.mismatch:
            pass  # collated anyway
        elif hi - lo < b.n:
            b.deferred = True  # the thread that finishes b writes every row at once
        else:
            _write(p, b, lo, hi, failed)
        t = acct.end(ASSEMBLE, t, 0)  # counted per batch, in _finish
    elif not p.layouts.decided:
        for row in range(lo, hi):
            if failed is None or row not in failed:
                p.layouts.offer(samples[row])
                break
    return hi - lo, t[0] - t0[0], t[1] - t0[1]


def write_deferred(p: Pipeline, b: Batch) -> None:
    """Write every loaded row of ring batch ``b`` (the thread that finishes ``b``,
    when its rows were loaded by several tasks that left the writing to it).

    Copying each row in the task that loaded it costs the most where rows are
    slow and threads many: a hundred threads copying rows into ten batches'
    buffers at once miss the caches, and each copy either holds the GIL or
    hands it over.  Here one thread copies the batch's rows in one go."""
    failed = [r for r, _, _ in b.failures] if b.failures else None
    if any(s is None or s is WRITTEN for s in b.samples):
        # rows a worker process wrote into shared memory itself (a batch split
        # between the stage and the threads): nothing to write for them here
        failed = (failed or []) + [r for r, s in enumerate(b.samples)
                                   if s is None or s is WRITTEN]
    _write(p, b, 0, b.n, failed, bulk=True)


def _write(p: Pipeline, b: Batch, lo: int, hi: int, failed: list[int] | None,
           bulk: bool = False) -> None:
    """Write the loaded rows ``lo..hi`` of ring batch ``b`` (but ``failed``) into its
    buffers: a whole run at once where every row is a flat sample of the
    batch's layout (``bulk``: see ``FlatWriter.write_rows``), else row by row.  A
    row of another shape makes the batch collated (``LayoutMismatch``); any
    other error writing a row is that row's."""
    layout = b.layout
    assert layout is not None  # a ring batch's layout is known
    bufs = p._rows_of(b)
    views: Any = b.views
    samples = b.samples
    writer = writer_for(p, layout)
    if writer is not None and failed is None:
        try:
            if writer.write_rows(bufs, views, lo, hi, samples, bulk):
                return
        except Exception:  # noqa: BLE001 - written row by row below, where it finds its row
            pass
    for row in range(lo, hi):
        if failed is not None and row in failed:
            continue
        sample = samples[row]
        try:
            if writer is None or not writer.write(bufs, views, row, sample):
                layout.write_row(bufs, row, sample, views)
        except LayoutMismatch:
            # shapes vary: collate this batch like DataLoader, stop using rows
            b.mismatch = True
            p.layouts.give_up()
            return
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            p._note_failure(b, row, b.indices[row], e)


def _loaded_rows(p: Pipeline, b: Batch, lo: int, hi: int, ring: bool) -> int:
    """Rows ``lo..hi`` loaded by the pipeline's ``_load`` (``read`` + ``decode``, or
    ``decode_into`` a row), one at a time; returns the rows it went through."""
    from .pipeline import _NO_RAW
    samples, indices = b.samples, b.indices
    acct = p.acct  # _load records its own stages
    if ring:
        assert b.layout is not None  # a ring batch's layout is known
        layout = b.layout
        bufs = p._rows_of(b)
        views: Any = b.views
        writer = writer_for(p, layout)
    for row in range(lo, hi):
        if p.stopping:
            return row - lo
        idx = indices[row]
        try:
            sample = p._load(b, row, idx, _NO_RAW)
            t = acct.begin()
            samples[row] = sample
            if ring:
                if b.mismatch:
                    continue  # collated anyway
                if writer is None or not writer.write(bufs, views, row, sample):
                    try:
                        layout.write_row(bufs, row, sample, views)
                    except LayoutMismatch:
                        # shapes vary: collate this batch like DataLoader, stop using rows
                        b.mismatch = True
                        p.layouts.give_up()
                acct.end(ASSEMBLE, t, 0)  # counted per batch, in _finish
            elif not p.layouts.decided:
                p.layouts.offer(sample)
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            p._note_failure(b, row, idx, e)
    return hi - lo


def place_sample(p: Pipeline, b: Batch, row: int, sample: Any) -> None:
    """Put a sample loaded elsewhere (a worker process) into row ``row`` of ``b``."""
    b.samples[row] = sample
    if b.mode == "ring":
        if b.mismatch:
            return
        bufs = p._rows_of(b)
        assert b.layout is not None  # a ring batch's layout is known
        try:
            b.layout.write_row(bufs, row, sample, b.views)
        except LayoutMismatch:
            b.mismatch = True
            p.layouts.give_up()
    elif not p.layouts.decided:
        p.layouts.offer(sample)


def restored(b: Batch) -> list[Any]:
    """``b.samples`` with the rows a worker process wrote itself (:data:`WRITTEN`)
    read back from the batch's buffers: what the collate function gets for a ring
    batch whose samples did not all fit its layout (DataLoader's collate then
    raises its own error for them, or collates them as it would have)."""
    if b.layout is None or b.bufs is None:
        return b.samples
    return [b.layout.row_sample(b.bufs, r) if s is WRITTEN else s
            for r, s in enumerate(b.samples)]


def rows_done(p: Pipeline, b: Batch, lo: int, hi: int) -> None:
    """Rows ``lo..hi`` of ``b`` are done (one lock for all); the last finishes ``b``."""
    with p.cond:
        b.done[lo:hi] = b"\x01" * (hi - lo)
        b.remaining -= hi - lo
        last = b.remaining == 0
        p.count_done(hi - lo)
    if last:
        p._finish(b)


def run_sample(p: Pipeline, b: Batch, row: int, idx: Any, raw: Any) -> None:
    """One fetched sample's decode (a decode-pool task), gated and measured."""
    if p.stopping:
        return
    _gated(p, _one_sample, p, b, row, idx, raw)


def _one_sample(p: Pipeline, b: Batch, row: int, idx: Any, raw: Any) -> int:
    p._run_sample(b, row, idx, raw)
    return 1
