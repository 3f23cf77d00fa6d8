"""The interpreter's collections of its oldest generation, counted.

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
"""

from __future__ import annotations

import gc
import threading
from typing import Any

__all__ = ["count"]

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
