"""One pass over a map-style dataset: planned batches in, finished batches out.

The consumer's thread pulls the index plan and submits whole batches while it
holds fewer than ``prefetch`` of them (one, until the consumer has taken the
first batch, unless reads run on the event loop).  Each sample is loaded either entirely in a decode thread
(``__getitem__``, or ``read`` + ``decode``; a few rows per pool task), or
fetched on the event loop (``async fetch``, ``io_concurrency`` at once) and then
decoded in a decode thread.  Decoded samples go straight into their row of the
batch's buffers (the ring path) or into a list that is collated when the batch
is complete.  The thread that completes a batch assembles it, starts its copy
to the device and marks it ready; errors are stored with the batch, never
raised in a worker, and reach the consumer at that batch.

The pipeline is made from a frozen :class:`~.handoff.PassConfig` and its live
collaborators: the dataset's :class:`~.capabilities.Capabilities`, the plan, the
loader's :class:`~.handoff.BatchMemory` (host pool and slot ring) and device
transfer, the runtime.  It holds none of them through the user's iterator, so
dropping the iterator still closes the pipeline (see ``loader``).  Handing
batches to the consumer, and the pass's lifecycle, are :class:`~.handoff.BatchHandoff`'s.
"""

from __future__ import annotations

import asyncio
import logging
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import LoaderClosedError, SampleError, is_fatal, rebuild_error
from .._memory.device import CopyStream
from .._memory.slots import Slot
from ..protocols import DeviceTransfer, NamedSamples
from . import processes, rowtasks
from .accounting import ASSEMBLE, DECODE, FETCH, H2D, Resource
from .autotune import PROCESS_MIN_ROW_S, Gate, Tuner, rows_per_task
from .capabilities import Capabilities
from .handoff import BatchHandoff, BatchMemory, PassConfig
from .layout import Layout, LayoutMismatch
from .readahead import ReadAhead
from .runtime import Runtime

log = logging.getLogger("asyncfeed")


#: a row that costs less CPU than this, measured alone, and spends most of its time on
#: a core (not waiting for I/O) is "tiny": handing the GIL between threads costs more
#: than such a row, so the pass runs one thread (the process stage does not take rows
#: this cheap either, see ``autotune.PROCESS_MIN_ROW_S``)
TINY_ROW_CPU_S = PROCESS_MIN_ROW_S
TINY_ON_CORE = 0.25    # ... and its CPU time is at least this share of its wall time
#: a row cheaper than this (a no-op sample, a row of an in-RAM tensor) is loaded by the
#: consumer while it waits: waking a thread and handing the batch back cost more than
#: the rows (DataLoader's num_workers=0, with the rows written in place).  The most a
#: batch can then cost the consumer: batch size x this (2 ms for 256 rows)
INLINE_ROW_CPU_S = 8e-6
SIZING_TASKS = 2       # tasks run alone at the start of a fresh tuner's first pass
PAIR_THREADS = 2       # then threads run tasks side by side (see Pipeline.sized) ...
PAIR_S = 0.01          # ... starting tasks for this long (two switch intervals)
PAIR_QUEUED = 0.15     # a pair that waited this share of its task time for a core ran
PAIR_ROUNDS = 3        # on one (the scheduler had put both threads there): once more,
                       # up to this many rounds in all
TINY_HOLD = 16         # decision rounds the tuner then keeps one thread before probing


class _Pairing:
    """Tasks run side by side after the sizing ones (see :meth:`Pipeline.sized`)."""

    def __init__(self, row_cpu: float, on_core: float, delay0: float | None,
                 round: int = 1, convoys: int = 0) -> None:
        self.row_cpu = row_cpu   # the rows measured alone
        self.on_core = on_core
        self.round = round
        self.convoys = convoys   # earlier rounds that read a convoy (Tuner.pair_convoy)
        self.t0 = time.perf_counter()
        self.delay0 = delay0     # the decode threads' run-queue delay then
        self.closed = False      # no task starts after this (the gate is at 0)
        self.running = 0
        self.rows = 0
        self.wall = 0.0
        self.cpu = 0.0


class LayoutHolder:
    """The layout read off the first sample, shared by every epoch of a loader."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.layout: Layout | None = None
        self.decided = not enabled
        self._lock = threading.Lock()

    def give_up(self) -> None:
        """Samples do not share one shape: collate every batch from now on."""
        self.layout = None
        self.decided = True

    def offer(self, sample: Any) -> None:
        if self.decided:
            return
        with self._lock:
            if not self.decided:
                self.layout = Layout.infer(sample)
                self.decided = True


_NO_RAW = object()


class Batch:
    """A planned batch and everything its samples produced."""

    __slots__ = ("k", "indices", "n", "mode", "bufs", "slot", "samples", "remaining",
                 "done", "failures", "error", "output", "event", "good_samples_host",
                 "mismatch", "layout", "views", "t_ready", "deferred")

    def __init__(self, k: int, indices: list[Any], mode: str) -> None:
        self.k = k
        self.indices = indices
        self.n = len(indices)
        self.mode = mode                  # "ring" | "collate" | "batch" | "plan" (sampler failed)
        self.bufs: list[Any] | None = None
        self.slot: Slot | None = None
        self.samples: list[Any] = [None] * self.n
        self.remaining = self.n
        self.done = bytearray(self.n)
        # (row, index, error); the error is dropped (None) once the consumer recorded it
        self.failures: list[tuple[int, Any, BaseException | None]] = []
        self.error: BaseException | None = None   # a batch-level error (collate_fn...)
        self.output: Any = None
        self.event: Any = None
        self.good_samples_host: list[tuple[Any, Any]] = []
        self.mismatch = False
        self.layout: Layout | None = None
        self.views: list[Any] | None = None   # NumPy views of bufs, for write_row
        self.t_ready = 0.0                    # perf_counter() when it became ready
        self.deferred = False   # rows loaded but not written: _finish writes them (rowtasks)

    def pending(self) -> list[Any]:
        return [i for r, i in enumerate(self.indices) if not self.done[r]]


class Pipeline(BatchHandoff):
    """Shared state of one epoch, used by the consumer thread, the event loop and
    the decode threads."""

    def __init__(self, config: PassConfig, *, dataset: Any, caps: Capabilities,
                 plan: Iterator[Any], layouts: LayoutHolder, runtime: Runtime,
                 memory: BatchMemory, copy: DeviceTransfer | None) -> None:
        super().__init__(config, runtime=runtime, copy=copy, memory=memory)
        self.memory: BatchMemory = memory
        self.dataset = dataset
        self.caps = caps
        self.in_order = config.in_order
        # with reads on the loop, the plan is drawn ahead of the decode window and
        # its reads started (see readahead.py); readahead_bytes=0 turns that off
        self.readahead: ReadAhead | None = None
        if caps.use_fetch and config.readahead_bytes != 0 and caps.fetch is not None:
            plan = self.readahead = ReadAhead(
                plan, auto_collation=config.auto_collation, fetch=caps.fetch,
                call_in_loop=runtime.call_in_loop, io_concurrency=config.io_concurrency,
                budget=config.readahead_bytes, min_items=config.prefetch)
        self.plan = plan
        self.layouts = layouts
        self.io_concurrency = config.io_concurrency
        self.use_fetch = caps.use_fetch
        self.use_getitems = caps.getitems is not None and config.auto_collation
        self.ring_ok = (config.default_collate and config.auto_collation
                        and not self.use_getitems)
        self._fetch_queue: asyncio.Queue | None = None
        self._fetch_workers: list[asyncio.Task] = []
        # set by the loader after construction: its thread tuner and this pass's gate
        self.tuner: Tuner | None = None
        self._gate: Gate | None = None
        self.row_writer: tuple[Layout, Any] | None = None  # rowtasks' cached writer
        # set by the loader: the process stage batches should go to now (None: threads)
        self.stage_for: Callable[[], Any] | None = None
        self.stage: Any = None   # the process stage this pass used
        self._stage_asked = False
        # the first tasks' (rows, wall, cpu) while they run alone (see sized)
        self.sizing: list[tuple[int, float, float]] | None = None
        self._sizing_checked = False
        # then the tasks run side by side (see sized); the gate held at 0 after them
        # until the consumer has started the process stage (see _start_stage)
        self.pairing: _Pairing | None = None
        self._gate_held = False
        self.acct.resources = self._resources()
        if isinstance(copy, CopyStream):  # (tests drive the ring with stand-ins)
            self.acct.h2d_source = copy.drain_timings
        if self.readahead is not None:  # reads run there, not in _fetch_one
            self.readahead.on_read = functools.partial(self.acct.add_wall, FETCH)

    @property
    def gate(self) -> Gate | None:
        """How many decode tasks of this pass run at once (None: every thread).  The
        decode pool's threads pass it before they take a task (``TaskPool.admit``)."""
        return self._gate

    @gate.setter
    def gate(self, gate: Gate | None) -> None:
        self._gate = gate
        self.runtime.pool.admit(gate)

    def _resources(self) -> tuple[Resource, ...]:
        """Which stages share which capacity (for the accounting's verdict)."""
        threads = self.runtime.num_threads
        res: tuple[Resource, ...]
        if self.use_fetch:
            res = (Resource("io", (FETCH,), self.io_concurrency),
                   Resource("threads", (DECODE, ASSEMBLE), threads))
        else:
            res = (Resource("threads", (FETCH, DECODE, ASSEMBLE), threads),)
        return res + ((Resource("copy", (H2D,), 1),) if self.copy is not None else ())

    # ------------------------------------------------------------------ consumer
    def _ahead(self) -> int:
        """How many batches may be outstanding now.

        One until the consumer has taken the pass's first batch: that batch gets
        every thread (no later batch competes with its last samples for the
        cores), and by then its samples have shown whether batches can be
        written in place, so the batches after it are.  With reads on the event
        loop, latency matters more than cores: every batch's reads start at once
        (those planned before the layout was known are collated into buffers).
        Out of order (``in_order=False``) too: a slow first batch must not hold
        back the others, which is what out-of-order delivery is for.  And once a
        process stage runs with the layout known: each worker takes its tasks in
        order, so later batches do not compete with the first one's rows, and are
        written in place; with one batch ahead, the workers waited (15-30 ms on
        workload (c)) between finishing the first batch's rows and the consumer
        planning the next ones.
        """
        ahead = self.taken > 0 or self.use_fetch or not self.in_order \
            or (self.stage is not None and self.layouts.decided)
        return self.prefetch if ahead else 1

    def _room(self) -> bool:
        return not self.exhausted and self.submitted - self.taken < self._ahead()

    def top_up(self) -> None:
        """Submit planned batches until enough are outstanding (consumer thread)."""
        while self._room():
            try:
                item = next(self.plan)
            except StopIteration:
                with self.cond:
                    self._plan_exhausted()
                    self.cond.notify_all()
                return
            except Exception as e:  # noqa: BLE001 - a sampler's error, raised at its batch
                b = Batch(self.submitted, [], "plan")
                b.error = e
                self.sizes.append(0)
                self.submitted += 1
                with self.cond:
                    self._plan_exhausted()
                self._mark_ready(b)
                return
            indices = list(item) if self.auto_collation else [item]
            self._submit(Batch(self.submitted, indices, self._mode_for(len(indices))))

    def _mode_for(self, n: int) -> str:
        if self.use_getitems:
            return "batch"
        if self.ring_ok and self.layouts.layout is not None:
            return "ring"
        return "collate"

    def _submit(self, b: Batch) -> None:
        if b.mode == "ring":
            b.layout = self.layouts.layout
            assert b.layout is not None  # a ring batch's layout is known
            ring = self.memory.ring(b.layout, b.n) if self.copy is not None else None
            if ring is not None:
                b.slot = ring.acquire()
                b.bufs = b.slot.bufs
            # host buffers are taken when the batch's first row is written (_rows_of):
            # by then the consumer has usually dropped an older batch, whose buffers
            # the pool then hands out again, so one set fewer is in use
            if b.bufs is not None:
                b.views = b.layout.numpy_views(b.bufs)
        self.sizes.append(b.n)
        self.submitted += 1
        with self.cond:
            self._tracked[b.k] = b
        if b.n == 0:
            self._finish(b)
        elif b.mode == "batch":
            self._submit_task(self._run_getitems, b)
        elif self.use_fetch:
            if not self.runtime.call_in_loop(self._enqueue_fetches, b):
                self._abandon(b)
        else:
            stage = self.stage_for() if self.stage_for is not None else None
            if stage is not None and processes.submit_batch(self, stage, b):
                self._use_stage(stage)
                return
            start = 0
            running = self.gate.limit if self.gate is not None else self.runtime.num_threads
            if not self._sizing_checked:
                self._sizing_checked = True
                if self._start_sizing():
                    # one row per sizing task: what a row costs is known after two
                    # rows, not after two runs of a quarter batch on one thread
                    start = min(SIZING_TASKS, b.n - 1)
                    running = self.runtime.num_threads  # every thread runs after them
            # runs of rows per pool task, sized by the measured cost of a row: tiny
            # samples in batch-sized tasks (see rowtasks, autotune.rows_per_task)
            t = self.tuner
            if self.gate is None and running == 1:
                # one pinned thread: splitting the batch only adds tasks (a queue
                # hand-off, a report, the bookkeeping and a deferred write each)
                step = b.n
            else:
                step = rows_per_task(b.n, running, t.row_cost_s if t is not None else None,
                                     t.row_cpu_s if t is not None else None)
            bounds = [(lo, lo + 1) for lo in range(start)] + \
                [(lo, min(lo + step, b.n)) for lo in range(start, b.n, step)]
            for lo, hi in bounds:
                if self.runtime.submit(rowtasks.run_rows, self, b, lo, hi) is None:
                    self._abandon(b)
                    return

    def _use_stage(self, stage: Any) -> None:
        """Rows of this pass go to ``stage`` from now on: batches submitted later
        (``processes.submit_batch``) and the row tasks queued for the threads, taken
        back from the pool in the stage's sizes (``processes.take_over_queued``;
        one a thread took meanwhile is handed over by ``rowtasks.run_rows``)."""
        first = self.stage is None
        if first:  # the samples' capacity is the workers now
            self.acct.gate = None
            self.acct.resources = (Resource("processes", (FETCH, DECODE, ASSEMBLE),
                                            stage.num_workers),
                                   *self.acct.resources[1:])
        self.stage = stage
        if first:
            moved = processes.take_over_queued(self, stage)
            if moved:
                log.debug("asyncfeed: %d queued rows moved to the process stage", moved)

    def want_stage(self) -> bool:
        """The tuner found that samples should run in worker processes (any thread):
        the consumer starts the stage the next time it waits for a batch (or at
        its next submit), not when the batches already planned are done.  False
        if it was asked before (or cannot start in this pass)."""
        if self.stage_for is None or self._stage_asked or self.stage is not None:
            return False
        self._stage_asked = True
        self.call_waiting(self._start_stage)
        return True

    def _start_stage(self) -> None:
        """(consumer thread, see :meth:`want_stage`) Start the stage, if it may run;
        then let the decode threads go again if the pair measure held them (they
        hand the tasks queued for them to the stage)."""
        try:
            if self.stopping or self.stage is not None or self.stage_for is None:
                return
            stage = self.stage_for()
            if stage is not None:
                self._use_stage(stage)
                self.top_up()  # more batches may be outstanding now (see _ahead)
        finally:
            self._release_gate()

    def _release_gate(self) -> None:
        """Let the threads the pair measure held at the gate run again (idempotent)."""
        with self.cond:
            held, self._gate_held = self._gate_held, False
        if held and self.gate is not None and self.tuner is not None:
            self.gate.set_limit(self.tuner.limit)

    def _start_sizing(self) -> bool:
        """On the first pass of a loader whose thread count adapts (nothing measured
        yet), let the first ``SIZING_TASKS`` tasks run alone: what a row costs,
        measured without other threads competing for the GIL, decides whether the
        pass runs one thread or all of them (see :meth:`sized`).  True if it does."""
        t, g = self.tuner, self.gate
        if t is None or g is None or not t.adaptive or t.moves or t.row_cost_s is not None \
                or g.limit <= 1:
            return False
        self.sizing = []
        g.set_limit(1)
        return True

    def sized(self, rows: int, wall: float, cpu: float) -> None:
        """A task that ran alone (see :meth:`_start_sizing`) loaded ``rows`` rows in
        ``wall`` seconds using ``cpu`` seconds (decode thread).  After
        ``SIZING_TASKS`` of them (one row each), or one more where those rows cost
        less than ``TINY_ROW_CPU_S`` (the next task, of many rows, reads a warm
        row's cost: see below), by the least CPU a row took in any of them: rows
        cheaper than ``INLINE_ROW_CPU_S`` (at least
        ``TINY_ON_CORE`` of the time on a core) are loaded by the consumer while it
        waits, no thread running (``Tuner.run_inline``); tiny rows (less CPU than
        ``TINY_ROW_CPU_S``) make the tuner run one thread for ``TINY_HOLD`` rounds
        before it probes for more; anything else lets every running thread go
        again.  The tuner learns what a row costs alone (``Tuner.sized``)."""
        with self.cond:
            got = self.sizing
            if got is None or rows <= 0:
                return
            got.append((rows, wall, cpu))
            if len(got) < SIZING_TASKS:
                return
            if len(got) == SIZING_TASKS and all(r == 1 for r, _, _ in got) \
                    and min(c for _, _, c in got) < TINY_ROW_CPU_S:
                # cheap rows, read one at a time: the readings are mostly the first
                # runs of cold code (a no-op row read 5-8 us in its first two one-row
                # tasks, 2 us from the sixth on); the next task, of many rows, alone
                # too, says what a row costs once warm
                return
            self.sizing = None
        row_cpu = min(c / r for r, _, c in got)
        on_core = max(c / w for _, w, c in got if w > 0) if any(w > 0 for _, w, _ in got) \
            else 1.0
        tuner, gate = self.tuner, self.gate
        assert tuner is not None and gate is not None  # sizing starts only with both
        try:
            self._after_sizing(tuner, gate, row_cpu, on_core)
        except BaseException:
            gate.set_limit(tuner.limit)  # the gate is at 1: every thread runs again
            raise

    def _after_sizing(self, tuner: Tuner, gate: Gate, row_cpu: float,
                      on_core: float) -> None:
        """(decode thread, see :meth:`sized`) What the rows measured alone decide."""
        if row_cpu < INLINE_ROW_CPU_S and on_core >= TINY_ON_CORE:
            tuner.run_inline(f"a row costs {row_cpu * 1e6:.1f} us of CPU, measured alone")
            with self.cond:
                self.inline = True
                self.cond.notify_all()  # a consumer already waiting runs the tasks now
            return
        if row_cpu < TINY_ROW_CPU_S and on_core >= TINY_ON_CORE:
            tuner.start_with(1, f"a row costs {row_cpu * 1e6:.0f} us of CPU, measured alone: "
                                "one thread", hold=TINY_HOLD)
        elif self.stage_for is not None and self.stage is None and not self._stage_asked \
                and tuner.may_pair(row_cpu, on_core):
            with self.cond:
                self.pairing = _Pairing(row_cpu, on_core, tuner.run_delay_now())
            gate.set_limit(PAIR_THREADS)
            return
        tuner.sized(row_cpu, on_core)
        gate.set_limit(tuner.limit)

    def pair_task_starts(self) -> bool:
        """(decode thread, at a task's start) Whether the task counts in the pair
        measure (see :meth:`sized`); the first to start ``PAIR_S`` after the
        measure began closes it: no thread takes a task after its current one."""
        with self.cond:
            pr = self.pairing
            if pr is None:
                return False
            pr.running += 1
            if not pr.closed and time.perf_counter() - pr.t0 >= PAIR_S:
                self._close_pairing(pr)
            return True

    def _close_pairing(self, pr: _Pairing) -> None:
        pr.closed = True
        if self.gate is not None:
            self.gate.set_limit(0)

    def drop_pairing(self) -> None:
        """Give up the pair measure (its bookkeeping failed): every running thread goes
        again (idempotent, any thread)."""
        with self.cond:
            pr, self.pairing = self.pairing, None
            held, self._gate_held = self._gate_held, False
        if (pr is not None or held) and self.gate is not None and self.tuner is not None:
            self.gate.set_limit(self.tuner.limit)

    def paired(self, rows: int, wall: float, cpu: float) -> None:
        """(decode thread) A task counted in the pair measure ended: ``rows`` rows in
        ``wall`` seconds, ``cpu`` of them on a core.  Once the measure is closed
        and its tasks are done, the tuner judges it (``Tuner.paired``).  Where it
        finds the GIL and the consumer waits for a batch, the threads stay at the
        gate (none runs: no wait before the fork) until the consumer has started
        the process stage; else every running thread goes again."""
        with self.cond:
            pr = self.pairing
            if pr is None:
                return
            pr.running -= 1
            pr.rows += rows
            pr.wall += wall
            pr.cpu += cpu
            if not pr.closed and time.perf_counter() - pr.t0 >= PAIR_S:
                self._close_pairing(pr)  # this thread leaves the gate after its task
            if not pr.closed or pr.running > 0:
                return
            self.pairing = None
            consumer_waits = self._awaited is not None
        tuner, gate = self.tuner, self.gate
        assert tuner is not None and gate is not None  # pairing starts only with both
        try:
            self._judge_pair(tuner, gate, pr, consumer_waits)
        except BaseException:
            gate.set_limit(tuner.limit)  # the gate is at 0: never leave the threads parked
            raise

    def _judge_pair(self, tuner: Tuner, gate: Gate, pr: _Pairing,
                    consumer_waits: bool) -> None:
        """(decode thread, see :meth:`paired`) The closed pair ``pr`` measured again,
        or judged: the gate (at 0 now) back at the tuner's limit, or held at 0
        for the consumer to start the process stage."""
        span = time.perf_counter() - pr.t0
        end = tuner.run_delay_now()
        delay = None if end is None or pr.delay0 is None else end - pr.delay0
        queued = delay is not None and delay >= PAIR_QUEUED * pr.wall
        marginal = tuner.pair_marginal(span, pr.wall, pr.cpu, delay)
        undecided = tuner.pair_undecided(span, pr.wall, pr.cpu, delay)
        convoys = pr.convoys + tuner.pair_convoy(span, pr.wall, pr.cpu)
        unheard = tuner.pair_gil(span, pr.wall, pr.cpu, delay) and not tuner.probe_can_tell()
        if (queued or marginal or undecided or unheard
                or not tuner.pair_overlapped(span, pr.wall)) \
                and pr.round < PAIR_ROUNDS and not tuner.convoys_tell(convoys):
            # woken by a thread still running, the other thread was queued on that
            # thread's core (the scheduler moves it within a few milliseconds), or
            # started too late to overlap it: the pair says nothing about the GIL yet;
            # or it read the GIL by a small margin only, or before the GIL probe can
            # say whether it found the GIL held, or neither the GIL nor free: once
            # more, unless its convoys already tell (Tuner.convoys_tell)
            log.debug("asyncfeed: two threads side by side waited %.1f ms for a core, "
                      "%.1f ms of tasks (%.1f ms on a core) in %.1f ms%s: measuring again",
                      (delay or 0.0) * 1e3, pr.wall * 1e3, pr.cpu * 1e3, span * 1e3,
                      ", the GIL by a small margin" if marginal
                      else ", the GIL before the probe can say" if unheard
                      else ", neither the GIL nor free" if undecided else "")
            with self.cond:
                if not self.stopping:
                    self.pairing = _Pairing(pr.row_cpu, pr.on_core, end, pr.round + 1,
                                            convoys)
                    gate.set_limit(PAIR_THREADS)
                    return
        tuner.sized(pr.row_cpu, pr.on_core)
        if tuner.paired(pr.rows, span, pr.wall, pr.cpu, delay, convoys=convoys) and consumer_waits:
            with self.cond:
                self._gate_held = True
            if self.want_stage():
                return
            self._release_gate()
            return
        gate.set_limit(tuner.limit)

    def _submit_task(self, fn: Callable[..., None], *args: Any) -> None:
        if self.runtime.submit(fn, *args) is None:
            self._abandon(args[0])

    def _abandon(self, b: Batch) -> None:
        b.error = b.error or LoaderClosedError("the loader was closed")
        self._mark_ready(b)

    def _ended(self) -> None:
        if self.readahead is not None:
            self.readahead.close()
        if self.gate is not None:
            self.gate.open()  # no decode thread may stay parked when the pool is joined
        if self.stage is not None:
            self.stage.drop_pipeline(self)

    # ------------------------------------------------------------- event loop
    def _enqueue_fetches(self, b: Batch) -> None:
        if self.stopping or self.runtime.closed:
            return  # the pass is over: start no new fetch workers
        if self.readahead is not None:
            self.readahead.deliver(b, self._raw_ready, self._fetch_failed)
            return
        if self._fetch_queue is None:
            self._fetch_queue = asyncio.Queue()
            n = max(1, self.io_concurrency)
            self._fetch_workers = [asyncio.ensure_future(self._fetch_worker())
                                   for _ in range(n)]
        q = self._fetch_queue
        for row, idx in enumerate(b.indices):
            q.put_nowait((b, row, idx))

    async def _fetch_worker(self) -> None:
        """Fetch queued samples until the pass ends (the loop cancels the worker).

        Cancellation ends the worker by returning, not raising: a task that ends
        with an exception keeps it, and the exception's traceback holds this
        pipeline (and its batches) in a reference cycle until a garbage collection.
        """
        q = self._fetch_queue
        assert q is not None
        try:
            while True:
                item = await q.get()
                await self._fetch_one(*item)
                del item  # an idle worker must not keep its last batch alive
        except asyncio.CancelledError:
            return

    async def _fetch_one(self, b: Batch, row: int, idx: Any) -> None:
        if self.stopping:
            return
        t0 = time.perf_counter()
        try:
            raw = await self.caps.fetch(idx)  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            self._note_failure(b, row, idx, e)
        else:
            self.acct.add_wall(FETCH, time.perf_counter() - t0)
            self._raw_ready(b, row, idx, raw)
            return
        self._one_done(b, row)  # outside the handler (see _run_sample)

    def _raw_ready(self, b: Batch, row: int, idx: Any, raw: Any) -> None:
        """Decode a fetched sample in the pool (loop thread)."""
        if self.stopping:
            return
        if self.runtime.submit(rowtasks.run_sample, self, b, row, idx, raw) is None:
            b.error = b.error or LoaderClosedError("the loader was closed")
            self._one_done(b, row)

    def _fetch_failed(self, b: Batch, row: int, idx: Any, e: BaseException) -> None:
        """A read-ahead read of sample ``row`` of ``b`` raised ``e`` (loop thread)."""
        if self.stopping:
            return
        self._note_failure(b, row, idx, e)
        self._one_done(b, row)

    # ---------------------------------------------------------- decode threads
    def _load(self, b: Batch, row: int, idx: Any, raw: Any) -> Any:
        caps = self.caps
        out = None
        if b.mode == "ring" and caps.decode_into is not None:
            assert b.layout is not None  # a ring batch's layout is known
            out = b.layout.row_out(self._rows_of(b), row)
        acct = self.acct
        t = acct.begin()
        if raw is _NO_RAW:
            if caps.read is None:
                sample = self.dataset[idx]
                acct.end(DECODE, t)
                return sample
            raw = caps.read(idx)
            t = acct.end(FETCH, t)
        if out is not None:
            sample = caps.decode_into(raw, idx, out)  # type: ignore[misc]
        else:
            sample = caps.decode(raw, idx)  # type: ignore[misc]
        acct.end(DECODE, t)
        return sample

    def _run_sample(self, b: Batch, row: int, idx: Any, raw: Any) -> None:
        if self.stopping:
            return
        try:
            self._place(b, row, idx, raw)
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            self._note_failure(b, row, idx, e)
        # reported done only here, once the sample's locals are gone: this thread may
        # wait a while for the GIL after handing the batch over, and must not hold its
        # decoded row (a view of the batch's buffer) or an exception (whose traceback
        # holds that row) meanwhile
        self._one_done(b, row)

    def _place(self, b: Batch, row: int, idx: Any, raw: Any) -> None:
        """Load sample ``row`` of ``b`` and put it in its row (ring) or ``b.samples``."""
        sample = self._load(b, row, idx, raw)
        del raw
        if b.mode == "ring":
            b.samples[row] = sample   # kept in case the batch must be collated instead
            t = self.acct.begin()
            assert b.layout is not None  # a ring batch's layout is known
            try:
                b.layout.write_row(self._rows_of(b), row, sample, b.views)
            except LayoutMismatch:
                # shapes vary: collate this batch like DataLoader, and stop using rows
                b.mismatch = True
                self.layouts.give_up()
            self.acct.end(ASSEMBLE, t, 0)  # counted per batch, in _finish
        else:
            b.samples[row] = sample
            if not self.layouts.decided:
                self.layouts.offer(sample)

    def _rows_of(self, b: Batch) -> list[Any]:
        """The batch's buffers, taken from the host pool on first use (any thread)."""
        if b.bufs is None:
            with self.cond:
                if b.bufs is None:
                    assert b.layout is not None  # a ring batch's layout is known
                    bufs, b.views = self.memory.host_buffers(b.layout, b.n)
                    b.bufs = bufs
        return b.bufs

    def _note_failure(self, b: Batch, row: int, idx: Any, e: BaseException) -> None:
        with self.cond:
            b.failures.append((row, idx, e))

    def _one_done(self, b: Batch, row: int) -> None:
        with self.cond:
            b.done[row] = 1
            b.remaining -= 1
            last = b.remaining == 0
        if last:
            self._finish(b)

    def _run_getitems(self, b: Batch) -> None:
        if self.stopping:
            return
        t = self.acct.begin()
        try:
            b.samples = self.caps.getitems(b.indices)  # type: ignore[misc]  # handed to collate_fn as is
        except BaseException as e:  # noqa: BLE001
            b.error = e
        self.acct.end(DECODE, t, b.n)
        b.done[:] = b"\x01" * b.n
        b.remaining = 0
        self._finish(b)

    def _finish(self, b: Batch) -> None:
        """Assemble the batch and start its copy (in the thread that completed it).

        Once the pass is over nobody takes the batch: it is only marked ready (a
        thread abandoned at exit must not start a collate or a copy)."""
        t = self.acct.begin()
        try:
            if b.deferred and b.error is None and not b.mismatch and not self.stopping:
                rowtasks.write_deferred(self, b)
            if self.stopping:
                b.error = b.error or LoaderClosedError("the pass was closed")
            elif b.n == 0:
                pass  # a batch a resumed checkpoint had already taken
            elif b.error is None and not b.failures:
                if b.mode == "ring" and not b.mismatch:
                    assert b.layout is not None and b.bufs is not None  # a ring batch's layout is known
                    # a slot's tensors are the ring's; the pool's and the stage's
                    # buffers are lent to this batch alone
                    host = b.layout.assemble(b.bufs, b.n, own=b.slot is None)
                    b.samples = [None] * b.n  # rows hold the data now
                    b.views = None
                else:
                    host = self._collate_late(b)
                b.output, b.event = self.to_target(host)
        except BaseException as e:  # noqa: BLE001
            b.error = e
        if b.n:
            self.acct.end(ASSEMBLE, t)
        self._mark_ready(b)

    def _collate_late(self, b: Batch) -> Any:
        """Collate a batch submitted before the layout was known: into reused host
        buffers when the samples fit it (NumPy copies, bit-identical to
        ``default_collate``), else with the collate function."""
        layout = self.layouts.layout
        if b.mode == "collate" and self.ring_ok and layout is not None:
            bufs, views = self.memory.host_buffers(layout, b.n)
            try:
                for row, sample in enumerate(b.samples):
                    layout.write_row(bufs, row, sample, views)
            except LayoutMismatch:
                pass
            else:
                return layout.assemble(bufs, b.n, own=True)
        return self.collate(b.samples)


def sample_source(dataset: Any, idx: Any) -> str | None:
    """The path or URL the dataset names for ``idx`` (None when it cannot)."""
    if isinstance(dataset, NamedSamples):
        try:
            return dataset.sample_source(idx)
        except Exception:  # noqa: BLE001 - a name is a courtesy, not a requirement
            return None
    return None


def sample_error(dataset: Any, idx: Any, e: BaseException, batch: int | None) -> BaseException:
    """What the consumer raises for sample ``idx``'s error ``e``: an exception of
    ``e``'s type that is also a :class:`SampleError` naming the sample (see
    ``rebuild_error``); KeyboardInterrupt and SystemExit as they are."""
    if is_fatal(e) or isinstance(e, SampleError):
        return rebuild_error(e, idx, None, batch)
    return rebuild_error(e, idx, sample_source(dataset, idx), batch)
