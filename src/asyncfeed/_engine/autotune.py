"""How many decode threads run at once, chosen by measurement during the pass.

The decode pool is started with the default thread count; a :class:`Tuner`
decides how many of those threads may run a task at the same time (the others
wait at a :class:`Gate`, costing nothing).  Every decode task reports its rows,
wall time and thread CPU time; over short windows the tuner computes the rate
(rows per second) and the cores the tasks kept busy, and moves the limit:

* down when the tasks keep fewer cores busy than the threads allowed would
  (threads wait for the GIL, or for I/O) -- kept if the rate does not fall by
  more than 3%, since fewer threads that do as much cost less CPU and less GIL
  traffic (on tiny samples they do *more*: every hand-off of the GIL between
  threads costs more than the sample);
* down to one thread per core when more threads than cores keep every core
  busy and the pool has no more to add (the spare threads cover stalls; where
  there are none, they only add GIL and cache traffic) -- kept, as any probe
  down, if the rate does not fall by more than 3%;
* up (never past the pool's size) when the threads allowed are all busy, or
  when one thread spends at least ``BLOCKED`` of its task time neither on a
  core nor queued for one (it waits for I/O inside the per-sample function:
  the tasks keep less than a core busy, yet a second thread would read while
  it decodes) -- kept only if the rate rises by at least 5%.

A probe down that is kept while about one core was ever busy, with the threads
spending at least ``GIL_WAIT`` of their task time neither running nor queued
for a core (the decode threads' run-queue delay, from the scheduler, is
subtracted: on a machine other processes load, waiting for a core is not the
GIL), marks the per-sample function as holding the GIL (``processes_why`` says
why): the loader's ``execution="auto"`` then moves it to worker processes.

Where the GIL probe found the GIL held at least ``GIL_HELD_NOW`` of the time
with several threads running and cores left idle (``SPARE_CORES``), that alone
marks it, even where the function's GIL-free part keeps more than one core busy
(workload (c): 1.5 of 2 cores with two threads, the GIL held 65-80% of the
time): a short epoch should not spend a fifth of itself proving it by a probe
down, and worker processes use the idle cores.

Two rules decide from one window, without a probe, once the pass's first
tasks have been measured alone (:meth:`Tuner.sized`; a fresh loader's first
pass), so that a one-second epoch does not spend a third of itself on threads
that cannot win:

* **GIL now**: a row measured alone is CPU-bound (on a core ``ALONE_ON_CORE``
  of its time) and costs at least ``PROCESS_MIN_ROW_S``; with several threads
  running, they leave ``SPARE_CORES`` idle and spend ``GIL_WAIT_NOW`` of their
  task time neither on a core nor queued for one (the GIL probe, where it has
  enough wake-ups, must not say the GIL is mostly free) -- or they keep no more
  than ``LOW_USE_NOW`` of the cores they could fill busy and that wait share
  plus the share of the probe's wake-ups that found the GIL held reach
  ``GIL_SIGNS_NOW`` (in one 40 ms window each reading alone is noisy: measured
  on workload (c) 0.0-0.48 and 0.29-0.58, their sum 0.43-0.98 with 0.63-1.23 of
  2 cores busy; on (a) and (g), GIL-free decoders, 1.46-1.66 cores busy and sums
  of 0.18-0.45, or 1.31-1.44 cores and sums under 0.31 in a second window), the
  probe's share at least ``GIL_FREE`` (the first windows of (a), (b) and (g) in
  fresh processes beside other load read 0.6-1.2 cores busy and sums up to 0.54,
  but the probe's share at 0.10-0.13 there; (c)'s was 0.29 or more);
* **tiny rows**: rows of ``TINY_MIN_ROW_S``..``PROCESS_MIN_ROW_S`` of CPU run on
  one thread (more threads only hand the GIL around); when that thread keeps
  ``TINY_BUSY`` of a core busy, the consumer spends ``CONSUMER_WAITS`` of the
  window waiting for batches (the loader is what it waits for, not the model)
  and the machine has ``TINY_SPARE_CORES`` idle, worker processes use the idle
  cores (DataLoader's ``num_workers=2`` against one thread of Python).  Rows
  cheaper than ``TINY_MIN_ROW_S`` (a no-op data set) cost the main process more
  to collect from workers than to load: they stay on the thread.

A probe that fails is undone and the next probe waits twice as many windows
(2, 4, ... 64): decisions are damped, never oscillate faster than that, and
are logged at debug level on the ``asyncfeed`` logger.  The tuner belongs to
the loader, so a pass starts where the previous one settled.  With
``num_threads=N`` given, nothing adapts (every thread runs).

The tuner also keeps the mean wall time per row of a task, from which the
pipeline sizes its tasks (:func:`rows_per_task`): tiny samples go in
batch-sized tasks, expensive ones a few rows at a time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("asyncfeed")

WINDOW_S = 0.04        # shortest measuring window
MIN_TASKS = 3          # tasks a window must see before it counts
TASK_TARGET_S = 2e-3   # a task this long makes its ~20 us of overhead negligible
WAITING_ROW_CPU_SHARE = 0.1  # a row on a core less than this share of its time waits ...
WAITING_ROWS_PER_TASK = 2    # ... and shares a task with another (the "ceiling" workload:
                             # 5 ms sleeps at 128 threads, 16-17k -> 20-21k samples/s)
DOWN_TOLERANCE = 0.97  # a probe down is kept unless the rate falls below this
UP_GAIN = 1.05         # a probe up is kept only if the rate rises by this
BUSY = 0.7             # share of the allowed cores the tasks must keep busy to probe up
MAX_BACKOFF = 64
WINDOWS_PER_SIDE = 2   # windows averaged for each rate a decision compares
GIL_CORES = 1.3            # at most this many cores busy, whatever the threads: the GIL
GIL_MIN_CORES = 0.5        # ... and at least this many: something holds the GIL (not I/O)
GIL_WAIT = 0.2             # share of the tasks' wall time spent neither running nor
                           # waiting for a core (so: waiting for the GIL) with more threads
BLOCKED = 0.3             # one thread blocked (off a core, not queued) this share of its
                           # task time waits for I/O: worth probing a second thread
GIL_HELD = 0.5            # ... or the GIL probe found it held this share of the time
GIL_HELD_NOW = 0.5        # held this share with several threads running and at least
SPARE_CORES = 0.3          # this much of the cores left idle: GIL-bound without waiting
                           # for a probe down
GIL_MIN_PROBES = 4         # (over at least this many of its wake-ups at that level)
PROCESS_MIN_ROW_S = 2e-4   # a sample cheaper than this does not pay for a process hop
                           # (unless the tiny-row rule below finds the loader the bottleneck)
ALONE_ON_CORE = 0.7        # a row measured alone spent this share of its time on a core
GIL_WAIT_NOW = 0.3         # one window's GIL wait share that, with CPU-bound rows and idle
                           # cores, marks the GIL without waiting for a probe down
GIL_FREE = 0.25            # the GIL probe found the GIL held less than this: not the GIL
LOW_USE_NOW = 0.65         # several threads keep at most this share of the cores they
GIL_SIGNS_NOW = 0.35       # could fill busy, and the GIL wait share plus the probe's
                           # held share reach this: each too noisy alone in one window
PAIR_GIL_WAIT = 0.15       # two threads side by side (Tuner.paired) that spend this share of
PAIR_CORES = 1.6           # their task time waiting for the GIL, keeping at most this many
                           # cores busy: the GIL holds the per-sample function
PAIR_GIL_FREE = 0.08       # ... under this share, keeping at least PAIR_FREE_CORES busy:
PAIR_FREE_CORES = 1.3      # the GIL does not (no one-window GIL rule); with about one core
                           # busy and the off-core time all queued one round cannot tell
                           # (GIL hand-offs read as run-queue delay; so do other processes)
PAIR_CONVOY_CORES = 1.25   # a round whose two threads kept at most this many cores busy ...
PAIR_CONVOY_OFF = 0.3      # ... and spent this share of their task time off a core (queued
                           # or waiting for the GIL) is a convoy; PAIR_CONVOYS of them mark
PAIR_CONVOYS = 2           # the GIL where the GIL probe found it held in PAIR_CONVOY_HELD
PAIR_CONVOY_HELD = 0.25    # of its wake-ups (at least GIL_MIN_PROBES) since the pass began:
                           # (c) read 0.97-1.21 cores, 31-50% off a core, queued (GIL
                           # hand-offs), the GIL held at 18-64% of the wake-ups (under
                           # 25% in 1 run of 12 on 2026-12-02: the window rules decide
                           # it then); GIL-free JPEG decoding, both threads on one core
                           # for 40 ms in 3 runs of 15, 0.97-0.99 cores, 44-47% off a
                           # core, held at none of 9-12; GIL-free rows in fresh processes
                           # beside other load, and hashing in the tests: 0.75-1.06
                           # cores, 41-53% off a core, held at 10-20%
PAIR_GIL_SURE = 0.25       # a GIL reading under this wait share is measured again while
                           # rounds remain (GIL-free hashing on a loaded machine read 16%)
PAIR_OVERLAP = 1.3         # task time (summed) per second of the pair's span below which
                           # the two threads barely ran side by side: it says nothing
TINY_MIN_ROW_S = 1e-5      # tiny rows cheaper than this stay on the thread (see above)
TINY_BUSY = 0.75           # the one thread keeps this share of a core busy ...
CONSUMER_WAITS = 0.5       # ... the consumer waits this share of the window ...
TINY_SPARE_CORES = 0.7     # ... and this many cores are idle: tiny rows go to processes
IDLE_SHARE = 0.25          # where run-queue delay cannot be read: the machine must have had
                           # this share of its CPU idle (threads that wait for a core
                           # because others load it are not held by the GIL)


class Gate:
    """At most ``limit`` decode tasks of one pass run at once; the rest wait.

    ``open()`` (at the end of the pass) lets every waiter through and makes the
    gate a no-op, so no thread stays blocked in it when the pool is joined.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active = 0
        self._open = False
        self._cond = threading.Condition(threading.Lock())

    def enter(self) -> None:
        with self._cond:
            while self._active >= self.limit and not self._open:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify()

    def over(self) -> bool:
        """Whether more tasks hold the gate than its limit allows now: a holder that
        keeps its place between tasks (``TaskPool``) should leave (read without
        the lock: a stale answer only delays that by one task)."""
        return self._active > self.limit and not self._open

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self.limit = limit
            self._cond.notify_all()

    def open(self) -> None:
        """Let every waiting and future task through (idempotent, any thread)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()


class Tuner:
    """The loader's running thread count, measured and adapted across its passes."""

    def __init__(self, size: int, cores: int, adaptive: bool,
                 machine_idle: Callable[[], tuple[float, float] | None] | None = None) -> None:
        self.size = size
        # cumulative (idle, total) CPU time of the whole machine, in any unit
        self._machine_idle = machine_idle if machine_idle is not None else read_machine_idle
        self._idle_at_start: tuple[float, float] | None = None
        # cumulative run-queue delay of the decode threads (seconds; None: unknown),
        # given per pass by gate_for_pass
        self._run_delay: Callable[[], float | None] | None = None
        # the GIL probe's running (held, probes) counts, given per pass; the
        # reading when the current limit was set
        self._gil_held: Callable[[], tuple[int, int]] | None = None
        self._held_at_set: tuple[int, int] | None = None
        self._delay_at_start: float | None = None
        # the consumer's cumulative wait for batches (seconds), given per pass
        self._consumer_wait: Callable[[], float] | None = None
        self._cwait_at_start: float | None = None
        # (CPU seconds, share of the wall time on a core) of a row measured alone
        self.alone: tuple[float, float] | None = None
        self._warming = False
        self.cores = max(1, cores)
        self.adaptive = adaptive and size > 1
        self.limit = size
        self.row_cost_s: float | None = None   # mean task wall time per row
        self.row_cpu_s: float | None = None    # mean task thread CPU time per row
        self.rates: dict[int, float] = {}      # last rate measured at each limit
        self.moves: list[tuple[int, int, str]] = []  # (from, to, why), for stats and tests
        self._lock = threading.Lock()
        self._gate: Gate | None = None
        self._w_start: float | None = None
        self._w_rows = 0
        self._w_cpu = 0.0
        self._w_wall = 0.0
        self._w_tasks = 0
        self._changed_at = 0.0   # tasks started before the last change do not count
        # per window: (rate, cores busy, GIL wait share or None, machine idle share or None)
        self._seen: list[tuple[float, float, float | None, float | None]] = []
        # (limit, rate, cores busy, GIL wait share, machine idle share) before the probe
        self._probe: _Before | None = None
        # why worker processes should run the per-sample function (the GIL holds it,
        # or tiny rows keep one thread busy while the consumer waits); None: threads
        self.processes_why: str | None = None
        # why the consumer runs the tasks itself (None: decode threads do), see run_inline
        self.inline: str | None = None
        # two threads side by side barely waited for the GIL (see paired): the
        # one-window GIL rules, noisier than that measure, no longer apply
        self.pair_free = False
        self._hold = 0
        self._backoff = 2
        # the probe down from spare threads on busy cores (see _decide): decision
        # rounds until it may run again, and the next such wait (doubling, never
        # reset: a difference of a few percent is often within one window's noise)
        self._spare_wait = 0
        self._spare_backoff = 2

    # ------------------------------------------------------------------ passes
    def gate_for_pass(self, run_delay: Callable[[], float | None] | None = None,
                      gil_held: Callable[[], tuple[int, int]] | None = None,
                      consumer_wait: Callable[[], float] | None = None
                      ) -> Gate | None:
        """A fresh gate at the current limit (None when nothing adapts).

        ``run_delay``: reads the cumulative run-queue delay (seconds) of the pass's
        decode threads, or None where the scheduler does not say (see
        ``Accounting.threads_run_delay``); without it the GIL test falls back on
        the machine's idle CPU.  ``gil_held``: reads the pass's GIL probe's running
        counts (wake-ups that found the GIL held, wake-ups), see
        :class:`~asyncfeed._engine.gilprobe.GilProbe`.  ``consumer_wait``: reads the
        consumer's cumulative wait for batches (seconds) this pass."""
        with self._lock:
            self._run_delay = run_delay
            self._gil_held = gil_held
            self._consumer_wait = consumer_wait
            self._held_at_set = gil_held() if gil_held is not None else None
            self._warming = True  # a pass's first window (threads starting) is not used
            self._w_start = None
            self._w_rows = self._w_tasks = 0
            self._w_cpu = self._w_wall = 0.0
            self._probe = None
            self._seen = []
            self._gate = Gate(0 if self.inline else self.limit) if self.adaptive else None
            return self._gate

    def describe(self) -> str:
        if not self.adaptive:
            return f"threads: {self.size} (pinned)"
        if self.inline is not None:
            return f"threads: none running, the consumer loads while it waits ({self.inline})"
        return f"threads: {self.limit} of {self.size} running (adaptive)"

    @property
    def undecided(self) -> bool:
        """Whether a pass's first windows may still decide where samples run (an
        adaptive count that has not measured a row alone yet, nor chosen)."""
        return (self.adaptive and self.alone is None and self.inline is None
                and self.processes_why is None)

    def run_inline(self, why: str) -> None:
        """From now on no decode thread runs a task: the consumer runs them while it
        waits for a batch (rows so cheap that waking a thread and handing the
        batch back cost more than loading them; see ``Pipeline.sized``).  For
        good: nothing adapts after that.  Does nothing when the count is pinned."""
        with self._lock:
            if not self.adaptive:
                return
            log.debug("asyncfeed: decode threads %d -> 0 (%s)", self.limit, why)
            self.moves.append((self.limit, 0, why))
            self.inline = why
            if self._gate is not None:
                self._gate.set_limit(0)

    def start_with(self, limit: int, why: str, hold: int = 0) -> None:
        """Run ``limit`` threads from now on, and make no decision for the next
        ``hold`` rounds (of ``WINDOWS_PER_SIDE`` windows); adapting goes on from
        there.  For the pipeline, which measures a pass's first tasks before the
        tuner has windows to compare (see ``Pipeline.sized``).  Does nothing when
        the count is pinned."""
        with self._lock:
            if not self.adaptive:
                return
            self._set(max(1, min(self.size, limit)), why, time.perf_counter())
            self._probe = None
            self._hold = max(self._hold, hold)

    def sized(self, row_cpu: float, on_core: float, now: float | None = None) -> None:
        """The pass's first tasks, run alone, cost ``row_cpu`` seconds of CPU a row and
        were on a core ``on_core`` of their time (see ``Pipeline.sized``).  The next
        window starts now and counts (the threads are running: no warm-up)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            self.alone = (row_cpu, on_core)
            self._warming = False
            self._changed_at = max(self._changed_at, now)
            self._w_start = None
            self._w_rows = self._w_tasks = 0
            self._w_cpu = self._w_wall = 0.0

    def may_pair(self, row_cpu: float, on_core: float) -> bool:
        """Whether rows measured alone at ``row_cpu`` seconds of CPU, on a core
        ``on_core`` of their time, are worth running side by side before the pass
        opens every thread (see :meth:`paired`): CPU-bound rows dear enough for a
        worker process, on an adaptive count with more than one core to use."""
        return (self.adaptive and self.cores > 1 and self.processes_why is None
                and self.inline is None and on_core >= ALONE_ON_CORE
                and row_cpu >= PROCESS_MIN_ROW_S)

    @staticmethod
    def pair_overlapped(span: float, wall: float) -> bool:
        """Whether tasks of ``wall`` seconds in all, in a pair measure of ``span``
        seconds, ran side by side long enough to say anything (the second thread
        may have started late, or not at all)."""
        return span > 0 and wall >= PAIR_OVERLAP * span

    def run_delay_now(self) -> float | None:
        """The pass's decode threads' cumulative run-queue delay (None: unknown)."""
        return self._run_delay() if self._run_delay is not None else None

    @staticmethod
    def pair_shares(span: float, wall: float, cpu: float,
                    delay: float | None) -> tuple[float, float] | None:
        """(share of the task time waiting for the GIL, cores kept busy) of a pair
        measure (see :meth:`paired`); None where it cannot be read."""
        if wall <= 0 or span <= 0 or delay is None:
            return None
        return min(1.0, max(0.0, wall - cpu - delay) / wall), cpu / span

    @staticmethod
    def _pair_waited(gil: float, used: float) -> bool:
        """The pair's wait rule (see :meth:`paired`) on its shares: at most
        ``PAIR_CORES`` cores busy, ``PAIR_GIL_WAIT`` of the task time waiting."""
        return gil >= PAIR_GIL_WAIT and used <= PAIR_CORES

    @classmethod
    def pair_marginal(cls, span: float, wall: float, cpu: float,
                      delay: float | None) -> bool:
        """Whether a pair measure reads the GIL (see :meth:`paired`) by a small margin
        only: a wait share under ``PAIR_GIL_SURE``.  The pipeline measures such a
        pair again while it has rounds left (one 10 ms reading of GIL-free rows on
        a loaded machine crossed ``PAIR_GIL_WAIT``)."""
        shares = cls.pair_shares(span, wall, cpu, delay)
        return shares is not None and cls._pair_waited(*shares) and shares[0] < PAIR_GIL_SURE

    @classmethod
    def pair_undecided(cls, span: float, wall: float, cpu: float,
                       delay: float | None) -> bool:
        """Whether a pair measure that ran side by side reads neither the GIL nor
        GIL-free rows (see :meth:`paired`) with fewer than ``PAIR_FREE_CORES``
        cores busy: say a wait share of 14% with 1.21 cores.  The pipeline
        measures it again while it has rounds left (on workload (c) such a first
        round left the pass to four threads convoying on the GIL for 100 ms
        before a window's rule found it).  A reading with more cores busy is
        of mostly free rows and is judged as read: measured again, a first round
        of workload (g) at 8% and 1.57 cores was followed, on a busy machine, by
        one at 16% and 0.96 cores, and the pass went to processes."""
        shares = cls.pair_shares(span, wall, cpu, delay)
        if shares is None or not cls.pair_overlapped(span, wall):
            return False
        gil, used = shares
        return gil < PAIR_GIL_WAIT and used < PAIR_FREE_CORES

    @classmethod
    def pair_gil(cls, span: float, wall: float, cpu: float, delay: float | None) -> bool:
        """Whether a pair round that ran side by side reads the GIL by the wait rule
        of :meth:`paired` (at most ``PAIR_CORES`` cores busy, ``PAIR_GIL_WAIT`` of
        the task time neither on a core nor queued for one), whatever the probe says."""
        shares = cls.pair_shares(span, wall, cpu, delay)
        return shares is not None and cls.pair_overlapped(span, wall) \
            and cls._pair_waited(*shares)

    def probe_can_tell(self) -> bool:
        """Whether the pass's GIL probe, if it has one, has woken often enough
        (``GIL_MIN_PROBES``) for :meth:`paired` to read its held share.  The pipeline
        measures a pair that reads the GIL again until it has (rows of 1 ms: a
        10 ms round saw two wake-ups, and GIL-free hashing went to processes)."""
        return self._gil_held is None or self._held_share() is not None

    @staticmethod
    def pair_convoy(span: float, wall: float, cpu: float) -> bool:
        """Whether a pair round (see :meth:`paired`) read a convoy: its two threads ran
        side by side (:meth:`pair_overlapped`) yet kept at most ``PAIR_CONVOY_CORES``
        cores busy, off a core ``PAIR_CONVOY_OFF`` of their task time, however that
        time splits between the run queue and the GIL.  One such round cannot tell
        the GIL (its hand-offs wake a thread onto the core of the one that woke it:
        run-queue delay) from other processes taking the cores, or the scheduler
        putting both threads on one core for a while; ``PAIR_CONVOYS`` of them can."""
        return (Tuner.pair_overlapped(span, wall) and cpu <= PAIR_CONVOY_CORES * span
                and wall - cpu >= PAIR_CONVOY_OFF * wall)

    def convoys_tell(self, convoys: int) -> bool:
        """Whether ``convoys`` pair rounds that read a convoy (:meth:`pair_convoy`) are
        enough to judge the GIL without more rounds: ``PAIR_CONVOYS`` of them, the
        GIL probe having found the GIL held at ``PAIR_CONVOY_HELD`` of its wake-ups
        since the pass began (GIL-free rows whose two threads the scheduler kept on
        one core read as a convoy too, but leave the GIL free)."""
        if convoys < PAIR_CONVOYS:
            return False
        held = self._held_share()
        return held is not None and held >= PAIR_CONVOY_HELD

    def paired(self, rows: int, span: float, wall: float, cpu: float,
               delay: float | None, convoys: int = 0) -> bool:
        """Two threads ran tasks side by side for ``span`` seconds (after the rows
        measured alone, see :meth:`sized`): ``rows`` rows in tasks that took
        ``wall`` seconds and ``cpu`` seconds of CPU in all, the decode threads
        ``delay`` seconds queued for a core meanwhile (None: unknown).  Marks the
        per-sample function as holding the GIL when the pair kept at most
        ``PAIR_CORES`` cores busy and waited, neither on a core nor queued for
        one, ``PAIR_GIL_WAIT`` of its task time (GIL-free rows keep two cores
        busy; rows measured alone were on a core, so the wait is not I/O) --
        unless the GIL probe found the GIL held at less than ``GIL_FREE`` of its
        wake-ups since the pass began (the wait was not for the GIL).
        ``convoys``: the pass's rounds, this one included, that read a convoy
        (:meth:`pair_convoy`); where they tell (:meth:`convoys_tell`) and this
        round is one of them, they mark the GIL too, whatever the run-queue delay
        says.  True if it did.  Workload (c) decides here ~30 ms into its first
        pass, instead of after a 40 ms window of four threads convoying on the GIL."""
        if self.pair_convoy(span, wall, cpu) and self.convoys_tell(convoys):
            held = self._held_share()
            with self._lock:
                if self.processes_why is not None:
                    return False
                self.processes_why = (
                    f"gil: two threads side by side kept {cpu / span:.2f} cores busy, "
                    f"{(wall - cpu) / wall:.0%} of their time off a core, in {convoys} "
                    f"rounds; the GIL held at {held or 0.0:.0%} of the probe's wake-ups")
            log.debug("asyncfeed: %s", self.processes_why)
            return True
        shares = self.pair_shares(span, wall, cpu, delay)
        if shares is None:
            return False
        gil, used = shares
        held = self._held_share()
        log.debug("asyncfeed: two threads side by side: %d rows in %.1f ms, %.2f cores "
                  "busy, %.0f%% of their time waiting for the GIL; the GIL held at %s of "
                  "the probe's wake-ups", rows, span * 1e3, used, 100 * gil,
                  "?" if held is None else f"{held:.0%}")
        if not self.pair_overlapped(span, wall):
            return False
        with self._lock:
            if self.processes_why is not None:
                return False
            if gil < PAIR_GIL_FREE and used >= PAIR_FREE_CORES:
                self.pair_free = True
            if not self._pair_waited(gil, used):
                return False
            if held is not None and held < GIL_FREE:
                # two threads that wait for the GIL leave it held most of the time;
                # a probe that found it free says the time off a core went elsewhere
                # (bench runs of GIL-free decoding in a fresh process beside other
                # load: 0.76-1.24 cores busy, 28-45% off a core, held at 0-12%;
                # workload (c): held at 50-70%)
                log.debug("asyncfeed: the GIL probe found the GIL free at %.0f%% of its "
                          "wake-ups: not the GIL", 100 * (1 - held))
                return False
            self.processes_why = (f"gil: two threads side by side kept {used:.2f} cores busy, "
                                  f"{gil:.0%} of their time waiting for the GIL")
        log.debug("asyncfeed: %s", self.processes_why)
        return True

    # -------------------------------------------------------------- measuring
    def record(self, rows: int, wall: float, cpu: float, now: float | None = None) -> None:
        """A decode task finished ``rows`` rows in ``wall`` seconds using ``cpu`` seconds
        (``now``: when it finished, ``time.perf_counter()`` by default)."""
        if rows <= 0:
            return
        now = time.perf_counter() if now is None else now
        with self._lock:
            c, u = wall / rows, cpu / rows
            self.row_cost_s = c if self.row_cost_s is None else 0.8 * self.row_cost_s + 0.2 * c
            self.row_cpu_s = u if self.row_cpu_s is None else 0.8 * self.row_cpu_s + 0.2 * u
            if not self.adaptive or self._gate is None or self.inline is not None:
                return
            if now - wall < self._changed_at:
                return  # started under the previous limit
            if self._w_start is None:
                self._w_start = max(now - wall, self._changed_at)
                self._start_readings()
            self._w_rows += rows
            self._w_cpu += cpu
            self._w_wall += wall
            self._w_tasks += 1
            span = now - self._w_start
            if span < WINDOW_S or self._w_tasks < MIN_TASKS:
                return
            rate, used = self._w_rows / span, self._w_cpu / span
            gil = self._gil_wait_share(self._w_wall, self._w_cpu)
            idle = self._idle_share()
            waited = self._consumer_share(span)
            self._w_start, self._w_rows, self._w_tasks = now, 0, 0
            self._w_cpu = self._w_wall = 0.0
            if self._warming:
                self._warming = False
                return
            if self._may_decide_now():
                self._verdict_now(rate, used, gil, idle, waited)
            self._decide(rate, used, now, idle if gil is None else None, gil)

    def _start_readings(self) -> None:
        """Read the counters a window's tests compare (at its start)."""
        self._delay_at_start = self._run_delay() if self._run_delay is not None else None
        # the machine's idle CPU (one /proc/stat read): for the GIL test where the
        # run-queue delay is unknown, and for the one-window rules until they decide
        self._idle_at_start = self._machine_idle() \
            if self._delay_at_start is None or self._may_decide_now() else None
        self._cwait_at_start = self._consumer_wait() if self._consumer_wait is not None \
            else None

    def _may_decide_now(self) -> bool:
        """Whether the one-window rules (:meth:`_verdict_now`) still apply."""
        return self.processes_why is None and self.alone is not None and self.cores > 1 \
            and not self.pair_free

    def _consumer_share(self, span: float) -> float | None:
        """The share of the window (``span`` seconds) the consumer spent waiting for
        batches (None: not read); starts the next window's reading."""
        start = self._cwait_at_start
        end = self._consumer_wait() if self._consumer_wait is not None else None
        self._cwait_at_start = end
        if start is None or end is None or span <= 0:
            return None
        return min(1.0, max(0.0, end - start) / span)

    def _verdict_now(self, rate: float, used: float, gil: float | None,
                     idle: float | None, waited: float | None) -> None:
        """The one-window rules (module docstring: "GIL now", "tiny rows")."""
        assert self.alone is not None
        row_cpu, on_core = self.alone
        n = self.limit
        if on_core < ALONE_ON_CORE:
            return  # a row alone waits for something (I/O): threads are the answer
        if n >= 2 and row_cpu >= PROCESS_MIN_ROW_S \
                and used <= min(n, self.cores) - SPARE_CORES:
            held = self._held_share()
            if held is not None and held >= GIL_HELD_NOW:
                self.processes_why = (f"gil: {used:.2f} cores busy with {n} threads, "
                                      f"GIL held {held:.0%} of the time, {rate:,.0f} rows/s")
            elif gil is not None and gil >= GIL_WAIT_NOW and (held is None or held >= GIL_FREE):
                self.processes_why = (f"gil: {used:.2f} cores busy with {n} threads, "
                                      f"{gil:.0%} of their time waiting for the GIL, "
                                      f"{rate:,.0f} rows/s")
            elif gil is not None and held is not None and gil + held >= GIL_SIGNS_NOW \
                    and held >= GIL_FREE and used <= LOW_USE_NOW * min(n, self.cores):
                self.processes_why = (f"gil: {used:.2f} cores busy with {n} threads, "
                                      f"{gil:.0%} of their time waiting for the GIL, "
                                      f"GIL held {held:.0%} of the time, {rate:,.0f} rows/s")
        elif n == 1 and TINY_MIN_ROW_S <= row_cpu < PROCESS_MIN_ROW_S and used >= TINY_BUSY \
                and waited is not None and waited >= CONSUMER_WAITS \
                and idle is not None and idle * self.cores >= TINY_SPARE_CORES:
            self.processes_why = (f"tiny rows: {row_cpu * 1e6:.0f} us of CPU each keep one "
                                  f"thread {used:.2f} cores busy, the consumer waits "
                                  f"{waited:.0%} of the time, {idle * self.cores:.1f} cores "
                                  f"idle, {rate:,.0f} rows/s")
        if self.processes_why is not None:
            log.debug("asyncfeed: %s", self.processes_why)

    def _gil_wait_share(self, wall: float, cpu: float) -> float | None:
        """The share of the window's task time (``wall``, of which ``cpu`` on a core)
        spent neither running nor waiting for a core: waiting for the GIL (or
        blocked, which the caller rules out by the cores kept busy).  None where
        the run-queue delay cannot be read.  Starts the next window's reading."""
        start = self._delay_at_start
        end = self._run_delay() if self._run_delay is not None else None
        self._delay_at_start = end
        if start is None or end is None or wall <= 0:
            return None
        return min(1.0, max(0.0, wall - cpu - max(0.0, end - start)) / wall)

    def _idle_share(self) -> float | None:
        """The share of the machine's CPU time that was idle since the window began
        (None where unknown); starts the next window's reading."""
        start, end = self._idle_at_start, self._machine_idle()
        self._idle_at_start = end
        if start is None or end is None or end[1] <= start[1]:
            return None
        return (end[0] - start[0]) / (end[1] - start[1])

    def _held_share(self) -> float | None:
        """The share of the GIL probe's wake-ups since the current limit was set that
        found the GIL held (None: no probe, or fewer than ``GIL_MIN_PROBES``)."""
        if self._gil_held is None or self._held_at_set is None:
            return None
        held, probes = self._gil_held()
        held0, probes0 = self._held_at_set
        if probes - probes0 < GIL_MIN_PROBES:
            return None
        return (held - held0) / (probes - probes0)

    def _set(self, limit: int, why: str, now: float) -> None:
        if limit == self.limit:
            return
        log.debug("asyncfeed: decode threads %d -> %d (%s)", self.limit, limit, why)
        self.moves.append((self.limit, limit, why))
        self.limit = limit
        self._changed_at = now
        self._held_at_set = self._gil_held() if self._gil_held is not None else None
        self._seen = []
        self._w_start = None
        self._w_rows = self._w_tasks = 0
        self._w_cpu = self._w_wall = 0.0
        if self._gate is not None:
            self._gate.set_limit(limit)

    def _down(self, n: int) -> int:
        return max(1, n // 2 if n > self.cores else n - 1)

    def _up(self, n: int) -> int:
        return min(self.size, n + 1 if n < self.cores else 2 * n)

    def _decide(self, rate: float, used: float, now: float, idle: float | None = None,
                gil: float | None = None) -> None:
        n = self.limit
        self.rates[n] = rate
        # every comparison is between the means of two windows on each side: one
        # window is noisy on a machine shared with other work
        self._seen.append((rate, used, gil, idle))
        if len(self._seen) < WINDOWS_PER_SIDE:
            return
        rate = _mean([x[0] for x in self._seen]) or 0.0
        used = _mean([x[1] for x in self._seen]) or 0.0
        gil_wait = _mean([x[2] for x in self._seen])
        idle_share = _mean([x[3] for x in self._seen])
        self._seen = []
        if self._probe is not None:
            before, before_rate, before_used, before_gil, before_idle, before_held = \
                self._probe
            self._probe = None
            down = n < before
            kept = rate >= before_rate * (DOWN_TOLERANCE if down else UP_GAIN)
            if kept and down and self.processes_why is None and self.cores > 1 \
                    and GIL_MIN_CORES <= before_used < GIL_CORES and used < GIL_CORES \
                    and _gil_waited(before_gil, before_idle, before_held) \
                    and (self.row_cost_s or 0) >= PROCESS_MIN_ROW_S:
                # fewer threads did as much, about one core was ever busy, and the
                # threads waited neither on a core nor on I/O: the per-sample
                # function holds the GIL (a process stage can run it in parallel)
                seen = "" if before_held is None else f", GIL held {before_held:.0%} of the time"
                self.processes_why = (f"gil: {before_used:.2f} cores busy with {before} threads"
                                  f"{seen}, {before_rate:,.0f} rows/s; {rate:,.0f} with {n}")
                log.debug("asyncfeed: %s", self.processes_why)
            if kept:
                self._backoff = 2
                nxt = self._down(n) if down else self._up(n)
                if nxt != n and (not down or used < BUSY * min(n, self.cores)):
                    self._probe = _Before(n, rate, used, gil_wait, idle_share,
                                          self._held_share())
                    self._set(nxt, f"{rate:,.0f} rows/s at {n}, probing {nxt}", now)
                else:
                    self._hold = 4
            else:
                self._hold = self._backoff
                self._backoff = min(MAX_BACKOFF, 2 * self._backoff)
                self._set(before, f"{rate:,.0f} rows/s at {n} vs {before_rate:,.0f} at "
                                  f"{before}: back", now)
            return
        if self.processes_why is None and n > 1 and self.cores > 1 \
                and GIL_MIN_CORES <= used <= self.cores - SPARE_CORES \
                and (self.row_cost_s or 0) >= PROCESS_MIN_ROW_S:
            held = self._held_share()
            if held is not None and held >= GIL_HELD_NOW:
                # several threads running, cores left idle, the GIL held nearly all the
                # time: Python is the limit (its GIL-free part may keep more than one
                # core busy), and no need to wait for a probe down to show it
                self.processes_why = (f"gil: {used:.2f} cores busy with {n} threads, "
                                  f"GIL held {held:.0%} of the time, {rate:,.0f} rows/s")
                log.debug("asyncfeed: %s", self.processes_why)
        if self._hold > 0:
            self._hold -= 1
            return
        busy = used / min(n, self.cores)
        if n > 1 and busy < BUSY:
            # straight to the cores the tasks kept busy (a GIL-bound set keeps about
            # one), then verified like any probe
            nxt = max(1, min(self._down(n), math.ceil(0.9 * used)))
        elif n < self.size and (busy >= BUSY or (n == 1 and (gil_wait or 0.0) >= BLOCKED)):
            # all busy, or one thread that spends much of its tasks blocked (no other
            # decode thread holds the GIL: it waits for I/O, e.g. reads in __getitem__)
            nxt = self._up(n)
        elif n > self.cores and busy >= BUSY:
            # every core busy with more threads than cores, and no more threads to
            # add: the spare ones may only add contention (GIL hand-offs, cache
            # misses; workload (a) on 2 cores: 2 threads 6% faster than 4, in-process
            # A/B) -- kept if the rate holds, like any probe down; where they cover
            # stalls (reads that wait), the rate falls and the probe is undone; it
            # runs ever more rarely (2, 4, ... 64 rounds apart), kept or not
            if self._spare_wait > 0:
                self._spare_wait -= 1
                return
            self._spare_wait = self._spare_backoff
            self._spare_backoff = min(MAX_BACKOFF, 2 * self._spare_backoff)
            nxt = self.cores
        else:
            return
        self._probe = _Before(n, rate, used, gil_wait, idle_share, self._held_share())
        self._set(nxt, f"{rate:,.0f} rows/s at {n}, {used:.2f} cores busy: probing {nxt}",
                  now)


class _Before(NamedTuple):
    """The level a probe left: its limit and what its last windows measured."""

    limit: int
    rate: float
    used: float
    gil: float | None    # blocked share of the tasks' time (None: no run-queue figures)
    idle: float | None   # the machine's idle share (None: not read)
    held: float | None   # the GIL probe's held share at that level (None: too few probes)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _gil_waited(gil_wait: float | None, idle_share: float | None,
               held: float | None = None) -> bool:
    """Whether threads that kept about one core busy were held by the GIL: the GIL
    probe found it held at least ``GIL_HELD`` of the time, or the threads'
    measured wait share (where the run-queue delay was read; hand-offs of the
    GIL wake threads, and the wake-up counts as run-queue delay, so code that
    hands it over often reads low here), else (no scheduler figures) a machine
    with idle CPU left."""
    if held is not None and held >= GIL_HELD:
        return True
    if gil_wait is not None:
        return gil_wait >= GIL_WAIT
    return idle_share is None or idle_share >= IDLE_SHARE  # nothing to tell: as measured


def read_machine_idle() -> tuple[float, float] | None:
    """Cumulative (idle, total) CPU jiffies of the whole machine (Linux ``/proc/stat``);
    None elsewhere."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
        vals = [int(v) for v in fields[:8]]
        return float(vals[3] + vals[4]), float(sum(vals))  # idle + iowait, all
    except (OSError, ValueError, IndexError):
        return None


def rows_per_task(n: int, running: int, row_cost_s: float | None,
                  row_cpu_s: float | None = None) -> int:
    """Rows of an ``n``-row batch per decode task, with ``running`` threads running.

    Before any measurement, a quarter of a thread's share of the batch.  Then
    enough rows for a task to last ``TASK_TARGET_S`` (the whole batch when
    samples are tiny), but no more than one running thread's share, so that
    every running thread works on each batch -- except for rows whose CPU
    (``row_cpu_s``) is under ``WAITING_ROW_CPU_SHARE`` of their wall time
    (``row_cost_s``): ``WAITING_ROWS_PER_TASK`` of those go in a task.
    """
    running = max(1, running)
    if row_cost_s is None or row_cost_s <= 0:
        return max(1, n // (4 * running))
    k = math.ceil(TASK_TARGET_S / row_cost_s)
    k = max(1, min(k, math.ceil(n / running)))
    if row_cpu_s is not None and row_cpu_s < WAITING_ROW_CPU_SHARE * row_cost_s:
        # rows that mostly wait (I/O, a remote call): a task's own Python (queue
        # wake-up, report, bookkeeping) is most of what they cost the process, so
        # two rows share it; the loader keeps twice the rows in flight for that
        # (``AsyncLoader._default_prefetch``), and every thread stays busy
        k = max(k, WAITING_ROWS_PER_TASK)
    return k
