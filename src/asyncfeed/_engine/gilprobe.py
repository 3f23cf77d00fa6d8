"""How often the GIL is held: a thread that sleeps and times its wake-up.

Every ``period`` seconds (20 ms) the probe thread wakes from a sleep (the GIL
released) and must take the GIL back before it can read the clock.  The time
its wake-up came late, less the time it spent waiting for a core (its
run-queue delay, from ``/proc/thread-self/schedstat``) and the CPU it used, is
time it waited for the GIL.  A wait over ``HELD_S`` (0.2 ms) means another
thread held the GIL when the probe woke: the share of wake-ups that found it
held (``pressure``) estimates the share of the time Python held it.  Only a
share: how long each wait lasts says how long the holder's stretches are (up to
a switch interval, ``sys.getswitchinterval()``), not how busy the GIL is --
code that calls into torch or NumPy every few hundred microseconds lets go that
often, yet can keep the GIL busy all the time.

One long wait can also mean that the thread holding the GIL was preempted (a
machine whose cores other processes keep busy).  So after a long wait the
probe lets go of the GIL for ``GAP_S`` (time for a waiting thread to take it)
and waits for it again, ``REPEATS`` waits in all, and keeps the median:
Python threads that keep the GIL busy make every wait long, a preempted
holder only one.

It explains ``stats()`` (the ``gil`` share and bottleneck); nothing chooses
by it.  So it is cheap by default: one wake-up every ``PERIOD_S`` (100 ms).
While Python holds the GIL, each wake-up forces up to ``REPEATS`` switches of
the GIL, and while the probe waits for it every release by the holder (NumPy
lets go in each copy) wakes it again, a cost the holder pays
(``bench/probe_cost.py`` measures both).  A ``budget`` bounds that: the largest
share of the time the probe may spend awake waiting for the GIL; after a
wake-up that waited ``w`` seconds it sleeps at least ``w / budget``.  Where the
GIL is free its waits are near zero and the period is unchanged.  A loader
starts each pass's probe no sooner than its last pass's would have woken
(``not_before``, ``next_wake``), so passes shorter than the budget's sleep do
not wake it more often.

The thread belongs to one :class:`GilProbe`; ``close()`` is idempotent, joins
it (unless called from a thread that must not wait), and probes still
running at interpreter exit are closed before the interpreter joins
non-daemon threads.
"""

from __future__ import annotations

import os
import threading
import time

from .exithooks import OpenSet

__all__ = ["BUDGET", "GilProbe", "HELD_S", "PERIOD_S", "REPEATS"]

#: waits per sample after a long first one; the sample is their median
REPEATS = 3
#: the pause between them: time for a thread woken by our release to take the GIL
GAP_S = 0.001
#: a wait for the GIL longer than this means another thread held it
HELD_S = 2e-4
#: the period between wake-ups
PERIOD_S = 0.1
#: the share of the time the probe may spend awake waiting for the GIL (see above)
BUDGET = 0.01



def _close_all_at_exit(probes: list[GilProbe]) -> None:
    for p in probes:
        p.close()


_open: OpenSet[GilProbe] = OpenSet(_close_all_at_exit)


def _own_run_delay(fd: int | None) -> float:
    """This thread's run-queue delay in seconds (0.0 where it cannot be read)."""
    if fd is None:
        return 0.0
    try:
        return int(os.pread(fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class GilProbe:
    """Samples the GIL's availability from a thread of its own (``asyncfeed-gilprobe``).

    ``held`` (wake-ups that found the GIL held), ``probes`` (wake-ups) and
    ``awake_s`` (seconds spent awake waiting for the GIL) are running totals
    (read them from any thread; a window is the difference of two readings);
    ``pressure(held, probes)`` turns them into 0..1.
    """

    def __init__(self, period: float = PERIOD_S, budget: float | None = BUDGET) -> None:
        self.period = period
        # the largest share of the time spent awake waiting for the GIL (None: no
        # bound): after a wake-up that waited w seconds, the next sleep is at least
        # w / budget (read at every wake-up: the loader may set it before start)
        self.budget = budget
        # no wake-up before this perf_counter time (a loader's next pass's probe
        # starts where its last one's budget left off: a pass is often shorter
        # than the sleep the budget asks for) ...
        self.not_before = 0.0
        # ... and when this one's next wake-up is due (read by that next pass)
        self.next_wake = 0.0
        self.held = 0
        self.probes = 0
        self.awake_s = 0.0  # seconds spent awake waiting for the GIL, in all
        self._stop = False
        self._wake = threading.Event()  # set by close(): ends the sleep at once
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (idempotent; a closed probe stays closed)."""
        with self._lock:
            if self._thread is not None or self._stop:
                return
            # due now, though the thread may not run before a short pass ends
            self.next_wake = max(time.perf_counter() + self.period, self.not_before)
            self._thread = threading.Thread(target=self._run, name="asyncfeed-gilprobe",
                                            daemon=False)
            self._thread.start()
        _open.add(self)

    def _run(self) -> None:
        try:
            fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = None
        try:
            awake = 0.0  # the last wake-up's time spent waiting for the GIL
            while not self._stop:
                period = self.period
                budget = self.budget
                if budget is not None and budget > 0:
                    period = max(period, awake / budget)
                now = time.perf_counter()
                period = max(period, self.not_before - now)
                self.next_wake = now + period
                got = self._wait(fd, period)
                if got is None:
                    break  # closed while it slept
                first, awake = got
                waits = [first]
                if first > HELD_S:  # else: free, no need to ask again
                    for _ in range(REPEATS - 1):
                        got = self._wait(fd, GAP_S)
                        if got is None:
                            return
                        waits.append(got[0])
                        awake += got[1]
                if sorted(waits)[len(waits) // 2] > HELD_S:
                    self.held += 1
                self.probes += 1
                self.awake_s += awake
        finally:
            if fd is not None:
                os.close(fd)

    def _wait(self, fd: int | None, seconds: float) -> tuple[float, float] | None:
        """Sleep ``seconds`` (the GIL released); then (the time spent waiting for the
        GIL less waiting for a core and the CPU used, the whole time awake before
        the GIL was taken).  None: ``close()`` woke it (a pass's end does not wait
        out the probe's sleep: that was up to 20 ms of every pass, 2-3% of a
        one-second epoch)."""
        t0, c0, d0 = time.perf_counter(), time.thread_time(), _own_run_delay(fd)
        if self._wake.wait(seconds):
            return None
        late = max(0.0, time.perf_counter() - t0 - seconds)
        lost = time.thread_time() - c0 + _own_run_delay(fd) - d0
        return max(0.0, late - lost), late

    @staticmethod
    def pressure(held: int, probes: int) -> float | None:
        """The share of wake-ups that found the GIL held, 0..1 (None: no probes)."""
        if probes <= 0:
            return None
        return min(1.0, max(0.0, held / probes))

    def close(self, wait: bool = True) -> None:
        """Stop sampling; with ``wait``, return once the thread has exited. Idempotent."""
        with self._lock:
            self._stop = True
            thread = self._thread
        self._wake.set()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
        _open.discard(self)
