"""Reading a run's process tree from the outside: memory, pauses, other load.

:class:`TreeSampler` watches one run (the fork server plus the run process and
all its descendants) from a thread of the benchmark process:

* the resident set summed over the tree, every ``rss_interval`` seconds (cheap:
  ``/proc/PID/statm`` of each process of the tree); the tree itself is listed
  every ``tree_interval`` seconds, and at every pause: listing it reads the
  ``stat`` file of every process on the machine (2 ms here), and at every RSS
  reading that was 16% of a core of the benchmark's own, taken from the run
  (threads of one process lose more to it than processes do: a thread that holds
  the GIL and is preempted stalls the others; workload (a)'s defaults read 5% slower
  beside it);
* PSS (proportional set size: a page shared by ``n`` processes counts ``1/n`` in
  each, so the sum counts every page once) summed over the tree, every
  ``pss_interval`` seconds and whenever the run stops itself to be read (after
  building its data set, and at the end of its epoch while every worker is
  still alive).  Reading PSS walks the page tables (about 10 ms for a 500 MB
  process), so it is done rarely, by this process, on its own CPU time;
  where the OS has no PSS, RSS stands in;
* CPU time used on the machine by processes outside the run, so a run disturbed
  by other load can be flagged.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil


def _pss(proc: psutil.Process) -> int | None:
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    except (ProcessLookupError, PermissionError, OSError):
        return None
    return None


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0


def has_pss() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")


class TreeSampler:
    """Samples memory of ``[server] + tree(pid)`` until :meth:`stop`."""

    def __init__(self, pid: int, server_pid: int | None, *, rss_interval: float = 0.02,
                 pss_interval: float = 1.0, tree_interval: float = 0.25) -> None:
        self.pid = pid
        self.server_pid = server_pid
        self.rss_interval = rss_interval
        self.pss_interval = pss_interval
        self.tree_interval = tree_interval
        self.use_pss = has_pss()
        self.peak_rss = 0
        self.peak_pss = 0
        self.max_procs = 0
        self.pss_samples: list[dict] = []
        self.pauses = 0
        self._stop = threading.Event()
        self._root = psutil.Process(pid)
        self._server = psutil.Process(server_pid) if server_pid else None
        self._t0 = time.perf_counter()
        self._cpu0 = self._machine_busy()
        # a daemon: a bench ended by an exception (Ctrl-C, SIGTERM) at any point,
        # even before it could stop the sampler, must not wait on it at exit
        self._thread = threading.Thread(target=self._run, name="asyncfeed-bench-sampler",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) \
            + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)

    def _tree(self) -> list[psutil.Process]:
        try:
            procs = [self._root] + self._root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            procs = []
        if self._server is not None:
            procs.append(self._server)
        return procs

    def _read_pss(self, label: str) -> list[psutil.Process]:
        """Read PSS over the tree, listed afresh; returns the tree it listed."""
        procs = self._tree()
        if self.use_pss:
            vals = [_pss(p) for p in procs]
            total = sum(v for v in vals if v is not None)
        else:
            total = sum(_rss(p) for p in procs)
        self.peak_pss = max(self.peak_pss, total)
        self.pss_samples.append({"label": label, "t": round(time.perf_counter() - self._t0, 4),
                                 "bytes": total, "procs": len(procs)})
        return procs

    def _stopped(self) -> bool:
        try:
            return self._root.status() == psutil.STATUS_STOPPED
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False

    def _run(self) -> None:
        next_pss = time.perf_counter() + self.pss_interval
        next_tree = 0.0
        procs: list[psutil.Process] = []
        while not self._stop.is_set():
            listed = None
            if time.perf_counter() >= next_tree:
                listed = self._tree()
            self.peak_rss = max(self.peak_rss, sum(_rss(p) for p in listed or procs))
            if self._stopped():
                self.pauses += 1
                listed = self._read_pss(f"pause{self.pauses}")
                try:
                    os.kill(self.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            elif time.perf_counter() >= next_pss:
                listed = self._read_pss("periodic")
                next_pss = time.perf_counter() + self.pss_interval
            if listed is not None:  # the tree as last listed serves the next readings
                procs = listed
                self.max_procs = max(self.max_procs, len(procs))
                next_tree = time.perf_counter() + self.tree_interval
            self._stop.wait(self.rss_interval)

    def stop(self) -> dict:
        """Stop sampling; returns the figures."""
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._t0
        busy = self._machine_busy() - self._cpu0
        return {
            "peak_pss_bytes": self.peak_pss,
            "peak_rss_sum_bytes": self.peak_rss,
            "memory_metric": "pss" if self.use_pss else "rss",
            "pss_samples": self.pss_samples,
            "max_procs": self.max_procs,
            "machine_cpu_s": busy,
            "wall_s": wall,
        }
