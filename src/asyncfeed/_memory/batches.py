"""A loader's batch memory: reused host buffers and, on a device, the slot ring.

One :class:`LoaderMemory` per loader, shared by its passes (it fits
``asyncfeed._engine.handoff.BatchMemory``).  With a device transfer and pinned
batches, batches are written into the slots of a :class:`SlotRing` (made once
the batch layout is known, remade when a batch does not fit); otherwise into
buffers of a :class:`HostBufferPool`, reused once nobody holds them.
"""

from __future__ import annotations

import threading
from typing import Any

from .layout import Layout
from .hostpool import HostBufferPool
from .slots import SlotRing


class LoaderMemory:
    """Host buffers and slot ring for batches of up to ``batch_size`` rows.

    ``use_ring``: batches go to a device from pinned slots (``prefetch`` of
    them).  ``pin_host``: host batches are handed out pinned (no device); they
    are then not reused, since a user's own non-blocking copy may still read
    one after dropping it (torch's pinned allocator caches them).  Otherwise
    the pool keeps room for the prefetched batches, the one the user holds and
    one being handed over.
    """

    def __init__(self, *, batch_size: int | None, prefetch: int, use_ring: bool,
                 pin_host: bool) -> None:
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.use_ring = use_ring
        pinned = pin_host and not use_ring
        self.pool = HostBufferPool(0 if pinned else prefetch + 2, pin=pinned)
        self.current_ring: SlotRing | None = None
        self._lock = threading.Lock()

    def _rows(self, rows: int) -> int:
        return max(rows, self.batch_size or rows)

    def host_buffers(self, layout: Layout, rows: int) -> tuple[list[Any], list[Any]]:
        """Host buffers for a batch of ``rows`` (reused once nobody holds them) and
        their NumPy views (``Layout.numpy_views``)."""
        return self.pool.take_views(layout, self._rows(rows))

    def ring(self, layout: Layout, rows: int) -> SlotRing | None:
        """The slot ring (None without one), made once the layout is known and remade
        for a batch it does not fit (slots of the old ring are dropped as released)."""
        if not self.use_ring:
            return None
        with self._lock:
            if self.current_ring is None or not self.current_ring.fits(layout, rows):
                self.current_ring = SlotRing(layout, self._rows(rows), self.prefetch)
            return self.current_ring

    def clear(self) -> None:
        """Free the pool's idle buffers (the ring stays for the next pass)."""
        self.pool.clear()

    def close(self) -> None:
        """Free the pool's buffers and the ring. Idempotent."""
        self.current_ring = None
        self.pool.clear()
