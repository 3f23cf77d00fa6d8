"""How hard it is to get the GIL right now: a thread that sleeps and times its wake-up.

Every ``period`` seconds (20 ms) the probe thread wakes from a sleep (the GIL
released) and must take the GIL back before it can read the clock.  The time
its wake-up came late, less the time it spent waiting for a core (its
run-queue delay, from ``/proc/thread-self/schedstat``) and the CPU it used, is
time it waited for the GIL.  When Python threads hold the GIL continuously,
each wake-up waits about one switch interval (``sys.getswitchinterval()``,
5 ms) before the holder is made to let go; when the GIL is mostly free
(threads inside GIL-releasing decoders), it waits next to nothing.

One long wait can also mean that the thread holding the GIL was preempted (a
machine whose cores other processes keep busy).  So after a long wait the
probe lets go of the GIL for ``GAP_S`` (time for a waiting thread to take it)
and waits for it again, ``REPEATS`` waits in all, and keeps the median:
Python threads that hold the GIL continuously make every wait long, a
preempted holder only one.  ``pressure`` is the mean kept wait over the switch
interval, capped at 1.

Cost: one wake-up per ``period`` (about 50 per second, about 3 ms of CPU a second
in all), and while Python holds the GIL, up to ``REPEATS`` forced GIL switches.
The thread belongs to one :class:`GilProbe`; ``close()`` is idempotent, joins
it (unless called from a thread that must not wait), and probes still
running at interpreter exit are closed before the interpreter joins
non-daemon threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .exithooks import OpenSet

__all__ = ["GilProbe", "REPEATS"]

#: waits per sample after a long first one; the sample is their median
REPEATS = 3
#: the pause between them: time for a thread woken by our release to take the GIL
GAP_S = 0.001



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

    ``wait_s`` and ``probes`` are running totals (read them from any thread; a
    window is the difference of two readings); ``pressure(wait_s, probes)`` turns
    them into 0..1.
    """

    def __init__(self, period: float = 0.02) -> None:
        self.period = period
        self.wait_s = 0.0
        self.probes = 0
        self._stop = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (idempotent; a closed probe stays closed)."""
        with self._lock:
            if self._thread is not None or self._stop:
                return
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
            while not self._stop:
                waits = [self._wait(fd, self.period)]
                if waits[0] > sys.getswitchinterval() / 10:  # else: free, no need to ask again
                    waits += [self._wait(fd, GAP_S) for _ in range(REPEATS - 1)]
                self.wait_s += sorted(waits)[len(waits) // 2]
                self.probes += 1
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _wait(fd: int | None, seconds: float) -> float:
        """Sleep ``seconds`` (0: just let go of the GIL); the time then spent waiting
        for the GIL, less waiting for a core and the CPU used."""
        t0, c0, d0 = time.perf_counter(), time.thread_time(), _own_run_delay(fd)
        time.sleep(seconds)
        late = time.perf_counter() - t0 - seconds
        lost = time.thread_time() - c0 + _own_run_delay(fd) - d0
        return max(0.0, late - lost)

    @staticmethod
    def pressure(wait_s: float, probes: int) -> float | None:
        """Mean GIL wait per wake-up over the switch interval, 0..1 (None: no probes)."""
        if probes <= 0:
            return None
        return min(1.0, max(0.0, wait_s / probes / sys.getswitchinterval()))

    def close(self, wait: bool = True) -> None:
        """Stop sampling; with ``wait``, return once the thread has exited. Idempotent."""
        with self._lock:
            self._stop = True
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
        _open.discard(self)
