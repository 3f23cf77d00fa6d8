"""Counters a loader keeps, and a logger that does not flood on repeated failures."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._io.hedge import CountsReads
from .accounting import Accounting, Analysis, Snapshot, StageStats, analyse
from .advice import DatasetKnobs, dataset_knobs, explain, with_outcome
from .execution_report import ExecutionReport
from .readahead import ReadAheadStats

log = logging.getLogger("asyncfeed")


@dataclass(frozen=True)
class SkippedSample:
    """One sample dropped under ``on_error="skip"``.

    ``index``: the sample's index; ``source``: its path or URL where the dataset
    names one; ``error``: ``"Type: message"`` of what it raised; ``error_type``:
    that exception's class name; ``epoch`` and ``batch``: where it was skipped.
    """

    index: object
    source: str | None
    error: str
    epoch: int
    batch: int | None = None
    error_type: str = ""


@dataclass
class IOStats:
    """Reads on the event loop (``AsyncLoader.stats().io``).

    From the dataset's source, over its lifetime: ``attempts`` (requests sent),
    ``hedges`` (extra requests sent by hedging; at most the source's
    ``hedge_budget``, 5%, of the reads: ``attempts - hedges - retries``), ``hedge_wins``, ``stalls`` (attempts abandoned
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
    was still being copied when it was needed again, ``execution`` says where
    samples are loaded and why (:class:`~asyncfeed.ExecutionReport`: the mode,
    ``"inline"``, ``"threads"`` or ``"processes"``, the thread or worker count, the
    candidates measured with their rates, a reason code; its ``str()`` is a
    sentence), ``io`` counts reads on the event loop
    (:class:`IOStats`; None when reads run in the decode threads).

    Where the time of the current (or last) pass went (``docs/observability.md``):

    ``stages`` maps each stage, ``"fetch"`` (reads: awaited on the event loop,
    or blocking ``read`` calls in a decode thread), ``"decode"`` (the
    per-sample function: ``__getitem__``, ``decode``/``decode_into``, an
    iterable's ``next``), ``"assemble"`` (row writes, collate, starting the
    copy), ``"h2d"`` (the copy stream's busy time, from CUDA events; empty
    without a GPU) and ``"queue"`` (finished batches waiting for the consumer),
    to a :class:`StageStats`: ``count`` (samples; batches for assemble, h2d and
    queue), ``wall_s`` (seconds in the stage, summed over samples and threads)
    and ``cpu_s`` (thread CPU time, None where not measured).

    ``gil_share`` (0..1) estimates the share of the decode threads' busy time
    (``decode`` and ``assemble`` stages) spent runnable but not running Python
    for want of the GIL: the threads' wall time minus their CPU time (time not
    running), less their wait for a core (``/proc`` schedstat) and what a
    hypervisor stole, scaled by the process's CPU rate in cores where that is
    under one (a thread waits for the GIL only while another runs).  A probe
    thread that wakes about 10 times a second and times how long it waits to
    take the GIL back gives the GIL's pressure: the share of its wake-ups that
    found the GIL held.  Where it is wrong: with one decode thread the share
    reads near 0 however much Python runs (nothing contends; the pressure sees
    it); time blocked in I/O inside ``__getitem__`` reads as GIL (the verdict
    heeds the pass's measured outcome there, below); a GIL held by C code that
    does not release it counts as GIL, rightly, but is not Python; on a machine
    whose cores other processes keep busy, GIL-free work reads somewhat high
    (preempted GIL holders) and GIL-bound work low (threads woken for the GIL
    wait for a core).  ``docs/observability.md`` has the whole reading.

    ``bottleneck`` is one of ``"consumer"`` (the loader is ahead: the training
    step is the bottleneck), ``"fetch"``, ``"decode"``, ``"gil"`` or ``"h2d"``
    (None until a batch was delivered), over the whole pass so far: the same
    reading as :meth:`explain`, which says what to do about it, and as the
    progress bar's last word for the pass (its running postfix is a window's).
    It reads ``"decode"``, not ``"gil"``, where ``execution`` measured the chosen
    threads running the rows as many times as fast as the next fewer threads as
    they are times as many, within the margin (``ExecutionReport.threads_scaled``):
    threads held back by the GIL do not scale so; rows that wait do.
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    slot_waits: int = 0
    path: str = ""
    skipped: list[SkippedSample] = field(default_factory=list)
    execution: ExecutionReport | None = None
    io: IOStats | None = None
    stages: Mapping[str, StageStats] = field(default_factory=dict)
    gil_share: float = 0.0
    bottleneck: str | None = None
    _reading: tuple[Snapshot, Analysis] | None = field(default=None, repr=False,
                                                        compare=False)
    _knobs: DatasetKnobs | None = field(default=None, repr=False, compare=False)

    def explain(self) -> str:
        """Two or three sentences on the bottleneck: what it means and which knob to turn
        (the data set's own argument where it is an ``ImageFolder``)."""
        if self._reading is None:
            return "No batch has been delivered yet: there is nothing to explain."
        return explain(*self._reading, self._knobs, execution=self.execution)


def io_stats(dataset: Any, readahead: ReadAheadStats | None) -> IOStats:
    """``stats().io`` of a loader reading on the event loop: the source's read
    counts (a dataset that counts its reads) and the last pass's read-ahead."""
    io = IOStats()
    if isinstance(dataset, CountsReads):
        counts = dataset.read_stats()
        for name in ("attempts", "hedges", "hedge_wins", "stalls", "retries"):
            setattr(io, name, int(getattr(counts, name, 0)))
    if readahead is not None:
        io.readahead_reads, io.readahead_peak_bytes = readahead.reads, readahead.peak_bytes
        io.readahead_budget = readahead.budget
    return io


def observe(acct: Accounting | None, cores: int, dataset: Any = None,
            execution: ExecutionReport | None = None) -> dict[str, Any]:
    """The observability fields of :class:`LoaderStats` for a pass's accounting
    (``dataset``: the loader's, whose own knobs the advice then names;
    ``execution``: what the loader measured, which the verdict heeds, see
    :func:`~.advice.with_outcome`)."""
    if acct is None:
        return {}
    snap = acct.snapshot()
    a = with_outcome(analyse(snap, cores), execution)
    return {"stages": dict(snap.stages), "gil_share": a.gil_share,
            "bottleneck": a.bottleneck, "_reading": (snap, a) if a.bottleneck else None,
            "_knobs": dataset_knobs(dataset)}


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
