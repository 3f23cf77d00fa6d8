"""A busy neighbour: one process that loops in Python on a core, as another job on a
shared machine does, for the benches that measure beside one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["busy_neighbour"]

#: the neighbour's program (tests find a leftover one by it)
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_neighbour(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """Run one busy-looping process for the ``with`` block (None, and nothing run,
    where ``enabled`` is false).  It is killed and reaped when the block ends, by an
    exception or an interrupt too."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if enabled else None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
