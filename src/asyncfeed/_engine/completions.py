"""What a pass has completed, as the execution chooser reads it.

The chooser's windows run from one reported completion to another (see
``chooser``): rows arrive in chunks (a task's run of rows, a worker's reply),
and a window cut between two chunks would count a share of one.  Where a
pass's reads run on the event loop, a batch's reads go out together as it is
planned: such a pass works in cycles a batch long (a burst of reads, then the
batch's decodes), and a window cut inside a cycle reads the burst or misses it
-- a spread between like windows that no real lead could beat.  Its readings
are then taken at batch completions only, so every window spans whole cycles.
"""

from __future__ import annotations

import time

__all__ = ["Completions"]


class Completions:
    """Rows loaded or failed so far, the reports (tasks, worker replies) that
    carried them, and when the last came in (``time.perf_counter()``).

    ``per_batch``: :meth:`reading` gives the counts as they stood when the last
    batch completed, not at the last report.  Not locked: the pass counts under
    its own lock; a reading is one tuple, taken whole."""

    def __init__(self, per_batch: bool) -> None:
        self.rows = 0
        self.reports = 0
        self.last = 0.0
        self.per_batch = per_batch
        self._at_batch = (0, 0, 0.0)

    def count(self, rows: int, batch_done: bool) -> None:
        """One report of ``rows`` rows; ``batch_done``: they completed their batch."""
        self.rows += rows
        self.reports += 1
        self.last = time.perf_counter()
        if batch_done:
            self._at_batch = (self.rows, self.reports, self.last)

    def reading(self) -> tuple[int, int, float]:
        """(rows, reports, time of the last) for the chooser (see ``per_batch``)."""
        if self.per_batch:
            return self._at_batch
        return self.rows, self.reports, self.last
