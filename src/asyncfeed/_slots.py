"""The ring of pinned batch slots used on CUDA.

Slots are allocated once, pinned; a slot is refilled only after the event
recorded behind its last host-to-device copy has completed.
"""

from __future__ import annotations

from typing import Any

import torch

from ._layout import Layout


class Slot:
    __slots__ = ("bufs", "event")

    def __init__(self, bufs: list[Any]) -> None:
        self.bufs = bufs
        self.event: torch.cuda.Event | None = None


class SlotRing:
    """``count`` slots of ``rows`` samples each, in pinned host memory."""

    def __init__(self, layout: Layout, rows: int, count: int) -> None:
        self.layout = layout
        self.rows = rows
        self._free = [Slot(layout.allocate(rows, pin=True)) for _ in range(count)]
        self.waits = 0

    def acquire(self) -> Slot:
        """A free slot whose previous copy has finished.

        The caller bounds the slots in use (one per batch credit), so one is
        always free.  If its copy is still running (rare: it was handed out a full
        ring ago) this waits for that copy, and counts it in ``waits``.
        """
        slot = self._free.pop()
        if slot.event is not None and not slot.event.query():
            self.waits += 1
            slot.event.synchronize()
        return slot

    def release(self, slot: Slot) -> None:
        self._free.append(slot)

    def fits(self, layout: Layout, rows: int) -> bool:
        return layout is self.layout and rows <= self.rows
