"""The interpreter's garbage collections: the oldest generation's counted, and the
rows a thread may hold before it writes them.

A full collection stops every thread of the process that runs Python for as long
as it walks the heap: about 85 ms over the 176k objects ``import torch`` leaves
tracked, on one core here (``gc.get_objects()``; a ``DataLoader(num_workers=0)``
epoch of ``TensorDataset`` rows ran one or two of them).  It lands in whichever
window of the execution choice happens to be open, and reads as that candidate's
slowness, though the candidates that run the rows in this process (inline,
threads) pay it alike; :class:`.chooser.Chooser` reads a window that saw one
again (see there).  Worker processes make the rows' objects in their own
processes, so this process collects far less under them: reading the window
again leaves that out of their duel with inline or threads (see
``docs/architecture.md``).

:func:`count` installs one ``gc.callbacks`` entry the first time it is called and
keeps it for the life of the process (a counter, no references held).

:func:`rows_held` bounds the rows a row task loads before it writes them into the
batch's buffers and lets go of them.  Every object of a type the collector tracks
adds one to the young generation's count while it lives; past the threshold
(``gc.get_threshold()[0]``) a young collection runs, and the objects alive then
move to an older generation, and from there, over many collections, to the
oldest, whose growth triggers the full collections above.  A batch of 256
``TensorDataset`` rows held until one write holds 768 such objects against the
threshold of 700: a young collection every batch, and two full collections an
epoch.  Written in runs of fewer rows, what a run holds dies before the count
reaches the threshold (``tests/engine/test_gcpauses.py`` counts the rows alive).
"""

from __future__ import annotations

import gc
import threading
from typing import Any

__all__ = ["count", "rows_held"]

_OLDEST = len(gc.get_threshold()) - 1   # the generations are numbered from 0
_count = 0
_installed = False
_lock = threading.Lock()


def _callback(phase: str, info: dict[str, Any]) -> None:
    global _count
    if phase == "stop" and info.get("generation") == _OLDEST:
        _count += 1   # the GIL is held here: no other thread adds at once


def count() -> int:
    """How many collections of the oldest generation this process finished since
    the first call (any thread, ``gc.collect()`` included)."""
    global _installed
    if not _installed:
        with _lock:
            if not _installed:
                gc.callbacks.append(_callback)
                _installed = True
    return _count


def rows_held(objects_per_row: int, rows: int) -> int:
    """How many of ``rows`` loaded rows, each with ``objects_per_row`` objects the
    collector counts, a thread may hold before it writes them: what keeps them
    within half the young generation's threshold (the other half is left for
    what the process allocates meanwhile), at least one row, evened out over the
    runs ``rows`` then takes; all of ``rows`` when automatic collection is off or
    the rows hold no such object."""
    young = gc.get_threshold()[0]
    if rows <= 0 or objects_per_row <= 0 or young <= 0 or not gc.isenabled():
        return rows
    most = max(1, young // (2 * objects_per_row))
    runs = -(-rows // most)
    return -(-rows // runs)
