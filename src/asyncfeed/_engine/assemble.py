"""The assemble stage: a complete batch's rows become one host batch, in the
thread that completed it.

A ring batch's buffers already hold its rows: they are assembled as tensors
(:meth:`Layout.assemble`, no copy).  A batch planned before the layout was
known is written into reused host buffers when its samples fit the layout
(bit-identical to ``default_collate``); any other batch goes to the collate
function, DataLoader's way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._memory.layout import LayoutMismatch
from .batch import Batch, BatchMode
from .samples import SampleRows, restored

__all__ = ["assemble"]


def assemble(rows: SampleRows, b: Batch, collate: Callable[[list[Any]], Any],
             ring_ok: bool) -> Any:
    """The host batch of complete batch ``b`` (every row loaded, none failed).
    ``ring_ok``: the pass's collate is ``default_collate`` (rows may be written).
    A ring batch's rows are let go of here (its buffers hold the data).  Raises
    what the collate function raises.  A batch a worker process collated
    (``b.collated``) is that batch."""
    if b.collated is not None:
        host, b.collated = b.collated, None
        return host
    if b.mode is BatchMode.RING and not b.mismatch:
        assert b.layout is not None and b.bufs is not None  # a ring batch's layout is known
        # a slot's tensors are the ring's; the pool's and the stage's buffers are
        # lent to this batch alone
        host = b.layout.assemble(b.bufs, b.n, own=b.slot is None)
        b.samples = [None] * b.n  # rows hold the data now
        b.views = None
        return host
    return _collate_late(rows, b, collate, ring_ok)


def _collate_late(rows: SampleRows, b: Batch, collate: Callable[[list[Any]], Any],
                  ring_ok: bool) -> Any:
    """Collate a batch submitted before the layout was known: into reused host
    buffers when the samples fit it (NumPy copies, bit-identical to
    ``default_collate``), else with the collate function."""
    layout = rows.layouts.layout
    if b.mode is BatchMode.COLLATE and ring_ok and layout is not None:
        bufs, views = rows.memory.host_buffers(layout, b.n)
        try:
            for row, sample in enumerate(b.samples):
                layout.write_row(bufs, row, sample, views)
        except LayoutMismatch:
            pass  # they do not all fit: the collate function collates them
        else:
            return layout.assemble(bufs, b.n, own=True)
    return collate(restored(b))
