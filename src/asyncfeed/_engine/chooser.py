"""The loader's execution choice, driven on the real pass (see :mod:`.policy`).

A :class:`Chooser` belongs to the loader and outlives its passes: the choice it
settles on carries over to the next pass.  Each map-style pass binds it to an
:class:`ExecutionControl` (the pipeline): the one interface through which the
chooser reads the pass (rows and completions so far) and applies a candidate.

Ticks come from the consumer's thread only (each ``next()`` and while it
waits for a batch), so applying a candidate (forking the worker processes
included) happens there, never in a decode thread.  A tick that closes a
window costs a clock read and a few comparisons; a settled choice with
nothing to re-check costs less.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple, Protocol

from .execution_report import ExecutionReport, measured
from .policy import (INLINE, Candidate, Decision, Handoff, Mode, PolicyConfig, Reason,
                     Record, Space, Window, decide, drifted, fixed)

log = logging.getLogger("asyncfeed")

#: how often a settled consumer that waits for a batch ticks (seconds): it only
#: closes windows for the drift check
SETTLED_TICK_S = 0.25


class ExecutionControl(Protocol):
    """What a pass offers the chooser."""

    def completed(self) -> tuple[int, int, float]:
        """(rows, completions, time of the last completion) of the pass so far:
        every row loaded or failed, the tasks or worker replies that reported
        them, and when the last did (the chooser's clock); a pass whose work
        comes in batch-long cycles reports them as they stood at its last batch
        completion (see ``completions``)."""
        ...

    def apply(self, candidate: Candidate) -> bool:
        """Run the pass's rows under ``candidate`` from now on (consumer thread).
        False when it cannot start now (the process stage did not start); the
        pass then goes on as before."""
        ...

    def call_waiting(self, fn: Callable[[], None]) -> None:
        """Have the consumer thread call ``fn`` as soon as it waits (any thread)."""
        ...

    def waited(self) -> float:
        """The consumer's wait for batches so far this pass (seconds)."""
        ...

    def rows_cpu(self) -> float:
        """CPU seconds the pass's rows took in this process's threads so far (rows run
        by worker processes add nothing): what one core's rate of the rows is."""
        ...

    def process_cpu(self) -> float:
        """CPU seconds this whole process has taken (every thread: the consumer's
        work, the loader's, the rows'), on any monotonic origin."""
        ...

    def workers_cpu(self) -> float:
        """CPU seconds worker processes took on the rows they sent back so far."""
        ...

    def running(self) -> int:
        """How many of the pass's tasks its decode threads run now, or will still
        start under the limit before the last ``apply``: the tasks running, or the
        places its threads hold at the gate, whichever is more (a thread keeps its
        place from task to task, and one waiting for a task when the limit went down
        takes one more before it leaves); 0 with none."""
        ...

    def full_collections(self) -> int:
        """How many collections of the oldest generation this process ran so far
        (:func:`.gcpauses.count`)."""
        ...

    def handoff(self, budget_s: float) -> Handoff | None:
        """What a row costs to travel back from a worker process (measured on rows
        the pass loaded, spending at most about ``budget_s`` of CPU on it;
        ``Handoff.IN_PLACE`` where workers write the pass's rows in place); None
        while not known (consumer thread)."""
        ...

    def draining(self) -> bool:
        """Whether rows started under an earlier candidate still run (a process
        stage left with tasks in hand): their replies compete with the candidate
        now running, so no window opens until they are in."""
        ...

    @property
    def primed(self) -> bool:
        """Past the pass's start: its rate is the pass's, not the credit filling."""
        ...


class _Mark(NamedTuple):
    """A pass's counters at a window's start (``at``: the completion's time), or what
    earlier passes added to the open window (``at``: their seconds)."""

    at: float = 0.0
    rows: int = 0
    events: int = 0
    waited: float = 0.0
    cpu: float = 0.0
    process_cpu: float = 0.0
    workers_cpu: float = 0.0
    collections: int = 0

    @classmethod
    def now(cls, control: ExecutionControl, rows: int, events: int, last: float) -> _Mark:
        """The counters of ``control``'s pass at its completion ``last``."""
        return cls(last, rows, events, control.waited(), control.rows_cpu(),
                   control.process_cpu(), control.workers_cpu(),
                   control.full_collections())

    def plus(self, start: _Mark, end: _Mark) -> _Mark:
        """These counters with what a pass added from ``start`` to ``end``."""
        return _Mark._make(c + e - s for c, s, e in zip(self, start, end))


class Chooser:
    """Measures candidates on the loader's passes and applies the decisions.

    ``space``: what may run (None with ``fixed``: the user's choice, nothing
    measured).  ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, space: Space | None, fixed_choice: Candidate | None = None,
                 fixed_reason: Reason = Reason.FIXED,
                 config: PolicyConfig = PolicyConfig(),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if space is None and fixed_choice is None:
            raise ValueError("a chooser needs a space or a fixed choice")
        self.space = space
        self.config = config
        self.record = Record()
        self._window_s = config.window_seconds()
        self._clock = clock
        self.decision: Decision = fixed(fixed_choice, fixed_reason) if fixed_choice is not None \
            else decide(self.record, space, config)  # type: ignore[arg-type]
        self.fixed = fixed_choice is not None
        self.current: Candidate = self.decision.run
        self.detail = ""
        # the bound pass, weakly: a pass dropped by its consumer must not live on here
        self._control_ref: Callable[[], ExecutionControl | None] = lambda: None
        # the open window: the pass's counters at its start, and what earlier passes
        # added to it: a window spans passes, so that epochs shorter than a window are
        # measured too
        self._w0: _Mark | None = None
        self._opens_after = -1  # a window opens at a completion past this count
        self._carried = _Mark()
        self._warmup = config.warmup_windows  # the loader's first windows: threads wake
        self._recent: collections.deque[float]
        self._baseline: list[float]
        self._since_check = self._check_wait = 0
        self._watch_anew(config.recheck_windows)
        # a candidate to run from the consumer's next tick, and the reason it is fixed
        # with (None: the search goes on from it, see ``without_threads``)
        self._requested: tuple[Candidate, Reason | None] | None = None
        # whether the data set is bound to the consumer's thread (its rows fail in
        # decode threads): None until a failed row was checked (see .threadbound)
        self.thread_bound: bool | None = None
        self._stalled = False  # the last window closed saw a full collection

    # ------------------------------------------------------------------ passes
    def begin_pass(self, control: ExecutionControl) -> None:
        """(consumer thread, at ``iter()``) Bind the pass and run the current
        candidate on it (one asked for since the last pass's last tick first); its
        first windows are not used (threads waking)."""
        self._control_ref = weakref.ref(control)
        self._w0 = None
        self._opens_after = -1
        if self._requested is not None:
            self._take_request()  # asked for after the last pass's last tick
        if not control.apply(self.current):  # (applying it again changes nothing)
            self._failed(self.current)

    def end_pass(self, control: ExecutionControl) -> None:
        """The pass of ``control`` is over: nothing more is read from it (idempotent;
        any thread: a pass that ends late leaves a later pass bound)."""
        if self._control is control:
            self._control_ref = lambda: None
            w0, self._w0 = self._w0, None
            if w0 is not None:
                self._carried = self._carried.plus(
                    w0, _Mark.now(control, *control.completed()))

    def request(self, candidate: Candidate, reason: Reason = Reason.FIXED) -> None:
        """Run ``candidate`` from now on, nothing measured any more (any thread; the
        consumer applies it the next time it waits or takes a batch), ``reason``
        then the report's.  For callers that know better than a measurement, and
        for tests that switch at a chosen moment."""
        self._ask(candidate, reason)

    def without_threads(self) -> None:
        """(any thread) The data set's rows fail in decode threads and load in the
        consumer's (see :mod:`.threadbound`): the thread rungs leave the space, and
        the search starts again, from nothing, among the candidates that run rows
        in the consumer's thread or in worker processes forked from it (inline,
        then processes), measured as any search is: the record's windows ran rows
        that failed.  Where only one of them may run, it runs, fixed, for
        :attr:`Reason.THREAD_BOUND`; where none may, nothing changes."""
        self.thread_bound = True
        sp = self.space
        if sp is None:
            return
        left = [c for c in self.here_candidates() if c.mode is not Mode.PROCESSES
                or self.record.failed_starts < self.config.start_attempts]
        if len(left) < 2:
            if left:
                self.request(left[0], Reason.THREAD_BOUND)
            return
        self.space = dataclasses.replace(sp, ladder=(), start=left[0])
        self.record = Record(handoff=self.record.handoff)
        self._watch_anew(self.config.recheck_windows)
        self.decision = decide(self.record, self.space, self.config)
        self._ask(self.decision.run, None)

    def here_candidates(self) -> list[Candidate]:
        """The candidates that run rows in the consumer's thread or in worker processes
        forked from it, cheaper first: inline where it may run, then the process
        candidate; none where the execution is fixed."""
        sp = self.space
        if sp is None or self.fixed:
            return []
        return ([INLINE] if sp.inline else []) + ([sp.process] if sp.process is not None
                                                  else [])

    def _ask(self, candidate: Candidate, reason: Reason | None) -> None:
        self._requested = (candidate, reason)
        control = self._control
        if control is not None:
            control.call_waiting(self._take_request)

    def _take_request(self) -> None:
        control = self._control
        req = self._requested
        if req is None or control is None:
            return  # (no pass bound: the next pass's start takes it)
        self._requested = None
        c, reason = req
        if reason is None:  # the search goes on from c: its windows are measured
            if c != self.current:
                self._switch(c)
            return
        if control.apply(c):
            self.current = c
            self.fixed = True
            self.decision = fixed(c, reason)
        elif self._requested is None:
            self._requested = req  # not now (the fork must wait): at a later tick

    def lost(self, fallback: Candidate) -> None:
        """(consumer thread) The process stage stopped taking work; the pass already
        runs ``fallback``.  Processes count as unavailable from now on."""
        if self.current.mode is not Mode.PROCESSES:
            return
        self.current = fallback
        self.record.failed_starts = max(self.record.failed_starts, self.config.start_attempts)
        if self.fixed or self.space is None:
            self.decision = dataclasses.replace(fixed(fallback),
                                                processes_skipped=Reason.UNAVAILABLE)
        else:
            self.decision = decide(self.record, self.space, self.config)
            if self.decision.run != fallback:
                self._switch(self.decision.run)

    @property
    def _control(self) -> ExecutionControl | None:
        return self._control_ref()

    @property
    def exploring(self) -> bool:
        return not self.decision.settled

    def wants_handoff(self) -> bool:
        """Whether a pass should keep a few rows for ``ExecutionControl.handoff``: the
        chooser measures, and has recorded no window yet (it reads the hand-off
        once, before its first)."""
        return not self.fixed and self.space is not None and not self.record.windows

    # ------------------------------------------------------------------- ticks
    def tick(self) -> float:
        """(consumer thread) Close the window if it is due and act on it.  Returns
        the seconds until the next tick is worth making.  Never raises: a failure
        here is logged and the current candidate stays, measured no more."""
        try:
            return self._tick()
        except Exception:  # noqa: BLE001 - the pass goes on as it runs now
            log.exception("the execution choice failed; %s stays", self.current)
            self.fixed = True
            return SETTLED_TICK_S

    def _tick(self) -> float:
        if self._requested is not None:
            self._take_request()
        control = self._control
        if control is None or self.fixed:
            return SETTLED_TICK_S
        if self.decision.settled and self.decision.choice_rate is None:
            return SETTLED_TICK_S  # nothing was measured against: nothing to drift from
        now = self._clock()
        rows, events, last = control.completed()
        w0 = self._w0
        if w0 is None:  # the pass's first completion once primed opens its first window
            self._w0 = _Mark.now(control, rows, events, last) \
                if events > max(0, self._opens_after) and control.primed \
                and not control.draining() else None
            return self._window_s / 4
        if events == w0.events:
            return self._window_s / 4
        # from one completion to another: rows arrive in chunks (a task, a worker's
        # reply), and a window cut between chunks would count a share of one; the
        # other tasks running at once are partway through theirs at either end, up to
        # a chunk each, so a window sees ``window_events`` completions for each
        c = self._carried
        elapsed = c.at + last - w0.at
        tasks = max(1, self.current.count)
        # a window not used (threads waking, a fork and its first replies) lasts until
        # each task running at once could have completed once and the least window
        # passed, not as long as a reading, which on many cores is many tasks each,
        # nor as long as a duel's later rounds read (``window_scale``): what it waits
        # out is the switch, which takes as long in any round
        if self._warmup > 0:
            span, least = self._window_s, tasks
        else:
            scale = self.decision.window_scale
            span, least = self._window_s * scale, self.config.window_events * tasks * scale
        if elapsed < span or c.events + events - w0.events < least:
            return max(span - elapsed - (now - last), self._window_s / 4)
        self._w0 = _Mark.now(control, rows, events, last)
        total = c.plus(w0, self._w0)
        self._carried = _Mark()
        window = Window(self.current, total.rows, elapsed,
                        min(elapsed, max(0.0, total.waited)), max(0.0, total.cpu),
                        max(0.0, total.process_cpu), max(0.0, total.workers_cpu))
        # a full collection stops every thread for as long as it takes, and lands in
        # one window of many: that window is read again, unless the one before saw
        # one too (then collections come as often as windows, and each candidate's
        # windows pay them)
        stalled, was = total.collections > 0, self._stalled
        self._stalled = stalled
        if self._warmup > 0:
            self._warmup -= 1
        elif stalled and not was and not self.decision.settled:
            pass
        elif not self.decision.settled:
            if not self.record.windows:
                # read once, before the first window: the whole record replays with it;
                # at the cost of a tick, far below the duel it may spare
                self.record.handoff = control.handoff(self._window_s / 4)
            self.record.windows.append(window)
            self._act()
        else:
            self._watch(window)
        return self._window_s if not self.decision.settled else SETTLED_TICK_S

    def _act(self) -> None:
        assert self.space is not None
        d = self.decision = decide(self.record, self.space, self.config)
        if d.settled and d.duels:
            log.debug("execution settled: %s", self.report())
        if d.run != self.current:
            self._switch(d.run)

    def _switch(self, c: Candidate) -> None:
        control = self._control
        if control is None:
            return
        if not control.apply(c):
            self._failed(c)
            return
        log.debug("execution %s -> %s", self.current, c)
        # the window after a switch to or from processes, or to inline, is not used: a
        # process stage's first replies come after the fork and the refill of its
        # pipeline, and leaving it, its rows in flight still land; switched to inline
        # with the credit full, the consumer first takes the ready batches, loading
        # nothing, while the threads finish the rows they hold
        self._warmup = self.config.warmup_windows \
            if Mode.PROCESSES in (c.mode, self.current.mode) or c.mode is Mode.INLINE else 0
        self.current = c
        self._carried = _Mark()
        # the next window opens at the first completion under ``c``: switched to inline
        # with the credit full, the consumer first takes the ready batches and loads
        # nothing, and that time is not inline's.  The tasks the threads run now were
        # started under the candidate before: it opens once as many completions came
        # in (from two threads to one, the second thread's last task would otherwise
        # count as the one thread's; a thread waiting for a task with its place kept
        # takes one more before it sees the limit went down, and is counted too)
        self._w0 = None
        self._opens_after = control.completed()[1] + max(0, control.running() - 1)

    def _failed(self, c: Candidate) -> None:
        """``c`` could not start: count it (``start_attempts`` of them make processes
        unavailable), and go on with the best candidate still possible.  Twice the
        workers that could not start (a fork more, their memory) leave the space
        instead: the workers of the count below may run (the replay of the record
        with that space decides as the pass did, twice the workers having run no
        window)."""
        if c.mode is not Mode.PROCESSES or self.space is None:
            return
        if c == self.space.more_processes:
            self.space = dataclasses.replace(self.space, more_processes=None)
        else:
            self.record.failed_starts += 1
        self.decision = decide(self.record, self.space, self.config)
        run = self.decision.run
        if run != c and run != self.current and self._control is not None \
                and self._control.apply(run):
            self.current = run

    def _watch_anew(self, wait: int) -> None:
        """Start the drift watch over: a settled choice is re-checked no sooner than
        ``wait`` settled windows after its rate was read again."""
        self._check_wait, self._since_check = wait, 0
        # the settled windows a drift is judged on: the last ``wait`` of them, so a
        # dip shorter than half the wait (another process's burst, a collection)
        # cannot move their median
        self._recent = collections.deque(maxlen=wait)
        # the settled choice's own rate, read from its first settled windows (the
        # duel's windows alternated with other candidates' and ran in a cold pass),
        # as many as the drift is then judged on: a few windows read while the
        # process still warms up sit below what it reads a second later
        self._baseline = []

    def _watch(self, window: Window) -> None:
        """A settled window: re-check the choice (bounded) when the median of the
        last ``_check_wait`` settled windows drifted from the rate its first
        ``_check_wait`` settled windows read."""
        d = self.decision
        if d.choice_rate is None:
            return
        if len(self._baseline) < self._check_wait:
            self._baseline.append(window.rate)
            return
        base = statistics.median(self._baseline)
        self._recent.append(window.rate)
        self._since_check += 1
        if self._since_check < self._check_wait \
                or not drifted(base, list(self._recent), d.margin, self.config):
            return
        assert self.space is not None
        log.debug("execution %s drifted from %.0f rows/s: re-checking", self.current, base)
        self._watch_anew(2 * self._check_wait)
        self.record.recheck_at.append(len(self.record.windows))
        self._act()

    # ------------------------------------------------------------------ report
    def note(self, detail: str) -> None:
        """Something to say in the report (a process stage that failed)."""
        self.detail = detail

    def report(self) -> ExecutionReport:
        d = self.decision
        c = self.current if not d.settled else d.choice
        return ExecutionReport(mode=c.mode, count=c.count,
                               reason=d.reason if d.settled else Reason.EXPLORING,
                               candidates=measured(self.record), margin=d.margin,
                               processes_skipped=d.processes_skipped, detail=self.detail,
                               inline_skipped=d.inline_skipped,
                               threads_skipped=d.threads_skipped,
                               processes_first=d.processes_first,
                               inline_before_threads=d.inline_before_threads,
                               processes_before_up=d.processes_before_up,
                               processes_before_down=d.processes_before_down,
                               more_processes_skipped=d.more_processes_skipped,
                               thread_bound=bool(self.thread_bound))
