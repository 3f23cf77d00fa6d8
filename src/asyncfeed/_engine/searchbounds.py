"""The bounds a search reads from its windows: what a dearer candidate could
deliver at most, so that a duel it cannot win by the margin is not run.

:class:`SearchBounds` is the part of the policy's replay (``policy._Replay``)
that reads them: the rows per CPU second of thread windows, the cores left to
worker processes, one thread's rate, and whether the choice already reaches a
bound within the margin; and what the windows show of how threads ran the rows
(one at a time, held back, waiting), which orders the search.  Each is measured
on the pass; none assumes a core count.
"""

from __future__ import annotations

import statistics

from .bounds import handoff_bound, row_cpu, workers_core_rate
from .duel import PolicyConfig
from .readings import Candidate, Handoff, Mode, Space, Window, pooled_cores, rows_and_cpu

__all__ = ["SearchBounds"]


class SearchBounds:
    """The bounds of the module docstring, over a search's state (set by the
    replay that subclasses it)."""

    space: Space
    config: PolicyConfig
    handoff: Handoff | None
    choice: Candidate
    choice_rate: float | None
    margin: float
    solo: list[Window]
    seen: list[Window]
    fresh: list[Window]

    def _keeps_up(self) -> bool:
        """Whether the choice already delivers what the consumer takes: its windows'
        ceiling (the consumer's pace had it never waited) within the margin of its
        rate.  No dearer candidate can then beat it by the margin."""
        mine = [w for w in self.seen if w.candidate == self.choice]
        if len(mine) < self.config.like_windows or self.choice_rate is None:
            return False
        ceiling = statistics.fmean(w.ceiling for w in mine) \
            if all(w.ceiling != float("inf") for w in mine) else float("inf")
        return ceiling <= self.choice_rate * (1 + self._margin())

    def _margin(self) -> float:
        """The margin a bound must be beaten by: the last duel's, at least the floor."""
        return max(self.margin, self.config.min_margin)

    def _core_rate(self, of: Candidate | None = None) -> float:
        """Rows per CPU second over the thread windows of this search together (those
        of ``of`` alone where given; 0: none knows its CPU): what one core runs the
        rows at.  Pooled, not window by window: a window's CPU is that of the tasks
        that ended in it, so a short window reads a task more or less than it ran,
        and the most of many such readings would be their noise.  Of the choice's
        threads: what a core runs the rows at with those threads side by side
        (cores that share caches, memory and their siblings' pipelines run each row
        slower than one alone, and so would as many worker processes).  Of inline:
        what the consumer's thread runs them at, with no task hand-off (a worker's
        row costs at least that).  0 where ``of`` is processes."""
        windows = self.fresh if of is None else [w for w in self.fresh if w.candidate == of]
        rows, cpu = rows_and_cpu(windows, inline=of is not None and of.mode is Mode.INLINE)
        return rows / cpu if cpu > 0 else 0.0

    def _beyond_one_core(self) -> bool:
        """Whether the choice's rate is beyond what one core can run the rows at,
        plus the margin: the most rows per CPU second any one thread window read,
        or worker processes read (their rows pooled over their CPU less the
        pickling of the rows they send back, ``Record.handoff``: a worker runs its
        rows on one thread, sharing no GIL, and inline sends nothing back),
        whichever is more.  Inline runs the rows on the consumer's thread alone
        (with its own work besides), so it cannot reach that rate.  The most of the
        windows, not their pooled rate (:meth:`_core_rate`).  Each reading counts
        what inline does not pay (a thread's task hand-off, the turns threads took
        at the GIL, a worker's reading of its tasks), so the bound reads low, the
        more so for tiny rows, and skips inline only where the choice is beyond
        it by the margin.  False where no window knows its rows' CPU."""
        per_core = max((w.core_rate for w in self.fresh if w.candidate.mode is Mode.THREADS),
                       default=0.0)
        per_core = max(per_core, workers_core_rate(
            [w for w in self.fresh if w.candidate.mode is Mode.PROCESSES],
            self.handoff.pickle_s if self.handoff is not None else 0.0))
        if not per_core or self.choice_rate is None:
            return False
        return self.choice_rate > per_core * (1 + self._margin())

    def _beyond_reach(self, more: Candidate, base: Candidate) -> bool:
        """Whether ``more`` threads cannot beat the choice by the margin: one process's
        threads run the rows on at most ``min(threads, cores left)`` cores (what the
        consumer and the hand-offs keep busy stays theirs: :meth:`_cores_left`),
        each at most at :meth:`_core_rate` of the windows of ``base``, the thread
        count the climb steps up from (the choice, or the thread choice that
        processes beat; of every thread window where those do not know their CPU).
        Where the choice's rate is within the margin of that bound, the rows already
        take every core they can have.
        False where no thread window knows its CPU (rows that wait on storage use
        little CPU: the bound is far above them)."""
        per_core = self._core_rate(base) or self._core_rate()
        if not per_core or self.choice_rate is None:
            return False
        return self._reaches(min(more.count, self._cores_left()) * per_core)

    def _scales(self, rate: float, threads: int, one: float, margin: float) -> bool:
        """Whether ``threads`` threads reading ``rate`` scaled from one thread's rate
        ``one``: within ``margin`` of ``min(threads, cores left)`` times it."""
        return rate * (1 + margin) >= min(float(threads), self._cores_left()) * one

    def _reaches(self, bound: float) -> bool:
        """Whether the choice's rate is within the margin of ``bound``, the most a
        dearer candidate could deliver: it cannot beat the choice by the margin."""
        return (self.choice_rate or 0.0) * (1 + self._margin()) >= bound

    def _cores_left(self) -> float:
        """The cores worker processes could have: the cores, less what this process
        kept busy besides the rows under the choice (the consumer's own work, the
        hand-offs: it goes on under processes too, and grows with their rate, so
        this is an upper bound).  The cores where the choice's windows do not
        know their CPU."""
        def other_of(windows: list[Window]) -> list[float]:
            return [w.other_cores for w in windows
                    if w.candidate == self.choice and w.other_cores > 0]
        # a re-check's first duels come before the choice ran a window of its own:
        # then its windows of the searches before tell
        other = other_of(self.fresh) or other_of(self.seen)
        if not other:
            return float(self.space.cores)
        return max(1.0, self.space.cores - statistics.median(other))

    def _one_thread_rate(self) -> float | None:
        rates = [w.rate for w in self.solo]
        return statistics.fmean(rates) if rates else None

    def _handoff_bound(self) -> float:
        """The hand-off's bound on processes (:func:`.bounds.handoff_bound`) for the
        rows' CPU in this process and the cores left."""
        return handoff_bound(self.handoff, row_cpu(self.fresh, self.seen), self._cores_left())

    def _start_held_back(self) -> bool:
        """Whether the start's threads, having won the bottom duel, ran the rows short
        of their reach from one thread's rate (``min(threads, cores left)`` times
        it, beyond the margin) while the process kept at least a core busy under
        them (within ``min_margin``): something the threads share held them back
        -- the GIL, held by the rows or the consumer's Python, or the cores'
        shared caches -- not storage, whose waits leave the process idle and which
        more threads overlap.  More threads cannot beat that; processes, which do
        not share a GIL, may.  False where the windows do not know their CPU."""
        mine = [w for w in self.fresh if w.candidate == self.choice]
        cores = pooled_cores(mine, whole=True)
        return cores is not None and cores[1] >= 1 - self.config.min_margin \
            and self._short_of_reach()

    def _short_of_reach(self) -> bool:
        """Whether the choice's threads ran the rows short of their reach from one
        thread's rate: below ``min(threads, cores left)`` times it, beyond the
        margin.  False where one thread's rate was not read."""
        solo = self._one_thread_rate()
        return solo is not None and not self._scales(
            self.choice_rate or 0.0, self.choice.count, solo, self._margin())

    def _solo_never_waited(self) -> bool | None:
        """Whether one thread's windows kept the process a core busy, within
        ``min_margin``: the rows, or the rows and the process's own Python between
        them (the consumer's collating, the loop: the thread then waited for the
        GIL, not for storage; the process's clock, coarser than the rows', may read
        below theirs).  None where they do not know their CPU."""
        rows, whole = pooled_cores(self.solo, whole=False), pooled_cores(self.solo, whole=True)
        if rows is None:
            return None
        return max(rows[0], whole[1] if whole else 0.0) >= 1 - self.config.min_margin

    def _serialised(self, windows: list[Window]) -> bool:
        """Whether threads ran the rows of ``windows`` one at a time: the rows took no
        more than one core (within ``min_margin``), or the whole process took no more
        (the rows' CPU is that of the tasks that ended in the windows, so with many
        threads it reads up to a task each more or less than they ran; the process's
        is read over the windows themselves), while the whole process took at least
        one.  False where the CPU is not known."""
        cores = pooled_cores(windows, whole=True)
        if cores is None:
            return False
        m = self.config.min_margin
        return min(cores) <= 1 + m and cores[1] >= 1 - m
