"""The map-style pass's decode tasks: a run of rows of one batch in one call.

A task loads rows ``lo..hi`` of a batch in a plain loop: no future, lock or
event-loop hop per sample.  Each row is written into the batch's buffers (ring
mode) through :class:`FlatWriter` when the sample is a flat tuple of NumPy
arrays, tensors and Python scalars (the common ``(image, label)``), else
through :meth:`Layout.write_row`.  The batch's bookkeeping is updated once per
task.  Failures are noted per row, as the pipeline does for single samples.

Every task passes the pass's :class:`~.autotune.Gate` (how many tasks run at
once) and reports its rows, wall and CPU time to the loader's
:class:`~.autotune.Tuner`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .accounting import ASSEMBLE, DECODE
from .layout import _PY_SCALARS, Layout, LayoutMismatch, _Leaf

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Batch, Pipeline


class FlatWriter:
    """Writes a sample that is one array, or a flat tuple/list of arrays and Python
    scalars, into its row with one NumPy assignment per leaf.

    ``write`` returns False (having written nothing that matters) whenever the
    sample is not exactly of that kind; the caller then uses ``Layout.write_row``,
    which handles every other case and raises ``LayoutMismatch`` where it must.
    The bytes written are the ones ``write_row`` writes (same NumPy copy).
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
            self.specs.append((leaf.j, s.kind, s.shape, s.dtype))

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
        for (j, kind, shape, dtype), x in zip(self.specs, leaves):
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
                v[row] = x
            elif type(x) is torch.Tensor:
                if x.shape != shape or x.dtype != dtype or x.device.type != "cpu" \
                        or x.requires_grad or x.is_conj() or x.is_neg():
                    return False
                buf = bufs[j]
                if x.data_ptr() == buf.data_ptr() + row * buf.stride()[0] * buf.element_size() \
                        and x.stride() == buf.stride()[1:]:
                    continue  # decode_into already wrote it
                v[row] = x.numpy()
            else:
                return False
        return True


def writer_for(p: Pipeline, layout: Layout) -> FlatWriter | None:
    """The pass's writer for ``layout`` (made once per layout)."""
    cached = p.row_writer
    if cached is not None and cached[0] is layout:
        return cached[1]
    w = FlatWriter.for_layout(layout)
    p.row_writer = (layout, w)
    return w


def run_rows(p: Pipeline, b: Batch, lo: int, hi: int) -> None:
    """Load rows ``lo..hi`` of ``b`` (a decode-pool task); finishes ``b`` if they were
    its last.  Returns at once when the pass is stopping."""
    if p.stopping:
        return
    done = _gated(p, _rows, p, b, lo, hi)
    if done == hi - lo:
        rows_done(p, b, lo, hi)


def _gated(p: Pipeline, load: Callable[..., int], *args: Any) -> int:
    """``load(*args)`` (it returns the rows it loaded) through the pass's gate, its
    rows, wall and thread CPU time reported to the tuner."""
    gate = p.gate
    if gate is not None:
        gate.enter()
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        done = load(*args)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        if gate is not None:
            gate.leave()
    if p.tuner is not None:
        p.tuner.record(done, wall, cpu)
    return done


def _rows(p: Pipeline, b: Batch, lo: int, hi: int) -> int:
    """The loop of :func:`run_rows`; returns the rows it went through.  Its locals
    (the last sample, a failure's exception) die with its frame, before the
    batch is reported done: the batch's buffers must not outlive the batch."""
    from .pipeline import _NO_RAW
    ring = b.mode == "ring"
    caps = p.caps
    plain = caps.read is None and not (ring and caps.decode_into is not None)
    get = p.dataset.__getitem__ if plain else None
    samples, indices = b.samples, b.indices
    acct = p.acct  # stage accounting (_load records its own stages)
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
            if get is not None:
                t = acct.begin()
                sample = get(idx)
                t = acct.end(DECODE, t)
            else:
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


def rows_done(p: Pipeline, b: Batch, lo: int, hi: int) -> None:
    """Rows ``lo..hi`` of ``b`` are done (one lock for all); the last finishes ``b``."""
    with p.cond:
        b.done[lo:hi] = b"\x01" * (hi - lo)
        b.remaining -= hi - lo
        last = b.remaining == 0
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
