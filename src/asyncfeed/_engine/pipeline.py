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
from dataclasses import dataclass
from typing import Any

from .._errors import LoaderClosedError, SampleError, is_fatal, rebuild_error
from .._memory.device import CopyStream
from .._memory.slots import Slot
from ..protocols import DeviceTransfer, NamedSamples
from . import processes, rowtasks
from .accounting import ASSEMBLE, DECODE, FETCH, H2D, Resource
from .capabilities import Capabilities
from .chooser import Chooser
from .handoff import BatchHandoff, BatchMemory, PassConfig
from .._memory.layout import Layout, LayoutMismatch
from .readahead import ReadAhead
from .policy import Candidate, Mode
from .runtime import Runtime
from .tasksize import Gate, RowCost, rows_per_task

log = logging.getLogger("asyncfeed")


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


@dataclass(frozen=True)
class PassExecution:
    """Where a pass's rows may run, given when it is built: the gate its decode
    threads pass (None: every thread runs), what starts or returns the loader's
    process stage (None: no processes), the loader's row cost means, and its
    chooser (None: the current setting stays)."""

    gate: Gate | None
    row_cost: RowCost
    stage_for: Callable[[], Any] | None = None
    chooser: Chooser | None = None


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
                 memory: BatchMemory, copy: DeviceTransfer | None,
                 execution: PassExecution) -> None:
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
        self.row_writer: tuple[Layout, Any] | None = None  # rowtasks' cached writer
        # where rows run: the chooser applies its candidates through apply()
        self.row_cost = execution.row_cost
        self._gate = execution.gate
        runtime.pool.admit(execution.gate)
        self._stage_for = execution.stage_for
        self._chooser = execution.chooser
        self.stage: Any = None      # the process stage rows go to now (None: threads)
        self._stages: list[Any] = []  # every stage this pass used (dropped at its end)
        self.rows_completed = 0     # rows loaded or failed so far (under cond) ...
        self.completions = 0        # ... reported by this many tasks or worker replies,
        self.last_completion = 0.0  # ... the last at this perf_counter() time
        self.acct.resources = self._resources()
        self._thread_resources = self.acct.resources
        if isinstance(copy, CopyStream):  # (tests drive the ring with stand-ins)
            self.acct.h2d_source = copy.drain_timings
        if self.readahead is not None:  # reads run there, not in _fetch_one
            self.readahead.on_read = functools.partial(self.acct.add_wall, FETCH)

    @property
    def gate(self) -> Gate | None:
        """How many decode tasks of this pass run at once (None: every thread).  The
        decode pool's threads pass it before they take a task (``TaskPool.admit``)."""
        return self._gate

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
        written in place; with one batch ahead, the workers would wait between
        finishing the first batch's rows and the consumer planning the next ones.

        Twice ``prefetch`` while the batch the consumer waits for (in order; no
        device copy, whose slot ring has ``prefetch`` slots) still waits for a
        read: a retried read (a 503's backoff) would otherwise hold the decode
        window full of finished batches and the threads idle, while the raw bytes
        of the batches behind it are there (see readahead.py).  The window's memory
        bound is then twice ``prefetch`` batches.
        """
        ahead = self.taken > 0 or self.use_fetch or not self.in_order \
            or (self.stage is not None and self.layouts.decided)
        if not ahead:
            return 1
        if self.readahead is not None and self.in_order and self.copy is None \
                and self.readahead.reading(self.taken):
            return 2 * self.prefetch
        return self.prefetch

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
            stage = self.stage
            if stage is not None:
                if processes.submit_batch(self, stage, b):
                    return
                self._stage_stopped()
            running = self.gate.limit if self.gate is not None else self.runtime.num_threads
            if self._chooser is not None and self._chooser.exploring:
                # while candidates are measured, tasks are cut for the most threads
                # that may run: a batch queued as one task under one thread would
                # keep a second thread idle in the window that measures two
                running = self.runtime.num_threads
            if running <= 1:
                # one thread (or the consumer, inline): splitting the batch only adds
                # tasks (a queue hand-off, a report, the bookkeeping and a deferred write)
                step = b.n
            else:
                # runs of rows per pool task, sized by the measured cost of a row:
                # tiny samples in batch-sized tasks (see rowtasks, tasksize.rows_per_task)
                step = rows_per_task(b.n, running, self.row_cost.wall_s, self.row_cost.cpu_s)
            for lo in range(0, b.n, step):
                if self.runtime.submit(rowtasks.run_rows, self, b, lo, min(lo + step, b.n)) \
                        is None:
                    self._abandon(b)
                    return

    # ------------------------------------------------------------- execution
    def start(self) -> None:
        """(consumer thread, at ``iter()``) Run the chooser's current candidate on
        this pass, then plan the first batches."""
        if self._chooser is not None:
            self._chooser.begin_pass(self)
        self.top_up()

    def completed(self) -> tuple[int, int, float]:
        """(rows, completions, time of the last) so far (see
        ``chooser.ExecutionControl``)."""
        return self.rows_completed, self.completions, self.last_completion

    def waited(self) -> float:
        """The consumer's wait for batches so far, the wait in progress included (see
        ``chooser.ExecutionControl``; an inline consumer loads rows in it)."""
        since = self.waiting_since
        return self.acct.consumer_wait() + (time.perf_counter() - since if since else 0.0)

    def draining(self) -> bool:
        """Whether a process stage this pass left still runs rows of it (see
        ``chooser.ExecutionControl``)."""
        return any(s is not self.stage and s.holds(self) for s in self._stages)

    def count_done(self, rows: int) -> None:
        """``rows`` rows were reported done by one task or reply (call with ``cond``
        held)."""
        self.rows_completed += rows
        self.completions += 1
        self.last_completion = time.perf_counter()

    def apply(self, candidate: Candidate) -> bool:
        """Run the rows of batches not yet started under ``candidate`` (consumer
        thread; see ``chooser.ExecutionControl``).  Rows already running finish
        where they are; row tasks still queued for the threads go to a process
        stage when processes start (``processes.take_over_queued``)."""
        if self.stopping:
            return True
        gate = self.gate
        if candidate.mode is Mode.PROCESSES:
            stage = self._stage_for() if self._stage_for is not None else None
            if stage is None:
                if gate is not None and gate.limit == 0 and not self.inline:
                    gate.set_limit(self.runtime.num_threads)  # someone must run the rows
                return False
            self._use_stage(stage)
            with self.cond:
                self.inline = False
                self.cond.notify_all()
            if gate is not None:
                gate.set_limit(max(1, gate.limit))  # threads hand their queued rows over
            self.top_up()  # more batches may be outstanding now (see _ahead)
            return True
        self._leave_stage()
        inline = candidate.mode is Mode.INLINE
        if gate is not None:
            gate.set_limit(0 if inline else candidate.count)
        with self.cond:
            self.inline = inline
            self.cond.notify_all()  # a consumer already waiting runs the tasks now
        return True

    def _use_stage(self, stage: Any) -> None:
        """Rows of this pass go to ``stage`` from now on: batches submitted later
        (``processes.submit_batch``) and the row tasks queued for the threads, taken
        back from the pool in the stage's sizes (``processes.take_over_queued``;
        one a thread took meanwhile is handed over by ``rowtasks.run_rows``)."""
        if self.stage is stage:
            return
        # the samples' capacity is the workers now
        self.acct.gate = None
        self.acct.resources = (Resource("processes", (FETCH, DECODE, ASSEMBLE),
                                        stage.num_workers), *self._thread_resources[1:])
        self.stage = stage
        if stage not in self._stages:
            self._stages.append(stage)
        moved = processes.take_over_queued(self, stage)
        if moved:
            log.debug("%d queued rows moved to the process stage", moved)

    def tick(self) -> float:
        """(consumer thread, see ``BatchHandoff.tick``) A stage that stopped is left;
        then the chooser's tick."""
        stage = self.stage
        if stage is not None and not stage.usable:
            self._stage_stopped()
        return self._chooser.tick() if self._chooser is not None else 1.0

    def _stage_stopped(self) -> None:
        """(consumer thread) The stage took no more work (a worker died): rows run
        in this process again, on every thread, and the chooser counts processes
        out."""
        stage = self.stage
        if stage is not None and self._chooser is not None:
            self._chooser.note(f"processes stopped ({stage.broken})")
        self._leave_stage()
        if self.gate is not None:
            self.gate.set_limit(self.runtime.num_threads)
        with self.cond:
            self.inline = False
        if self._chooser is not None:
            self._chooser.lost(Candidate(Mode.THREADS, self.runtime.num_threads))

    def _leave_stage(self) -> None:
        """Rows of batches submitted from now on run in this process again; the
        stage's rows in flight finish there."""
        if self.stage is None:
            return
        self.stage = None
        self.acct.resources = self._thread_resources
        self.acct.gate = self.gate

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
        for stage in self._stages:
            stage.drop_pipeline(self)
        if self._chooser is not None:
            self._chooser.end_pass(self)

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
            self.count_done(1)
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
        with self.cond:
            self.count_done(b.n)
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
                # the batch holds its output now; this frame must not while it waits
                # for the hand-over below (the consumer may drop the output meanwhile)
                del host
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
        return self.collate(rowtasks.restored(b))


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
