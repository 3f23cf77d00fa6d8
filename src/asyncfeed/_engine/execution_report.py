"""What ``stats().execution`` says: where a loader's samples run, and why.

Made by the chooser from its record and decision (:mod:`.policy`); data, with a
sentence for ``str()``.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

from .policy import Candidate, Mode, Reason, Record


@dataclass(frozen=True)
class ThreadScaling:
    """Two thread counts measured in one pass and their rates (rows/s): ``more``
    threads ran the rows ``more / fewer`` times as fast as ``fewer``, within the
    noise margin (:meth:`ExecutionReport.threads_scaled`)."""

    fewer: int
    fewer_rate: float
    more: int
    more_rate: float


@dataclass(frozen=True)
class Measured:
    """A candidate's windows in the record: their count and mean rate (rows/s)."""

    candidate: Candidate
    windows: int
    rate: float



#: why rows run where the consumer's thread runs them (the reason, or the threads left out)
_BOUND = ("the data set's rows failed in decode threads and loaded in the consumer's "
          "thread: it uses what only that thread may (an object bound to the thread that "
          "made it, such as a sqlite3 connection, or signal handlers)")


@dataclass(frozen=True)
class ExecutionReport:
    """Where a loader's samples run, and why (``stats().execution``).

    ``mode`` and ``count``: the current choice (threads or worker processes and
    their number; 0 for inline).  ``reason``: why it runs (:class:`Reason`).
    ``candidates``: every candidate measured, with its windows and mean rate
    (rows/s).  ``margin``: the noise margin of the last duel.  ``processes_skipped``:
    why processes were not measured, if they were not.  ``detail``: what went
    wrong, where something did (the process stage could not start or stopped).
    ``inline_skipped``: why inline was not measured (``NO_ROOM``: processes won by
    more than one core's rate of the rows), if it was not.  ``threads_skipped``:
    why more threads were not measured (``NO_ROOM``: the rows already ran at the
    cores' rate), if they were not.  ``processes_first``: processes were dueled
    first, the start's threads having run the rows one at a time.
    ``inline_before_threads``: inline was dueled before the thread ladder, for the
    same reason.
    ``processes_before_up``: processes were dueled before more threads, one
    thread having beaten the threads at the cores, or its rows having never
    waited where more threads would be more than the cores.  ``processes_before_down``:
    processes were dueled before fewer threads, the start's threads having run the
    rows short of their count times one thread's rate.  ``more_processes_skipped``: why
    twice the workers were not measured where processes were (``NO_ROOM``: their
    workers kept busy every core they could have), if they were not.
    ``thread_bound``: the data set's rows failed in decode threads and loaded in
    the consumer's thread (it uses what only that thread may): the candidates
    measured since are those that run rows there or in worker processes forked
    from it.  ``str()`` is a sentence."""

    mode: Mode
    count: int
    reason: Reason
    candidates: tuple[Measured, ...] = ()
    margin: float = 0.0
    processes_skipped: Reason | None = None
    detail: str = ""
    inline_skipped: Reason | None = None
    threads_skipped: Reason | None = None
    processes_first: bool = False
    inline_before_threads: bool = False
    processes_before_up: bool = False
    processes_before_down: bool = False
    more_processes_skipped: Reason | None = None
    thread_bound: bool = False

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.mode, self.count)

    def threads_scaled(self) -> ThreadScaling | None:
        """Where the choice is the most threads measured and it ran the rows as many
        times as fast as the next fewer threads measured as it has times their count,
        within the margin: those two readings (else None).  Threads that scale so
        were not held back by the GIL: rows that wait (on storage, the network, a
        lock) overlap their waits, and more threads would overlap more."""
        if self.mode is not Mode.THREADS:
            return None
        counts = {m.candidate.count: m.rate for m in self.candidates
                  if m.candidate.mode is Mode.THREADS}
        fewer = [n for n in counts if n < self.count]
        if self.count not in counts or max(counts) != self.count or not fewer:
            return None
        m = max(fewer)
        more_rate, fewer_rate = counts[self.count], counts[m]
        if more_rate * (1 + self.margin) < fewer_rate * self.count / m:
            return None
        return ThreadScaling(m, fewer_rate, self.count, more_rate)

    def __str__(self) -> str:
        c = self.candidate
        head = f"{self.mode.value}: {c}" if self.mode is not Mode.INLINE \
            else "inline: the consumer loads the rows while it waits"
        rates = {m.candidate: m.rate for m in self.candidates}
        why = {
            Reason.FIXED: "chosen by the loader's arguments",
            Reason.ONLY: "the only candidate",
            Reason.EXPLORING: "measuring the candidates",
            Reason.FASTER: f"measured faster than the cheaper candidates by more than "
                           f"the {self.margin:.0%} noise margin",
            Reason.CHEAPER: f"no dearer candidate beat it by more than the "
                            f"{self.margin:.0%} noise margin",
            Reason.NO_ROOM: "processes cannot beat it",
            Reason.HANDOFF: "processes cannot beat it",
            Reason.CONSUMER: "it keeps up with the consumer",
            Reason.UNAVAILABLE: "worker processes could not start",
            Reason.THREAD_BOUND: _BOUND,
        }[self.reason]
        parts = [why]
        if self.thread_bound and self.reason is not Reason.THREAD_BOUND:
            parts.append("threads left out: " + _BOUND)
        if rates:
            parts.append("measured " + ", ".join(
                f"{k}: {v:,.0f} rows/s" for k, v in sorted(rates.items(),
                                                           key=lambda kv: kv[0].cost)))
        if self.processes_first:
            parts.append("processes tried first: the threads ran the rows one at a time")
        if self.inline_before_threads:
            parts.append("inline tried before fewer threads: the threads ran the rows one "
                         "at a time")
        if self.processes_before_up:
            parts.append("processes tried before more threads: one thread beat the "
                         "threads at the cores, or its rows never waited, or the threads "
                         "fell short of scaling from it with the process busy")
        if self.processes_before_down:
            parts.append("processes tried before fewer threads: the threads ran the rows "
                         "short of their count times one thread's rate")
        if self.processes_skipped is Reason.NO_ROOM:
            parts.append("processes not tried: the rows' measured rate per core times the "
                         "cores left to them leaves them no room")
        elif self.processes_skipped is Reason.HANDOFF:
            parts.append("processes not tried: sending each row back from a worker "
                         "process costs more than they could gain")
        elif self.processes_skipped is Reason.CONSUMER:
            parts.append("nothing dearer tried: the consumer takes batches no faster")
        elif self.processes_skipped is Reason.UNAVAILABLE:
            parts.append("processes unavailable: they could not start, or stopped")
        if self.threads_skipped is Reason.NO_ROOM:
            parts.append("more threads not tried: the rows already ran at every core's "
                         "rate")
        if self.more_processes_skipped is Reason.NO_ROOM:
            parts.append("more worker processes not tried: the workers kept every "
                         "core they could have busy")
        if self.inline_skipped is Reason.NO_ROOM:
            parts.append("inline not tried: the choice runs the rows beyond one core's "
                         "rate of them")
        if self.detail:
            parts.append(self.detail)
        return f"{head} ({'; '.join(parts)})"


def measured(record: Record) -> tuple[Measured, ...]:
    """Every candidate of ``record`` with its window count and mean rate."""
    by: dict[Candidate, list[float]] = collections.defaultdict(list)
    for w in record.windows:
        by[w.candidate].append(w.rate)
    return tuple(Measured(c, len(r), statistics.fmean(r))
                 for c, r in sorted(by.items(), key=lambda kv: kv[0].cost))
