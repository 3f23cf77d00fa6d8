"""Where a pass's time goes: per-stage accounting, always on, and its reading.

Internal API (used by the pipelines, ``stats()`` and the live view); small on
purpose:

- ``Accounting()``: one per pass, made by the pipeline (``pipeline.acct``).
  Threads record into accumulators of their own (no lock per sample; the
  lists are merged when read):

  * ``t = acct.begin()`` then ``t = acct.end(STAGE, t)``: one timed stretch in
    the calling thread, wall (``time.perf_counter``) and thread CPU
    (``time.thread_time``).  ``end`` returns a fresh start, so consecutive
    stages chain with one clock pair per boundary.
  * ``acct.add_wall(STAGE, seconds)``: wall time only (a read awaited on the
    event loop, where a thread's CPU clock says nothing about one coroutine;
    a batch waiting for the consumer).
  * ``acct.took(wait_s, samples)``: the consumer received a batch after
    waiting ``wait_s`` (consumer thread only).
  * ``acct.h2d_source``: a callable returning ``(copies, seconds)`` completed
    since its last call (the CUDA copy stream's timing events), polled when read.
  * ``acct.resources``: which stages share which capacity (set by the pipeline,
    see :class:`Resource`), for the verdict; ``acct.gate``: an object whose
    ``limit`` is how many decode threads may run now (the adaptive thread
    count's gate), which then is the ``"threads"`` resource's capacity.
  * ``acct.start()``: start the GIL probe (:mod:`.gilprobe`, one thread,
    owned here); ``acct.stop()``: the pass ended, the probe is joined, later
    snapshots are the final one.  Every ``start()`` must be followed by a ``stop()``.

- ``acct.snapshot()`` -> :class:`Snapshot`: cumulative figures since the pass
  started (per-stage ``count``/``wall_s``/``cpu_s``, process CPU, run-queue
  delay of the threads that ran CPU stages, the machine's CPU time run and
  stolen by a hypervisor, consumer waits).  ``later - earlier``
  is the window between two snapshots; :func:`analyse` turns a snapshot or a
  window into an :class:`Analysis` (gil share, busy threads, per-resource load,
  the bottleneck).

Cost: two clock reads per stage boundary and a few list updates, about 1 us per
boundary; nothing is allocated or locked per sample.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .gilprobe import GilProbe

__all__ = ["ASSEMBLE", "Accounting", "Analysis", "DECODE", "FETCH", "H2D", "QUEUE",
           "Resource", "STAGES", "Snapshot", "StageStats", "analyse"]

FETCH, DECODE, ASSEMBLE, H2D, QUEUE = range(5)
STAGES = ("fetch", "decode", "assemble", "h2d", "queue")
VERDICTS = ("consumer", "fetch", "decode", "gil", "h2d")

#: the consumer waited less than this share of the time: the loader is ahead
CONSUMER_MAX_WAIT = 0.10
#: the decode threads lost at least this share of their busy time to the GIL ...
GIL_MIN = 0.15
#: ... or the GIL probe found the GIL held at least this share of the time: Python
#: holds the GIL, and decode work that is the bottleneck is GIL-bound
GIL_HELD = 0.5
#: the name of the resource worker processes are (their count its capacity)
PROCESSES = "processes"


@dataclass(frozen=True)
class StageStats:
    """One stage of a pass: ``count`` samples (batches for ``assemble``, ``h2d``
    and ``queue``), ``wall_s`` seconds spent in it summed over them (so several
    threads at once add up to more than the elapsed time), and ``cpu_s`` the
    thread CPU time of that wall time, or None where it is not measured (reads
    awaited on the event loop, the CUDA copy, the queue)."""

    count: int = 0
    wall_s: float = 0.0
    cpu_s: float | None = None

    def __sub__(self, other: StageStats) -> StageStats:
        cpu = None if self.cpu_s is None and other.cpu_s is None else \
            (self.cpu_s or 0.0) - (other.cpu_s or 0.0)
        return StageStats(self.count - other.count, self.wall_s - other.wall_s, cpu)


@dataclass(frozen=True)
class Resource:
    """Stages that share one capacity: ``capacity`` of them run at once (the
    decode threads, ``io_concurrency`` reads, one copy stream, one iterator)."""

    name: str
    stages: tuple[int, ...]
    capacity: float


class _Acc:
    """One thread's running sums (only that thread writes them)."""

    __slots__ = ("n", "wall", "cpu", "timed", "tid", "delay0", "delay")

    def __init__(self) -> None:
        self.n = [0] * 5
        self.wall = [0.0] * 5
        self.cpu = [0.0] * 5
        self.timed = [0] * 5      # how many of ``n`` had their CPU time measured
        self.tid = threading.get_native_id()
        self.delay0 = _run_delay(self.tid)
        self.delay = self.delay0  # last run-queue delay read

    def run_delay(self) -> float | None:
        """This thread's run-queue delay since it first recorded, read afresh (the
        last reading once the thread is gone); None where the scheduler does not say."""
        d = _run_delay(self.tid)
        if d is not None:
            self.delay = d
        if self.delay is None or self.delay0 is None:
            return None
        return self.delay - self.delay0


def _summed_delay(accs: list[_Acc], stages: tuple[int, ...]) -> float | None:
    """The run-queue delay of the threads that timed any of ``stages``, summed (None
    if any of them is unknown)."""
    total = 0.0
    for a in accs:
        if any(a.timed[s] for s in stages):
            d = a.run_delay()
            if d is None:
                return None
            total += d
    return total


def parse_cpu_line(line: bytes, tick: float) -> tuple[float, float] | None:
    """``/proc/stat``'s first line as (seconds the machine's CPUs ran work: user,
    nice, system, irq, softirq; seconds a hypervisor stole from them), ``tick``
    seconds a count; None where the line is not one."""
    parts = line.split()
    if len(parts) < 9 or parts[0] != b"cpu":
        return None
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
    except ValueError:
        return None
    return (user + nice + system + irq + softirq) * tick, steal * tick


def _machine_times() -> tuple[float, float] | None:
    """The machine's CPU seconds run and stolen since boot (:func:`parse_cpu_line`);
    None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            return parse_cpu_line(f.readline(), _TICK)
    except OSError:
        return None


def _clock_tick() -> float:
    try:
        return 1.0 / os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return 0.01


_TICK = _clock_tick()


def _minus(a: float | None, b: float | None) -> float | None:
    """``a - b``, None where either is not known (a reading the machine does not give)."""
    return None if a is None or b is None else a - b


def _run_delay(tid: int) -> float | None:
    """Seconds thread ``tid`` of this process has spent runnable but waiting for a
    core (Linux schedstat); None where it cannot be read (thread gone, no procfs)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Snapshot:
    """Cumulative figures of a pass at ``elapsed_s`` seconds after it started
    (or, for ``later - earlier``, the figures of that window).

    ``cpu_threads_run_delay_s``: run-queue delay of the threads that ran
    CPU-timed stages (None where the scheduler does not say).
    ``machine_run_s``/``machine_steal_s``: CPU seconds the whole machine's CPUs
    ran work, and had stolen by a hypervisor (a virtual machine's CPUs wait while
    other guests run: None where ``/proc/stat`` does not say).  ``first_wait_s``:
    the consumer's wait for the pass's first batch (part of ``wait_s``).
    ``gil_held``/``gil_probes``: the GIL probe's totals (see :mod:`.gilprobe`).
    """

    elapsed_s: float = 0.0
    stages: Mapping[str, StageStats] = field(default_factory=dict)
    process_cpu_s: float = 0.0
    cpu_threads_run_delay_s: float | None = None
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    batches: int = 0
    samples: int = 0
    resources: tuple[Resource, ...] = ()
    gil_held: int = 0
    gil_probes: int = 0
    machine_run_s: float | None = None
    machine_steal_s: float | None = None

    def __add__(self, other: Snapshot) -> Snapshot:
        """Two windows as one (e.g. the end of a pass and the start of the next)."""
        neg = Snapshot(
            elapsed_s=-other.elapsed_s,
            stages={k: StageStats(-v.count, -v.wall_s, None if v.cpu_s is None else -v.cpu_s)
                    for k, v in other.stages.items()},
            process_cpu_s=-other.process_cpu_s,
            cpu_threads_run_delay_s=_minus(0.0, other.cpu_threads_run_delay_s),
            wait_s=-other.wait_s, first_wait_s=-other.first_wait_s, batches=-other.batches,
            samples=-other.samples, resources=other.resources,
            gil_held=-other.gil_held, gil_probes=-other.gil_probes,
            machine_run_s=_minus(0.0, other.machine_run_s),
            machine_steal_s=_minus(0.0, other.machine_steal_s))
        return self - neg

    def __sub__(self, other: Snapshot) -> Snapshot:
        stages = {k: self.stages.get(k, StageStats()) - other.stages.get(k, StageStats())
                  for k in STAGES if k in self.stages or k in other.stages}
        return Snapshot(elapsed_s=self.elapsed_s - other.elapsed_s, stages=stages,
                        process_cpu_s=self.process_cpu_s - other.process_cpu_s,
                        cpu_threads_run_delay_s=_minus(self.cpu_threads_run_delay_s,
                                                       other.cpu_threads_run_delay_s),
                        wait_s=self.wait_s - other.wait_s,
                        first_wait_s=self.first_wait_s - other.first_wait_s,
                        batches=self.batches - other.batches,
                        samples=self.samples - other.samples,
                        resources=self.resources or other.resources,
                        gil_held=self.gil_held - other.gil_held,
                        gil_probes=self.gil_probes - other.gil_probes,
                        machine_run_s=_minus(self.machine_run_s, other.machine_run_s),
                        machine_steal_s=_minus(self.machine_steal_s, other.machine_steal_s))


class Accounting:
    """The stage accounting of one pass (see the module docstring)."""

    def __init__(self, resources: tuple[Resource, ...] = ()) -> None:
        self.resources = resources
        self.gate: Any = None
        self.h2d_source: Callable[[], tuple[int, float]] | None = None
        self._tls = threading.local()
        self._accs: list[_Acc] = []
        self._lock = threading.Lock()
        self._h2d: list[Any] = [0, 0.0]  # copies, seconds
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        self._machine0 = _machine_times()
        self._wait = 0.0
        self._first_wait = 0.0
        self._batches = 0
        self._samples = 0
        self._final: Snapshot | None = None
        self.probe = GilProbe()

    # ---------------------------------------------------------------- recording
    def _mine(self) -> _Acc:
        try:
            return self._tls.acc
        except AttributeError:
            acc = self._tls.acc = _Acc()
            with self._lock:
                self._accs.append(acc)
            return acc

    @staticmethod
    def begin() -> tuple[float, float]:
        """The start of a timed stretch in this thread: (wall, thread CPU)."""
        return time.perf_counter(), time.thread_time()

    def end(self, stage: int, t: tuple[float, float], count: int = 1) -> tuple[float, float]:
        """Record ``count`` items of ``stage`` from ``t`` (a ``begin()``) to now;
        returns now as the next start."""
        now = time.perf_counter(), time.thread_time()
        acc = self._mine()
        acc.n[stage] += count
        acc.timed[stage] += 1
        acc.wall[stage] += now[0] - t[0]
        acc.cpu[stage] += now[1] - t[1]
        return now

    def add_wall(self, stage: int, seconds: float, count: int = 1) -> None:
        """Record ``count`` items of ``stage`` that took ``seconds`` of wall time in all."""
        acc = self._mine()
        acc.n[stage] += count
        acc.wall[stage] += seconds

    def took(self, wait_s: float, samples: int) -> None:
        """The consumer received a batch of ``samples`` after waiting ``wait_s``."""
        if self._batches == 0:
            self._first_wait = wait_s
        self._wait += wait_s
        self._batches += 1
        self._samples += samples

    def consumer_wait(self) -> float:
        """The consumer's wait for batches so far this pass (seconds; any thread)."""
        return self._wait

    def start(self) -> None:
        """Start the GIL probe (idempotent)."""
        self.probe.start()

    def stop(self, wait: bool = True) -> None:
        """The pass is over: freeze its figures and stop the probe (``wait``: join
        its thread).  Idempotent."""
        if self._final is None:
            self._final = self.snapshot()
        self.probe.close(wait=wait)

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> Snapshot:
        """Cumulative figures since the pass started (any thread; cheap: sums a few
        lists, reads one small procfs file per thread that ran CPU stages and
        ``/proc/stat``'s first line)."""
        if self._final is not None:
            return self._final
        elapsed = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        n, wall, tcpu, timed = [0] * 5, [0.0] * 5, [0.0] * 5, [0] * 5
        with self._lock:
            accs = list(self._accs)
        for a in accs:
            for s in range(5):
                n[s] += a.n[s]
                wall[s] += a.wall[s]
                tcpu[s] += a.cpu[s]
                timed[s] += a.timed[s]
        delay = _summed_delay(accs, (DECODE, ASSEMBLE, FETCH))
        machine, m0 = _machine_times(), self._machine0
        run, steal = (machine[0] - m0[0], machine[1] - m0[1]) if machine and m0 else (None, None)
        if self.h2d_source is not None:
            copies, seconds = self.h2d_source()
            with self._lock:
                self._h2d[0] += copies
                self._h2d[1] += seconds
        n[H2D] += self._h2d[0]
        wall[H2D] += self._h2d[1]
        stages = {name: StageStats(n[s], wall[s], tcpu[s] if timed[s] else None)
                  for s, name in enumerate(STAGES)}
        resources = self.resources
        gate = self.gate
        if gate is not None:  # a limit of 0: inline, the consumer runs the tasks, one at a time
            resources = tuple(replace(r, capacity=gate.limit or 1) if r.name == "threads"
                              else r for r in resources)
        return Snapshot(elapsed_s=elapsed, stages=stages, process_cpu_s=cpu,
                        cpu_threads_run_delay_s=delay, wait_s=self._wait,
                        first_wait_s=self._first_wait, batches=self._batches,
                        samples=self._samples, resources=resources,
                        gil_held=self.probe.held, gil_probes=self.probe.probes,
                        machine_run_s=run, machine_steal_s=steal)


@dataclass(frozen=True)
class Analysis:
    """What a snapshot (or a window) says.

    ``gil_share``: see :func:`gil_share`.  ``busy_threads``: CPU-timed thread
    stages' wall time over the elapsed time (threads busy on average).
    ``cores_used``: process CPU time over elapsed time.  ``wait_share``: the
    consumer's share of the time spent waiting for data (after the first batch
    when there are several).  ``loads``: per resource, its busy share of its
    capacity (1.0: always full).  ``bottleneck``: one of ``VERDICTS``, or None
    when nothing has been delivered yet.
    """

    gil_share: float
    busy_threads: float
    cores_used: float
    wait_share: float
    loads: Mapping[str, float]
    bottleneck: str | None
    limiting: str | None = None   # the resource the verdict blames (None: consumer)
    cores: int = 1                # the cores the process may use
    gil_pressure: float | None = None  # the GIL probe's reading (None: no probe yet)


def gil_share(s: Snapshot, cores: int) -> float:
    """The share of the decode threads' busy time spent waiting for the GIL (0..1).

    Over the ``decode`` and ``assemble`` stages (the thread stages that do not
    block in I/O): their wall time minus their CPU time is time the threads were
    not running.  Less the time they spent runnable but waiting for a core (the
    scheduler's run-queue delay of those threads, ``/proc/self/task/*/schedstat``;
    where it cannot be read, the wall time beyond what the cores could run), and
    less the time a hypervisor stole from them while they ran (a virtual
    machine's stolen time is off the threads' CPU clocks and in no run queue:
    their CPU time times the machine's stolen over run seconds, ``/proc/stat``),
    the rest is time they were blocked: on the GIL, which another thread held.  A
    thread waits for the GIL only while another runs, so the share is scaled by
    the process's CPU rate in cores when that is under 1 (threads blocked in I/O
    inside ``__getitem__`` with nothing running are not read as GIL).

    Wrong where: one thread runs Python all the time (nobody waits for it: near
    0, though more threads would not help; the GIL probe's ``pressure`` covers
    that case in :func:`analyse`); ``__getitem__`` blocks in I/O while other
    threads run Python (reads as GIL); the scheduler's figures are missing (a
    coarse bound stands in for the run-queue delay).
    """
    busy = cpu = 0.0
    for name in ("decode", "assemble"):
        st = s.stages.get(name)
        if st is not None and st.cpu_s is not None:
            busy += st.wall_s
            cpu += st.cpu_s
    if busy <= 0 or s.elapsed_s <= 0:
        return 0.0
    off = max(0.0, busy - cpu)
    delay = s.cpu_threads_run_delay_s
    if delay is None:
        delay = max(0.0, busy - cores * s.elapsed_s)
    else:  # the same threads' blocking reads had their share of the delay
        reads = s.stages.get("fetch")
        if reads is not None and reads.cpu_s is not None and reads.wall_s > 0:
            delay *= busy / (busy + reads.wall_s)
    stolen = 0.0
    if s.machine_run_s and s.machine_steal_s and s.machine_run_s > 0:
        stolen = cpu * max(0.0, s.machine_steal_s) / s.machine_run_s
    rate = s.process_cpu_s / s.elapsed_s
    return min(1.0, max(0.0, (off - max(0.0, delay) - stolen) * min(1.0, rate) / busy))


def analyse(s: Snapshot, cores: int) -> Analysis:
    """Read a snapshot or window: GIL share, loads and the bottleneck.

    The verdict: ``"consumer"`` when the consumer waited less than
    ``CONSUMER_MAX_WAIT`` of the time; otherwise the resource with the highest
    load (busy time over capacity x elapsed) is blamed, as the stage that spent
    the most time in it: ``fetch`` -> ``"fetch"``, ``h2d`` -> ``"h2d"``,
    ``decode``/``assemble`` -> ``"gil"`` when the GIL share is at least
    ``GIL_MIN`` or the GIL's pressure (the share of the time the probe found it
    held) at least ``GIL_HELD``, else ``"decode"``.
    The share sees threads that wait for each other; the pressure sees one
    thread running Python all the time, which waits for nobody (share near 0)
    but which more threads would not help.  Where worker processes are the
    fullest resource (``PROCESSES``) the verdict is ``"decode"``: the share and
    the probe read this process's GIL, which the workers' rows do not wait for.
    """
    elapsed = max(s.elapsed_s, 1e-9)
    g = gil_share(s, cores)
    pressure = GilProbe.pressure(s.gil_held, s.gil_probes)
    busy = sum(st.wall_s for st in s.stages.values() if st.cpu_s is not None)
    if s.batches > 2 and elapsed - s.first_wait_s > 0:
        wait_share = (s.wait_s - s.first_wait_s) / max(elapsed - s.first_wait_s, 1e-9)
    else:
        wait_share = s.wait_s / elapsed
    wait_share = min(1.0, max(0.0, wait_share))
    stage_index = {name: i for i, name in enumerate(STAGES)}
    loads: dict[str, float] = {}
    for r in s.resources:
        wall = sum(s.stages[STAGES[i]].wall_s for i in r.stages if STAGES[i] in s.stages)
        loads[r.name] = wall / (max(r.capacity, 1e-9) * elapsed)
    verdict: str | None = None
    limiting: str | None = None
    if s.batches == 0:
        verdict = None
    elif wait_share < CONSUMER_MAX_WAIT or not loads:
        verdict = "consumer"
    else:
        res = max(s.resources, key=lambda r: loads[r.name])
        limiting = res.name
        names = [STAGES[i] for i in res.stages]
        top = max(names, key=lambda n: s.stages[n].wall_s if n in s.stages else 0.0)
        if stage_index[top] == FETCH:
            verdict = "fetch"
        elif stage_index[top] == H2D:
            verdict = "h2d"
        elif res.name == PROCESSES:
            verdict = "decode"
        else:
            verdict = ("gil" if g >= GIL_MIN or (pressure or 0.0) >= GIL_HELD
                       else "decode")
    return Analysis(gil_share=g, busy_threads=busy / elapsed,
                    cores_used=s.process_cpu_s / elapsed, wait_share=wait_share,
                    loads=loads, bottleneck=verdict, limiting=limiting, cores=cores,
                    gil_pressure=pressure)

