"""Host batch buffers that are reused once nobody holds them.

A fresh batch buffer costs more than it seems: the kernel maps and zeroes every
page on first touch, and on a virtual machine those page faults cost about as
much as a tenth of the decode itself.  The pool keeps up to ``capacity`` buffer
sets and hands one out again only when no tensor anywhere still uses its memory:
it holds each set's storages, its own tensors over them and NumPy views of
those, notes each storage's use count with only those references, and a set
whose counts are back to that is referenced by the pool alone.  A batch gets
aliases of the pool's tensors, and every tensor, view, slice and NumPy array
made from a batch holds the storage, so a batch being written or one the user
still holds (or any part of it) is never overwritten; it simply stays out of
the pool's rotation.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .layout import Layout

_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # private: may be absent


def reuse_supported() -> bool:
    """Whether this torch lets the pool see a storage's use count."""
    return _use_count is not None


class _Kept:
    """One buffer set the pool keeps: the storages, the pool's own tensors over them
    (full rows) and NumPy views of those, made once.  Batches get aliases of the
    tensors (:meth:`lend`), so a batch still being written, like a batch the user
    holds, adds to each storage's use count; ``base`` is that count with only the
    pool's own references."""

    __slots__ = ("storages", "tensors", "views", "base")

    def __init__(self, layout: Layout, bufs: list[Any]) -> None:
        self.tensors: list[torch.Tensor | None] = [
            b if isinstance(b, torch.Tensor) else None for b in bufs]
        self.storages = [t.untyped_storage() if t is not None else None for t in self.tensors]
        self.views: list[Any] = layout.numpy_views(bufs)  # the pool's: see take_views
        self.base = [0 if st is None else _use_count(st._cdata) for st in self.storages]

    def free(self) -> bool:
        """Whether nothing but the pool uses the set's memory."""
        return all(st is None or _use_count(st._cdata) == n
                   for st, n in zip(self.storages, self.base))

    def lend(self, rows: int) -> tuple[list[Any], list[Any]]:
        """Buffers for one batch (an alias per tensor, a fresh list per list leaf) and
        the NumPy views to write them through."""
        bufs: list[Any] = [[None] * rows if t is None else t.detach() for t in self.tensors]
        return bufs, list(self.views)


class HostBufferPool:
    """Batch buffers for one layout, at most ``capacity`` of them kept for reuse.

    ``take`` is safe to call from any thread.  Buffers beyond the capacity (the
    user holds many batches at once) are allocated fresh and not kept.
    """

    def __init__(self, capacity: int, pin: bool = False) -> None:
        self.capacity = capacity if reuse_supported() else 0
        self.pin = pin
        self.allocated = 0   # buffer sets made (kept or not): for tests and stats
        self.reused = 0      # buffer sets handed out again
        self._layout: Layout | None = None
        self._rows = 0
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()

    def take(self, layout: Layout, rows: int) -> list[Any]:
        """Buffers for ``rows`` samples of ``layout``: a free kept set, else new ones."""
        return self.take_views(layout, rows)[0]

    def take_views(self, layout: Layout, rows: int) -> tuple[list[Any], list[Any]]:
        """:meth:`take`, with the NumPy views of the buffers (``Layout.numpy_views``)
        a batch is written through: a kept set's are made once, not per batch
        (tensor calls made once a batch cost several times what they cost in a
        loop: the decode thread's caches hold the data set's code).
        The views are the pool's, made over its own tensors: they do not keep a
        set from being handed out again, the buffers do, so whoever writes
        through the views holds the buffers meanwhile (a batch holds both)."""
        with self._lock:
            if layout is not self._layout or rows > self._rows:
                self._layout, self._rows, self._kept = layout, rows, []
            for kept in self._kept:
                if kept.free():
                    self.reused += 1
                    return kept.lend(self._rows)
            bufs = layout.allocate(self._rows, pin=self.pin)
            self.allocated += 1
            if len(self._kept) < self.capacity:
                kept = _Kept(layout, bufs)
                self._kept.append(kept)
                del bufs  # the set's tensors are the pool's: the batch gets aliases
                return kept.lend(self._rows)
            return bufs, layout.numpy_views(bufs)

    def trim(self, keep_free: int) -> None:
        """Forget the free kept buffers beyond ``keep_free`` of them (those in use stay)."""
        with self._lock:
            kept: list[_Kept] = []
            for k in self._kept:
                if k.free():
                    if keep_free <= 0:
                        continue
                    keep_free -= 1
                kept.append(k)
            self._kept = kept

    def clear(self) -> None:
        """Forget every kept buffer (their memory goes once nobody else holds it)."""
        with self._lock:
            self._kept = []


def buffers_over(layout: Layout, storages: list[Any], rows: int) -> list[Any]:
    """A batch's buffers for ``layout`` (``rows`` rows) over existing storages: a tensor
    per leaf over its storage, a fresh list for a leaf kept as a list (``None``)."""
    out: list[Any] = []
    for spec, st in zip(layout.specs, storages):
        if st is None:
            out.append([None] * rows)
        else:
            t = torch.empty(0, dtype=spec.dtype)
            # torch's stub lacks set_(UntypedStorage, offset, size), which it takes
            out.append(t.set_(st, 0, (rows, *spec.shape)))  # type: ignore[call-overload]
    return out
