"""The ring of pinned batch slots used on CUDA.

Slots are allocated once, pinned; a slot is refilled only after the event
recorded behind its last host-to-device copy has completed.

The ring hands out the free slot released longest ago whose copy has finished,
so a wait happens only when every free slot is still being copied.  A slot
belongs to the ring that made it: when the loader replaces its ring (a larger
batch came), slots of the old ring still in flight are dropped on release, not
mixed into the new one.  A pass that is cut short (``break``) never returns the
slots of the batches it had in flight; when the ring runs dry for that reason
it makes a new slot rather than fail (the lost ones are freed with their
batches).

Debugging: with ``SlotRing.poison`` set to a byte (or ``ASYNCFEED_DEBUG_POISON``
in the environment: ``1`` for 0xA5, or a number 0-255), every slot is filled
with that byte when it is handed out, after its previous copy has finished, so
a row that no sample wrote shows as the pattern instead of an earlier batch's
data.  Off by default; it costs one memset of the slot per batch.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from typing import Any

import torch

from .layout import Layout

DEFAULT_POISON = 0xA5


def poison_from_env(value: str | None = None) -> int | None:
    """The poison byte ``ASYNCFEED_DEBUG_POISON`` asks for (None: off)."""
    value = os.environ.get("ASYNCFEED_DEBUG_POISON", "") if value is None else value
    value = value.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    if value in ("1", "true", "yes", "on"):
        return DEFAULT_POISON
    try:
        byte = int(value, 0)
    except ValueError:
        raise ValueError(f"ASYNCFEED_DEBUG_POISON must be 1 or a byte value, got {value!r}") \
            from None
    if not 0 <= byte <= 255:
        raise ValueError(f"ASYNCFEED_DEBUG_POISON must be in 0..255, got {byte}")
    return byte


def fill_poison(bufs: list[Any], byte: int) -> None:
    """Overwrite every buffer of a slot with ``byte`` (list leaves get None)."""
    for buf in bufs:
        if isinstance(buf, torch.Tensor):
            flat = buf.view(-1)
            if buf.dtype == torch.bool:
                flat.fill_(bool(byte))   # a bool must stay 0 or 1
            else:
                flat.view(torch.uint8).fill_(byte)
        elif isinstance(buf, list):
            buf[:] = [None] * len(buf)


def _poison_at_import() -> int | None:
    try:
        return poison_from_env()
    except ValueError as e:  # a debugging switch must not break the import
        warnings.warn(f"{e}; slot poisoning stays off", stacklevel=2)
        return None


class Slot:
    __slots__ = ("bufs", "event", "ring", "free")

    def __init__(self, bufs: list[Any], ring: SlotRing | None = None) -> None:
        self.bufs = bufs
        self.event: Any = None    # torch.cuda.Event (or anything with query/synchronize)
        self.ring = ring
        self.free = True


class SlotRing:
    """``count`` slots of ``rows`` samples each, in pinned host memory.

    ``pin=None`` pins when CUDA is available (unpinned buffers otherwise, so the
    ring also works, unpinned, where there is no CUDA).
    """

    poison: int | None = _poison_at_import()

    def __init__(self, layout: Layout, rows: int, count: int, *, pin: bool | None = None) -> None:
        if count < 1:
            raise ValueError(f"a slot ring needs at least one slot, got count={count}")
        self.layout = layout
        self.rows = rows
        self.count = count
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._lock = threading.Lock()
        self._free: collections.deque[Slot] = collections.deque(
            self._new_slot() for _ in range(count))
        self.made = count     # slots made (more than count only after a pass was cut short)
        self.waits = 0        # acquires that had to wait for a copy to finish
        self.dropped = 0      # slots of another ring given back here (ignored)

    def _new_slot(self) -> Slot:
        return Slot(self.layout.allocate(self.rows, pin=self.pin), self)

    def acquire(self) -> Slot:
        """A free slot whose previous copy has finished.

        The caller bounds the slots in use (one per batch credit), so one is
        normally free.  The oldest free slot whose copy has completed is taken;
        if every free slot is still being copied (rare: it was handed out a full
        ring ago) this waits for the oldest, and counts it in ``waits``.
        """
        wait = False
        with self._lock:
            slot = None
            for s in self._free:
                if s.event is None or s.event.query():
                    slot = s
                    break
            if slot is not None:
                self._free.remove(slot)
            elif self._free:
                slot = self._free.popleft()
                wait = True
            else:
                slot = self._new_slot()
                self.made += 1
            slot.free = False
        if wait:
            self.waits += 1
            slot.event.synchronize()
        slot.event = None
        if self.poison is not None:
            fill_poison(slot.bufs, self.poison)
        return slot

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back; its ``event`` (if any) must be set to the event recorded
        after its last copy.  A slot of another ring is dropped."""
        if slot.ring is not self:
            self.dropped += 1
            return
        with self._lock:
            if slot.free:
                raise RuntimeError("a batch slot was released twice (two batches would "
                                   "share its memory)")
            slot.free = True
            self._free.append(slot)

    def free_slots(self) -> int:
        return len(self._free)

    def fits(self, layout: Layout, rows: int) -> bool:
        return layout is self.layout and rows <= self.rows
