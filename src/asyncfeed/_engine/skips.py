"""Samples skipped under ``on_error="skip"``: recorded as data, logged for humans.

A :class:`SkipLog` belongs to one loader, across its passes: each skipped sample
becomes a :class:`~asyncfeed.SkippedSample` (``stats().skipped``) and a
rate-limited warning on the ``"asyncfeed"`` logger.
"""

from __future__ import annotations

from typing import Any

from .._errors import SampleError, describe, is_fatal
from .batch import Batch, sample_error
from .stats import RateLimitedLog, SkippedSample


def _first_line(e: BaseException) -> str:
    """The message of a rebuilt error without its traceback (for the skip log)."""
    return str(e).split("\n", 1)[0] if isinstance(e, SampleError) else describe(e)


class SkipLog:
    """The skipped samples of one loader: ``entries`` in the order they were
    skipped, ``count`` of them; each also logged (the first ten, then every
    power of ten)."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self.entries: list[SkippedSample] = []
        self._log = RateLimitedLog()

    @property
    def count(self) -> int:
        """How many samples were skipped."""
        return len(self.entries)

    def record(self, b: Batch, epoch: int) -> None:
        """Record ``b``'s failed samples as skipped in ``epoch``, in row order.

        Raises a KeyboardInterrupt or SystemExit among them as it is (never
        skipped).  The exceptions are dropped from ``b.failures`` afterwards (the
        rows that failed stay): an exception's traceback holds the frames that
        held ``b``, a cycle that would keep the batch's buffers from the host pool
        until a garbage collection.  A failure already recorded is not again.
        """
        for _, _, e in b.failures:
            if e is not None and is_fatal(e):
                raise e
        for _, idx, e in sorted(b.failures, key=lambda f: f[0]):
            if e is None:
                continue  # recorded already
            err = sample_error(self._dataset, idx, e, b.k)
            source = err.source if isinstance(err, SampleError) else None
            cause = err.cause if isinstance(err, SampleError) and err.cause is not None else e
            self.entries.append(SkippedSample(index=idx, source=source, error=describe(cause),
                                              epoch=epoch, batch=b.k,
                                              error_type=type(cause).__name__))
            self._log.warning(f"skipped {_first_line(err)}")
            del err, cause
        b.failures = [(row, idx, None) for row, idx, _ in b.failures]
