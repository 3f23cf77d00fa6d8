"""One pass over a map-style dataset: the coordinator of its stages.

A pass is a chain of stages, each a module with one job, that a batch goes
through in order:

1. **plan** (here, :meth:`Pipeline.top_up`): the consumer's thread draws the
   index plan and makes a :class:`~.batch.Batch` while fewer than ``prefetch``
   are outstanding (one, until the consumer has taken the first batch, unless
   reads run on the event loop);
2. **fetch** (``fetching``): with ``async fetch``, each sample's bytes are read
   on the event loop (``io_concurrency`` at once, or ahead of the plan by
   ``readahead``);
3. **rows** (``samples``, run by an executor of ``executors``: decode threads,
   the consumer inline, or worker processes): each sample is loaded and put
   into its row, written into the batch's host buffers (ring batches) or kept
   for the collate;
4. **assemble** (``assemble``): the thread that completes a batch makes it one
   host batch;
5. **transfer** (``transfer``): and starts its copy to the device;
6. **hand-off** (``handoff``): the batch is marked ready; the consumer takes it.

Errors are stored with the batch, never raised in a worker, and reach the
consumer at that batch.  The pipeline is made from a frozen
:class:`~.handoff.PassConfig`, its live collaborators (the dataset's
:class:`~.capabilities.Capabilities`, the plan, the loader's
:class:`~.handoff.BatchMemory` and device transfer, the runtime) and the
:class:`~.executors.Executors` its rows may run on.  It holds none of them
through the user's iterator, so dropping the iterator still closes the
pipeline (see ``loader``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._errors import LoaderClosedError
from .._memory.device import CopyStream
from ..protocols import DeviceTransfer
from .accounting import ASSEMBLE, DECODE, FETCH, H2D, PROCESSES, Resource
from .assemble import assemble
from .batch import WRITTEN, Batch, BatchMode
from .capabilities import Capabilities
from .completions import Completions
from .executors import Executors, RowExecutor
from .fetching import FetchStage
from .firstcall import FirstCall
from .handoff import BatchHandoff, BatchMemory, PassConfig
from .policy import Candidate, Handoff, Mode
from .processes import handover, transport
from .readahead import ReadAhead
from .runtime import Runtime
from . import gcpauses, rowtasks, samples
from .samples import LayoutHolder, SampleRows
from .tasksize import Gate
from .threadbound import retry_here

log = logging.getLogger("asyncfeed")

__all__ = ["Pipeline"]

#: rows of a collated batch sent through the workers' pickler to price their hand-off:
#: the cheapest of a few bounds it (see ``transport.travel_cost``)
_PROBE_ROWS = 4


@dataclass(frozen=True)
class _Collated:
    """The first batch a pass collated, of ``rows`` rows: what a worker that collates
    whole batches would send back (``Pipeline.handoff``)."""

    batch: Any
    rows: int


class Pipeline(BatchHandoff):
    """Shared state of one epoch, used by the consumer thread, the event loop and
    the decode threads (see the module docstring)."""

    def __init__(self, config: PassConfig, *, dataset: Any, caps: Capabilities,
                 plan: Iterator[Any], layouts: LayoutHolder, runtime: Runtime,
                 memory: BatchMemory, copy: DeviceTransfer | None,
                 executors: Executors, first_call: FirstCall,
                 probe_not_before: float | None = None) -> None:
        super().__init__(config, runtime=runtime, copy=copy, memory=memory)
        self.memory: BatchMemory = memory
        self.in_order = config.in_order
        self.layouts = layouts
        self.rows = SampleRows(dataset=dataset, caps=caps, layouts=layouts, memory=memory,
                               acct=self.acct, cond=self.cond, first_call=first_call)
        use_getitems = caps.getitems is not None and config.auto_collation
        self.ring_ok = config.default_collate and config.auto_collation and not use_getitems
        self._use_getitems = use_getitems
        self.use_fetch = caps.use_fetch
        # with reads on the loop, the plan is drawn ahead of the decode window and
        # its reads started (see readahead.py); readahead_bytes=0 turns that off
        self.readahead: ReadAhead | None = None
        if caps.use_fetch and config.readahead_bytes != 0 and caps.fetch is not None:
            plan = self.readahead = ReadAhead(
                plan, auto_collation=config.auto_collation, fetch=caps.fetch,
                call_in_loop=runtime.call_in_loop, io_concurrency=config.io_concurrency,
                budget=config.readahead_bytes, min_items=config.prefetch)
            self.readahead.on_read = functools.partial(self.acct.add_wall, FETCH)
        self.plan = plan
        self.io_concurrency = config.io_concurrency
        self.fetching = FetchStage(caps.fetch, config.io_concurrency, self.readahead) \
            if caps.use_fetch else None
        # where rows run: the chooser picks the executor through apply()
        self.executors = executors
        self.executor: RowExecutor = executors.threads
        self.row_cost = executors.row_cost
        self._chooser = executors.chooser
        runtime.pool.admit(executors.gate)
        self.stage: Any = None      # the process stage rows go to now (None: this process)
        # on_error="skip" re-makes batches of other rows (the next good ones): only
        # the rows of a batch then travel, never a batch a worker collated
        self.worker_collate = config.auto_collation and not config.default_collate \
            and not config.skip
        self._stages: list[Any] = []  # every stage this pass used (dropped at its end)
        # rows loaded or failed so far (under cond), as the chooser reads them: at
        # batch completions where a batch's reads go out together on the event loop
        self.completions = Completions(per_batch=caps.use_fetch)
        self._ahead_known = layouts.decided  # (cond) see rows_done
        self.rows_cpu_s = 0.0       # CPU the rows took in this process's threads (cond)
        self.workers_cpu_s = 0.0    # CPU they took in worker processes (the results thread)
        # the first rows of a collated batch, for what rows cost to travel back from
        # worker processes (handoff); () once taken, or where the chooser has it
        self._probe: list[Any] | tuple[()] | None = \
            None if self._chooser is not None and self._chooser.wants_handoff() else ()
        self.acct.resources = self._thread_resources = self._resources()
        self.acct.gate = executors.gate  # the running threads are the capacity
        if probe_not_before is not None:  # the loader's budget holds across passes
            self.acct.probe.not_before = probe_not_before
        if isinstance(copy, CopyStream):  # (tests drive the ring with stand-ins)
            self.acct.h2d_source = copy.drain_timings

    @property
    def gate(self) -> Gate:
        """How many decode tasks of this pass run at once.  The decode pool's
        threads pass it before they take a task (``TaskPool.admit``)."""
        return self.executors.gate

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

    # --------------------------------------------------------------- plan stage
    def ahead(self) -> int:
        """How many batches may be outstanding now.

        One until the layout is known (the pass's first rows read it off their
        sample, ``rows_done`` then has the waiting consumer plan the rest; a later
        pass of the loader knows it from the start), or the consumer has taken the
        first batch: the batches after it are then written in place.  Planned
        later, their tasks queue behind the first batch's (threads and workers
        take tasks in order), so they do not compete with its rows; they take a
        thread that would otherwise wait for the first batch's last rows, and
        their rows are under way while the consumer takes it.  With reads on the
        event loop, latency matters more than cores: every batch's reads start
        at once (those planned before the layout was known are collated into
        buffers).  Out of order (``in_order=False``) too: a slow first batch must
        not hold back the others, which is what out-of-order delivery is for.

        Twice ``prefetch`` while the batch the consumer waits for (in order; no
        device copy, whose slot ring has ``prefetch`` slots) still waits for a
        read: a retried read (a 503's backoff) would otherwise hold the decode
        window full of finished batches and the threads idle, while the raw bytes
        of the batches behind it are there (see readahead.py).  The window's memory
        bound is then twice ``prefetch`` batches.

        Under worker processes, where ``prefetch`` is the default and no device
        copy's ring of ``prefetch`` slots holds the batches: as many as keep every
        worker's tasks full (``ProcessStage.fill``).  The default gives each thread
        a few rows, while a worker's task carries about ``PROCESS_TASK_S`` of rows
        and a round trip through pipes, so each worker needs its next task waiting.
        That is at most ``WORKER_DEPTH`` batches a worker (a task is at most a
        batch), as DataLoader keeps ``prefetch_factor=2`` a worker, and no more
        shared-memory buffer sets than half the free space holds.
        """
        ahead = self.taken > 0 or self.use_fetch or not self.in_order or self.layouts.decided
        if not ahead:
            return 1
        if self.readahead is not None and self.in_order and self.copy is None \
                and self.readahead.reading(self.taken):
            return 2 * self.prefetch
        stage = self.stage
        if stage is not None and not self.config.prefetch_given and self.copy is None \
                and self.batch_size:
            return max(self.prefetch, stage.fill(self.batch_size, self.row_cost))
        return self.prefetch

    def _room(self) -> bool:
        return not self.exhausted and not self.stopping \
            and self.submitted - self.taken < self.ahead() and not self._direct()

    def top_up(self) -> None:
        """Submit planned batches until enough are outstanding (consumer thread)."""
        while self._room():
            b = self._plan_next()
            if b is None:
                return
            self._submit(b)

    def _plan_next(self) -> Batch | None:
        """The plan's next batch, counted (``submitted``, its size in ``sizes``) but
        given to no stage yet (consumer thread); None at the plan's end.  A
        sampler's error becomes a batch that carries it (``BatchMode.PLAN``), ready
        at once: None too."""
        try:
            item = next(self.plan)
        except StopIteration:
            with self.cond:
                self._plan_exhausted()
                self.cond.notify_all()
            return None
        except Exception as e:  # noqa: BLE001 - a sampler's error, raised at its batch
            b = Batch(self.submitted, [], BatchMode.PLAN)
            b.error = e
            self.sizes.append(0)
            self.submitted += 1
            with self.cond:
                self._plan_exhausted()
            self._mark_ready(b)
            return None
        indices = list(item) if self.auto_collation else [item]
        b = Batch(self.submitted, indices, self._mode_for())
        self.sizes.append(b.n)
        self.submitted += 1
        return b

    def _mode_for(self) -> BatchMode:
        if self._use_getitems:
            return BatchMode.BATCH
        if self.ring_ok and self.layouts.layout is not None:
            return BatchMode.RING
        return BatchMode.COLLATE

    def _ring_setup(self, b: Batch) -> None:
        """A ring batch's layout, and its slot where batches are copied to a device
        (consumer thread); host buffers are taken when its first row is written
        (``SampleRows.buffers``)."""
        b.layout = self.layouts.layout
        assert b.layout is not None  # a ring batch's layout is known
        ring = self.memory.ring(b.layout, b.n) if self.copy is not None else None
        if ring is not None:
            b.slot = ring.acquire()
            b.bufs = b.slot.bufs
            b.views = b.layout.numpy_views(b.bufs)

    def _submit(self, b: Batch) -> None:
        """Track ``b`` and start it on its first stage: the fetch stage, the
        dataset's ``__getitems__``, or the rows executor."""
        if b.mode is BatchMode.RING:
            self._ring_setup(b)
        with self.cond:
            self._tracked[b.k] = b
        if b.n == 0:
            self.complete(b)
        elif b.mode is BatchMode.BATCH:
            if self.runtime.submit(self._run_getitems, b) is None:
                self.abandon(b)
        elif self.fetching is not None:
            if not self.fetching.submit(self, b):
                self.abandon(b)
        elif not self.executor.submit(self, b):
            if self.executor.mode is Mode.PROCESSES:
                self._stage_stopped()
                if self.executor.submit(self, b):
                    return
            self.abandon(b)

    def _run_getitems(self, b: Batch) -> None:
        """(a decode-pool task) The whole batch from the dataset's ``__getitems__``."""
        if self.stopping:
            return
        t = self.acct.begin()
        try:
            # handed to collate_fn as is
            b.samples = self.rows.getitems(b.indices)  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001
            b.error = e
        end = self.acct.end(DECODE, t, b.n)
        self.rows_done(b, 0, b.n, end[1] - t[1])  # all its rows, as one task of rows

    def retry_failed_here(self, b: Batch) -> bool:
        """(consumer thread) The failed rows of ``b`` loaded again here where the data
        set is bound to this thread; whether any was (:func:`.threadbound.retry_here`)."""
        return self._chooser is not None and retry_here(b, self.rows.dataset, self._chooser)

    # ------------------------------------------------------------- execution
    def start(self) -> None:
        """(consumer thread, at ``iter()``) Run the chooser's current candidate on
        this pass, then plan the first batches."""
        if self._chooser is not None:
            self._chooser.begin_pass(self)
        self.top_up()

    def completed(self) -> tuple[int, int, float]:
        """(rows, completions, time of the last) so far (see
        ``chooser.ExecutionControl`` and ``completions``)."""
        return self.completions.reading()

    def waited(self) -> float:
        """The consumer's wait for batches so far, the wait in progress included (see
        ``chooser.ExecutionControl``; an inline consumer loads rows in it)."""
        since = self.waiting_since
        return self.acct.consumer_wait() + (time.perf_counter() - since if since else 0.0)

    def rows_cpu(self) -> float:
        """CPU seconds the pass's rows took in this process's threads, the consumer's
        included, so far (see ``chooser.ExecutionControl``)."""
        return self.rows_cpu_s

    def workers_cpu(self) -> float:
        """CPU seconds worker processes took on the pass's rows so far (see
        ``chooser.ExecutionControl``)."""
        return self.workers_cpu_s

    def process_cpu(self) -> float:
        """CPU seconds this process has taken, every thread (see
        ``chooser.ExecutionControl``)."""
        return time.process_time()

    def running(self) -> int:
        """Decode tasks running in the pool's threads now, or the places held at the
        gate, whichever is more (see ``chooser.ExecutionControl``)."""
        return max(self.runtime.pool.running(), self.gate.held)

    def full_collections(self) -> int:
        """Collections of the oldest generation this process ran so far (see
        ``chooser.ExecutionControl``)."""
        return gcpauses.count()

    def handoff(self, budget_s: float) -> Handoff | None:
        """What a row costs to travel back from a worker process: nothing where
        workers write the pass's rows in place (its batches are ring batches); a
        row's share of a whole batch where workers collate the batches (a user's
        ``collate_fn``: ``worker_collate``), measured on the first batch this pass
        collated; else measured on that batch's first rows, within ``budget_s`` of
        this thread's CPU.  None before one was, or for batches of
        ``__getitems__`` (see ``chooser.ExecutionControl``)."""
        mode = self._mode_for()
        if mode is BatchMode.RING:
            return Handoff.IN_PLACE
        with self.cond:
            probe, self._probe = self._probe, ()
        if mode is not BatchMode.COLLATE or not probe:
            return None
        if isinstance(probe[0], _Collated):
            # the least of two trips: the first pays the pickler's first use (about
            # four times a later trip's CPU for the text outcome set's batch)
            cost = transport.travel_cost([probe[0].batch] * 2)
            return Handoff(cost[0] / probe[0].rows, cost[1] / probe[0].rows) \
                if cost is not None and probe[0].rows else None
        cost = transport.travel_cost(
            [s for s in probe if s is not None and s is not WRITTEN], budget_s)
        return Handoff(*cost) if cost is not None else None

    def draining(self) -> bool:
        """Whether a process stage this pass left still runs rows of it (see
        ``chooser.ExecutionControl``)."""
        return any(s is not self.stage and s.holds(self) for s in self._stages)

    def apply(self, candidate: Candidate) -> bool:
        """Run the rows of batches not yet started under ``candidate`` (consumer
        thread; see ``chooser.ExecutionControl``).  Rows already running finish
        where they are; row tasks still queued for the threads go to a process
        stage when processes start (``handover.take_over_queued``)."""
        if self.stopping:
            return True
        gate = self.gate
        if candidate.mode is Mode.PROCESSES:
            procs = self.executors.processes
            stage = procs.stage(candidate.count) if procs is not None else None
            if stage is None:
                if gate.limit == 0 and not self.inline:
                    gate.set_limit(self.runtime.num_threads)  # someone must run the rows
                return False
            assert procs is not None  # a stage came from it
            if self.stage is not None and self.stage is not stage:
                self._leave_stage()  # another worker count: its queued rows move on
            self._use_stage(stage)
            self.executor = procs
            with self.cond:
                self.inline = False
                self.cond.notify_all()
            gate.set_limit(max(1, gate.limit))  # threads hand their queued rows over
            self.top_up()  # more batches may be outstanding now (see _ahead)
            return True
        self._leave_stage()
        inline = candidate.mode is Mode.INLINE
        self.executor = self.executors.inline if inline else self.executors.threads
        if not inline and candidate.count > self.runtime.num_threads:
            self.runtime.grow(candidate.count)  # a rung past the pool's threads
        gate.set_limit(0 if inline else candidate.count)
        with self.cond:
            self.inline = inline
            self.cond.notify_all()  # a consumer already waiting runs the tasks now
        return True

    def _use_stage(self, stage: Any) -> None:
        """Rows of this pass go to ``stage`` from now on: batches submitted later
        (``handover.submit_batch``) and the row tasks queued for the threads, taken
        back from the pool in the stage's sizes (``handover.take_over_queued``;
        one a thread took meanwhile is handed over by ``rowtasks.run_rows``)."""
        if self.stage is stage:
            return
        # the samples' capacity is the workers now
        self.acct.gate = None
        self.acct.resources = (Resource(PROCESSES, (FETCH, DECODE, ASSEMBLE),
                                        stage.num_workers), *self._thread_resources[1:])
        self.stage = stage
        if stage not in self._stages:
            self._stages.append(stage)
        moved = handover.take_over_queued(self, stage)
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
        self.executor = self.executors.threads
        self.gate.set_limit(self.runtime.num_threads)
        with self.cond:
            self.inline = False
        if self._chooser is not None:
            self._chooser.lost(Candidate(Mode.THREADS, self.runtime.num_threads))

    def _leave_stage(self) -> None:
        """Rows of batches submitted from now on run in this process again, and so do
        the stage's rows no worker has taken yet (``ProcessStage.give_back``); the
        rows the workers hold finish there."""
        stage = self.stage
        if stage is None:
            return
        self.stage = None
        self.acct.resources = self._thread_resources
        self.acct.gate = self.gate
        stage.give_back(self)

    # ------------------------------------------- inline: the consumer's own batch
    def _direct(self) -> bool:
        """Whether the consumer loads each batch itself when it asks for it (see
        :meth:`wait`): rows run inline and are read in this process by
        ``__getitem__`` (no fetch stage, no ``__getitems__``, no process stage)."""
        return self.inline and self.stage is None and self.fetching is None \
            and not self._use_getitems

    def wait(self, k: int | None, timeout: float | None) -> Batch | None:
        """As ``BatchHandoff.wait``.  Where the consumer loads the batches itself
        (:meth:`_direct`) and has taken every batch planned, it plans the next one,
        loads its rows and collates it here and now, as ``DataLoader`` with
        ``num_workers=0`` does: no task is queued for it and no batch is planned
        ahead (``_room``), so the loader costs the consumer no more than that.
        Raises LoaderClosedError where the pass was stopped meanwhile (a row
        started still finishes)."""
        if self.submitted != self.taken or self.exhausted or self.stopping \
                or not self._direct():
            if self.submitted == self.taken:
                # the execution left inline since the consumer's last batch (nothing
                # is planned ahead while it loads them itself): plan now
                self.top_up()
            return super().wait(k, timeout)
        self.waiting_since = time.perf_counter()
        try:
            return self._load_now(k, timeout)
        finally:
            self.waiting_since = 0.0

    def _load_now(self, k: int | None, timeout: float | None) -> Batch | None:
        while self._run_call():
            pass
        self.tick()  # the chooser's windows, as a waiting consumer's loop reads them
        if self.taken:
            self.primed = True
        if not self._direct():  # the chooser switched: the rows run elsewhere now
            self.top_up()
            return super().wait(k, timeout)
        b = self._plan_next()
        if b is None:  # the plan's end, or a sampler's error (a ready batch)
            return super().wait(k, timeout)
        if b.mode is BatchMode.RING:
            self._ring_setup(b)
        if b.n:
            done, cpu = rowtasks.load_rows(self, b, 0, b.n)
            with self.cond:
                self.completions.count(done, batch_done=done == b.n)
                self.rows_cpu_s += cpu
        if self.stopping:
            raise self._closed_error()
        self._assemble(b)
        return b

    def abandon(self, b: Batch) -> None:
        """``b`` cannot be loaded (the loader is closing): it is ready with that error."""
        b.error = b.error or LoaderClosedError("the loader was closed")
        self._mark_ready(b)

    def forget(self) -> None:
        """See ``BatchHandoff.forget``; the samples kept to price a worker's
        hand-off go too."""
        super().forget()
        self._probe = ()

    def _ended(self) -> None:
        if self.readahead is not None:
            self.readahead.close()
        self.gate.open()  # no decode thread may stay parked when the pool is joined
        for stage in self._stages:
            stage.drop_pipeline(self)
        if self._chooser is not None:
            self._chooser.end_pass(self)

    # --------------------------------------------- completion: assemble, transfer
    def rows_done(self, b: Batch, lo: int, hi: int, cpu: float = 0.0) -> None:
        """Rows ``lo..hi`` of ``b`` are done, loaded or failed (one lock for all; any
        thread), having taken ``cpu`` seconds of this thread's CPU; the last completes
        ``b`` in this thread."""
        with self.cond:
            b.done[lo:hi] = b"\x01" * (hi - lo)
            b.remaining -= hi - lo
            last = b.remaining == 0
            self.completions.count(hi - lo, batch_done=last)
            self.rows_cpu_s += cpu
            if not self._ahead_known and self.layouts.decided:
                # the first rows decided the layout: the consumer, waiting for the
                # first batch, plans the batches after it now (see ahead)
                self._ahead_known = True
                self.call_waiting(self.top_up)
        if last:
            self.complete(b)

    def complete(self, b: Batch) -> None:
        """Assemble ``b``, start its copy and mark it ready (in the thread that
        completed it).

        Once the pass is over nobody takes the batch: it is only marked ready (a
        thread abandoned at exit must not start a collate or a copy)."""
        self._assemble(b)
        self._mark_ready(b)

    def _assemble(self, b: Batch) -> None:
        """``b``'s rows made one host batch (``b.output``), its copy started; what
        that raises is ``b.error``.  Not once the pass is over (``b.error`` says so)."""
        # the first collated batch prices a worker's hand-off (see handoff): its first
        # rows, or the whole batch where workers would send it collated; kept once
        # complete, so the chooser never reads rows where a batch was meant
        probe: list[Any] | None = b.samples[:_PROBE_ROWS] \
            if self._probe is None and b.mode is BatchMode.COLLATE else None
        t = self.acct.begin()
        try:
            if b.deferred and b.error is None and not b.mismatch and not self.stopping:
                samples.write_deferred(self.rows, b)
            if self.stopping:
                b.error = b.error or LoaderClosedError("the pass was closed")
            elif b.n == 0:
                pass  # a batch a resumed checkpoint had already taken
            elif b.error is None and not b.failures:
                host = assemble(self.rows, b, self.collate, self.ring_ok)
                if probe is not None and self.worker_collate:
                    probe = [_Collated(host, b.n)]
                b.output, b.event = self.to_target(host)
        except BaseException as e:  # noqa: BLE001
            b.error = e
        if probe is not None:
            with self.cond:
                if self._probe is None:  # batches assembling side by side: the first done
                    self._probe = probe
        if b.n:
            self.acct.end(ASSEMBLE, t)
