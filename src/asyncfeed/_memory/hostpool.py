"""Host batch buffers that are reused once nobody holds them.

A fresh batch buffer costs more than it seems: the kernel maps and zeroes every
page on first touch, and on a virtual machine those page faults cost about as
much as a tenth of the decode itself.  The pool keeps up to ``capacity`` buffer
sets and hands one out again only when no tensor anywhere still uses its memory:
it holds the buffers' *storages* (not tensors), and a storage whose use count
is 1 is referenced by the pool alone.  Every tensor, view, slice and NumPy array
made from a batch holds the storage, so a batch the user still holds (or any
part of it) is never overwritten; it simply stays out of the pool's rotation.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._engine.layout import Layout

_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # private: may be absent


def reuse_supported() -> bool:
    """Whether this torch lets the pool see a storage's use count."""
    return _use_count is not None


def _free(storages: list[torch.UntypedStorage | None]) -> bool:
    """Whether the pool alone holds a kept buffer set (no tensor uses its memory)."""
    return all(st is None or _use_count(st._cdata) == 1 for st in storages)


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
        self._kept: list[list[torch.UntypedStorage | None]] = []
        self._lock = threading.Lock()

    def take(self, layout: Layout, rows: int) -> list[Any]:
        """Buffers for ``rows`` samples of ``layout``: a free kept set, else new ones."""
        with self._lock:
            if layout is not self._layout or rows > self._rows:
                self._layout, self._rows, self._kept = layout, rows, []
            for storages in self._kept:
                if _free(storages):
                    self.reused += 1
                    return buffers_over(layout, storages, self._rows)
            bufs = layout.allocate(self._rows, pin=self.pin)
            self.allocated += 1
            if len(self._kept) < self.capacity:
                self._kept.append([b.untyped_storage() if isinstance(b, torch.Tensor) else None
                                   for b in bufs])
            return bufs


    def trim(self, keep_free: int) -> None:
        """Forget the free kept buffers beyond ``keep_free`` of them (those in use stay)."""
        with self._lock:
            kept: list[list[torch.UntypedStorage | None]] = []
            for storages in self._kept:
                if _free(storages):
                    if keep_free <= 0:
                        continue
                    keep_free -= 1
                kept.append(storages)
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
