"""Counters a loader keeps, and a logger that does not flood on repeated failures."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("asyncfeed")


@dataclass(frozen=True)
class SkippedSample:
    """One sample dropped under ``on_error="skip"``."""

    index: object
    source: str | None
    error: str
    epoch: int
    batch: int | None = None


@dataclass
class IOStats:
    """Reads on the event loop (``AsyncLoader.stats().io``).

    From the dataset's source, over its lifetime: ``attempts`` (requests sent),
    ``hedges`` (extra requests sent by hedging; ``hedges / attempts`` stays under
    the source's ``hedge_budget``), ``hedge_wins``, ``stalls`` (attempts abandoned
    by the adaptive timeout), ``retries``.  From the read-ahead of the last pass:
    ``readahead_reads``, ``readahead_peak_bytes`` (the most bytes held by finished
    reads waiting for decoding) and ``readahead_budget`` (its byte budget).
    """

    attempts: int = 0
    hedges: int = 0
    hedge_wins: int = 0
    stalls: int = 0
    retries: int = 0
    readahead_reads: int = 0
    readahead_peak_bytes: int = 0
    readahead_budget: int = 0


@dataclass
class LoaderStats:
    """A snapshot of what a loader has done (``AsyncLoader.stats()``).

    ``wait_s`` is the time the consumer spent blocked in ``next()`` waiting for a
    batch (the stall the loader caused), ``batches``/``samples`` count what was
    handed out, ``skipped`` lists every sample dropped under ``on_error="skip"``,
    ``path`` says how batches were built (``"ring"``: decoded straight into batch
    slots; ``"collate"``: per-sample objects collated; ``"batch"``:
    ``__getitems__``; ``"iterable"``), ``slot_waits`` counts times a pinned slot
    was still being copied when it was needed again, ``execution`` says how
    samples were loaded and why (``"threads: 1 of 4 running (adaptive)"``: the
    measured rate chose one running decode thread; ``"threads: 8 (pinned)"``:
    ``num_threads`` was given), ``io`` counts reads on the event loop
    (:class:`IOStats`; None when reads run in the decode threads).
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    slot_waits: int = 0
    path: str = ""
    skipped: list[SkippedSample] = field(default_factory=list)
    execution: str = ""
    io: IOStats | None = None


class RateLimitedLog:
    """Logs the first ``burst`` events, then only the 10th, 100th, 1000th... with a count."""

    def __init__(self, burst: int = 10) -> None:
        self._burst = burst
        self._count = 0
        self._next = burst * 10
        self._lock = threading.Lock()

    def warning(self, msg: str) -> None:
        with self._lock:
            self._count += 1
            n = self._count
            if n <= self._burst:
                pass
            elif n >= self._next:
                self._next *= 10
                msg = f"{msg} ({n} samples skipped so far; logging fewer of them)"
            else:
                return
        log.warning(msg)
