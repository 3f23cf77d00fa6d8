"""``AsyncLoader``: DataLoader's interface over one process's threads."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import default_collate, default_convert

from .._memory.batches import LoaderMemory
from .._memory.device import CopyStream
from .._memory.slots import SlotRing
from .._errors import LoaderClosedError
from ..protocols import DeviceTransfer
from .accounting import Accounting
from .capabilities import Capabilities
from .checkpoint import Checkpoints, check_epoch
from .candidates import make_chooser
from .chooser import ExecutionReport
from .config import LoaderConfig, OnError, check_args, make_config
from .handoff import PassConfig
from .iterable import IterablePipeline
from .iterator import _Iterator
from .passcontext import PassContext, batch_count
from .executors import Executors, ProcessRows
from .firstcall import FirstCall
from .pipeline import Pipeline
from .plan import IndexPlan, is_iterable_dataset, validate
from .policy import Mode
from .processes import Execution
from .progress import LiveView
from .readahead import ReadAheadStats
from .resources import available_cores
from .runtime import Runtime
from .samples import LayoutHolder
from .skips import SkipLog
from .state import LoaderState, PassProgress
from .stats import LoaderStats, io_stats, observe
from .stream import StreamTracker
from .tasksize import Gate, RowCost

T_co = TypeVar("T_co", covariant=True)
# DataLoader's rule: these define the plan and may not change after construction
_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
           "persistent_workers")


class AsyncLoader(Generic[T_co]):
    """A drop-in for ``torch.utils.data.DataLoader`` that runs in one process.

    With the same arguments (and the same ``generator``) it yields exactly the
    batches ``DataLoader(num_workers=0)`` yields: same order, same structure,
    bit-identical tensors.  Samples are loaded where the execution chooses
    (``execution``, below: the consumer's thread, decode threads or worker
    processes); a dataset that defines ``async fetch(index)`` and ``decode(raw, index)`` has
    its reads run on an event loop, ``io_concurrency`` at a time.  Fixed-shape
    samples are written straight into their row of a preallocated batch.

    DataLoader's ``prefetch_factor``, ``persistent_workers`` and
    ``pin_memory_device`` are accepted and ignored (``prefetch`` bounds what is
    loaded ahead), as is StatefulDataLoader's ``snapshot_every_n_steps``: every
    state here is exact, whenever it is taken.  ``num_workers`` (default: the
    cores, and twice the cores measured where other processes keep the workers
    from their cores), ``worker_init_fn`` and ``multiprocessing_context`` apply to the
    worker processes, when they run: how many, how they start and are set up,
    as in DataLoader.  As in DataLoader, ``batch_size``, ``dataset``,
    ``sampler``, ``batch_sampler`` and ``drop_last`` cannot be assigned after
    construction (``ValueError``).  asyncfeed's own knobs:

    - ``execution``: ``"auto"`` (default) measures where rows run fastest on the
      real pass and keeps that: ``inline`` (the consumer's thread loads them while
      it waits, as ``num_workers=0``), decode threads (their count), or
      ``num_workers`` worker processes; a dearer candidate must beat a cheaper one
      by more than the noise measured between like windows (see
      ``docs/architecture.md``).  The choice carries over to later passes and is
      re-checked when the measured rate drifts.  With ``timeout`` set, ``auto``
      never chooses inline: a row the consumer loads itself cannot be timed out
      (nor can it with ``execution="inline"``, as with DataLoader's
      ``num_workers=0``).  ``"inline"``, ``"threads"``
      (measures the thread count only) and ``"processes"`` fix the mode.  Batches
      are the same whichever runs; ``stats().execution`` (an
      :class:`~asyncfeed.ExecutionReport`) says which ran, the rates measured and
      why.

    - ``num_threads``: decode threads (default: this process's share of the cores,
      divided among torchrun's local ranks, plus up to two spare threads); given,
      it fixes the execution at that many threads (unless ``execution`` says
      otherwise).
    - ``io_concurrency``: reads in flight on the event loop (default 64).
    - ``prefetch``: batches loaded ahead of the consumer (default: enough to keep
      every thread busy, at least 2; while worker processes run the rows with no
      device copy, enough to keep every worker busy: at most two a worker, and
      what half the free shared memory holds).  A given
      ``prefetch`` bounds memory: twice as many while the
      batch the consumer waits for still waits for a read on the event loop (no
      device copy), so a retried read does not leave the threads idle.
    - ``readahead_bytes``: with reads on the event loop, raw reads run ahead of
      the ``prefetch`` batches by this many bytes of compressed data (default
      ``None``: 3 s of the measured read rate, 16 MiB to 256 MiB; ``0``: off), so
      a slow or retried read delays only its own batch (see ``docs/remote.md``).
    - ``device``: ``None``/``"cpu"`` for host batches, ``"cuda[:N]"`` to receive
      batches on the GPU, copied on a dedicated stream.
    - ``pin_memory``: default on when ``device`` is CUDA (or ``copy_stream`` given).
    - ``copy_stream``: the :class:`~asyncfeed.protocols.DeviceTransfer` that moves
      batches to the device (default: a :class:`~asyncfeed.CopyStream` on
      ``device``, made at the first ``iter()``).  Batches are then written into a
      ring of ``prefetch`` slots, each reused once its copy's event completed.
    - ``seed``: shuffle seed when no ``generator`` is given; epoch ``e`` shuffles
      with ``seed + e`` (see ``set_epoch``).  Without seed or generator, shuffling
      draws from torch's global RNG, as DataLoader does.
    - ``in_order``: deliver batches in plan order (default); ``False`` delivers
      each as soon as it is complete (the batches themselves are the same).
    - ``on_error``: ``"raise"`` raises the sample's error at the failing batch, as
      an exception of the same type that is also a :class:`SampleError` (index,
      path, original traceback); ``"skip"`` fills the batch from the next samples
      and records each skipped sample in ``stats().skipped``.  KeyboardInterrupt
      and SystemExit are raised as they are, never skipped.
    - ``rank``/``world_size``: this process's share of the data (default: from
      ``torch.distributed`` when initialised, else the ``RANK``/``WORLD_SIZE``
      environment, else the whole data set).  Each rank gets exactly the samples
      ``DistributedSampler(seed=seed or 0, drop_last=drop_last)`` gives it.
    - ``progress``: a tqdm bar per pass with samples/s and the bottleneck of the
      last window (labelled so), ending on the whole pass's, the word
      ``stats()`` gives (needs ``tqdm``: ``pip install 'asyncfeed[progress]'``);
      ``log_every``: seconds
      between ``logging`` lines (logger ``"asyncfeed"``, INFO) with the rate,
      stage shares and bottleneck.  Both off by default (``docs/observability.md``).

    ``stats()`` says where the time goes (stages, GIL share, bottleneck,
    ``explain()``).  ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly (see
    ``docs/distributed.md``), also after a ``break`` (the position of the last
    pass is kept until the next ``iter()``), and they carry the dataset's and the
    sampler's own ``state_dict()`` when they have one.  An ``IterableDataset`` is
    resumed from its own state, else by fast-forwarding.

    One iterator may be shared by several threads: ``next()`` calls are
    serialised, each batch is delivered once.

    Threads live for one pass: they start at ``iter()`` and stop when the pass
    ends, when its iterator is dropped (a ``break``), at ``close()``, at a new
    ``iter()`` and at interpreter exit.  ``close()`` is idempotent; the loader is
    a context manager.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 pin_memory: bool | None = None, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None,
                 generator: torch.Generator | None = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 snapshot_every_n_steps: int | None = 1,
                 num_threads: int | None = None, io_concurrency: int = 64,
                 prefetch: int | None = None, device: str | torch.device | int | None = None,
                 seed: int | None = None, on_error: OnError = "raise",
                 rank: int | None = None, world_size: int | None = None,
                 readahead_bytes: int | None = None,
                 copy_stream: DeviceTransfer | None = None,
                 execution: str = "auto",
                 progress: bool = False, log_every: float | None = None) -> None:
        validate(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last)
        check_args(timeout=timeout, on_error=on_error, num_threads=num_threads,
                   io_concurrency=io_concurrency, prefetch=prefetch,
                   readahead_bytes=readahead_bytes, log_every=log_every, seed=seed,
                   copy_stream=copy_stream)
        caps = Capabilities.of(dataset)
        cfg = make_config(
            batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, timeout=timeout,
            num_workers=num_workers, persistent_workers=persistent_workers,
            snapshot_every_n_steps=snapshot_every_n_steps, in_order=in_order,
            on_error=on_error, seed=seed, generator=generator, io_concurrency=io_concurrency,
            prefetch=prefetch, readahead_bytes=readahead_bytes, num_threads=num_threads,
            device=device, pin_memory=pin_memory, copy_stream=copy_stream,
            execution=execution, rank=rank, world_size=world_size, progress=progress,
            log_every=log_every, use_fetch=caps.use_fetch)
        self._config = cfg
        self._caps = caps
        self.dataset = dataset
        self.generator = generator
        self._adopt(cfg)
        self._iterable = is_iterable_dataset(dataset)
        self._plan = IndexPlan(dataset, batch_size, cfg.shuffle, sampler, batch_sampler,
                               drop_last, generator, cfg.seed, cfg.rank, cfg.world_size)
        self._ckpt = Checkpoints(cfg, dataset, self._plan, caps, generator, self._iterable)
        auto = self._plan.auto_collation
        if collate_fn is None:
            collate_fn = default_collate if auto else default_convert
        self.collate_fn = collate_fn
        self._collate = collate_fn if auto else (lambda samples: collate_fn(samples[0]))
        self._layouts = LayoutHolder(enabled=collate_fn is default_collate and auto)
        self._first_call = FirstCall()  # see firstcall: passes until one's first call returned
        self._build_parts(cfg, multiprocessing_context, worker_init_fn, copy_stream)
        self._initialized = True

    def _adopt(self, cfg: LoaderConfig) -> None:
        """Set DataLoader's public attributes (and asyncfeed's) from the config."""
        self.batch_size = cfg.batch_size
        self.drop_last = cfg.drop_last
        self.timeout = cfg.timeout
        self.num_workers = cfg.num_workers  # worker processes, when they run (0: the cores)
        self.persistent_workers = cfg.persistent_workers
        # StatefulDataLoader's: accepted; every state is exact here whenever it is taken
        self.snapshot_every_n_steps = cfg.snapshot_every_n_steps
        self.in_order = cfg.in_order
        self.on_error: OnError = cfg.on_error
        self.seed = cfg.seed
        self.rank, self.world_size = cfg.rank, cfg.world_size
        self.io_concurrency = cfg.io_concurrency
        self.readahead_bytes = cfg.readahead_bytes
        self.progress = cfg.progress
        self.log_every = cfg.log_every
        self.num_threads = cfg.num_threads
        self.device = cfg.device
        self.pin_memory = cfg.pin_memory
        self.prefetch = cfg.prefetch
        self._prefetch_given = cfg.prefetch_given
        self.execution = cfg.execution

    def _build_parts(self, cfg: LoaderConfig, multiprocessing_context: Any,
                     worker_init_fn: Callable[[int], None] | None,
                     copy_stream: DeviceTransfer | None) -> None:
        """The parts the loader owns across passes: the execution (worker processes
        and the chooser of where rows run), batch memory, counters and skip log."""
        self._row_cost = RowCost()  # what a row costs: sizes the decode tasks
        # where samples run: measured among the candidates (see policy, chooser)
        # a collate_fn of the user's goes to the workers, which collate whole batches
        custom = not self._layouts.enabled and self._plan.auto_collation
        self._exec = Execution(cfg.execution, self.dataset, cfg.workers,
                               multiprocessing_context, worker_init_fn,
                               capacity=cfg.prefetch + 2,
                               collate=self._collate if custom else None)
        self._chooser = make_chooser(cfg, iterable=self._iterable,
                                     use_fetch=self._caps.use_fetch)
        self._exec_finalizer = weakref.finalize(self, self._exec.close)
        self._memory = LoaderMemory(batch_size=cfg.batch_size, prefetch=cfg.prefetch,
                                    use_ring=cfg.transfer and cfg.pin_memory,
                                    pin_host=cfg.pin_memory and not cfg.transfer)
        self._host_pool = self._memory.pool
        self._copy: DeviceTransfer | None = copy_stream
        self._stats = LoaderStats()
        self._skips = SkipLog(self.dataset)
        self._readahead_stats: ReadAheadStats | None = None
        self._acct: Accounting | None = None   # the current or last pass's
        self._closed = False
        self._current: weakref.ref[_Iterator] | None = None
        self._finalizer = weakref.finalize(self, _close_current, [None])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FROZEN and self.__dict__.get("_initialized", False):
            raise ValueError(f"{name} attribute should not be set after "
                             f"{type(self).__name__} is initialized")
        super().__setattr__(name, value)


    # ---------------------------------------------------------------- config
    @property
    def _use_fetch(self) -> bool:
        return self._caps.use_fetch

    @property
    def _ring(self) -> SlotRing | None:
        return self._memory.current_ring

    @property
    def _epoch(self) -> int:
        return self._ckpt.epoch

    @property
    def _resume(self) -> LoaderState | None:
        """A loaded mid-pass state the next pass continues (taken by that pass)."""
        return self._ckpt.resume

    @_resume.setter
    def _resume(self, value: LoaderState | None) -> None:
        self._ckpt.resume = value

    @property
    def sampler(self) -> Any:
        """The sampler of the current epoch (as DataLoader's ``sampler`` attribute)."""
        return None if self._iterable else self._plan._sampler(self._epoch)

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler of the current epoch (None without auto-batching)."""
        if self._iterable or not self._plan.auto_collation:
            return None
        return self._plan.index_sampler(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: with ``seed``, epoch ``e`` shuffles with ``seed + e``.

        Also forwarded to a sampler or batch sampler that has ``set_epoch`` (e.g.
        ``DistributedSampler``), and to a dataset that has one
        (:class:`~asyncfeed.protocols.EpochAware`: ``WebDatasetShards``, whose shard
        order then changes per epoch; ``ImageFolder(train=True)``, whose crops do).
        Takes effect at the next ``iter()``.
        """
        check_epoch(epoch)
        self._ckpt.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next pass plans (set by ``set_epoch`` or a loaded state)."""
        return self._epoch

    def __len__(self) -> int:
        return batch_count(self.dataset, self._plan, self._iterable, self.batch_size,
                           self.drop_last)

    def stats(self) -> LoaderStats:
        """A snapshot of the counters (see :class:`LoaderStats`)."""
        s = self._stats
        ring = self._ring
        execution = self._execution_report()
        return LoaderStats(epoch=s.epoch, batches=s.batches, samples=s.samples,
                           wait_s=s.wait_s, slot_waits=ring.waits if ring else 0,
                           path=s.path, skipped=list(self._skips.entries),
                           execution=execution,
                           io=io_stats(self.dataset, self._readahead_stats)
                           if self._use_fetch else None,
                           **observe(self._acct, available_cores(), self.dataset,
                                     execution))

    def _execution_report(self) -> ExecutionReport:
        report = self._chooser.report()
        failed = self._exec.failed
        if failed and not report.detail:
            report = dataclasses.replace(report, detail=failed)
        return report

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[T_co]:
        if self._closed:
            raise LoaderClosedError("this AsyncLoader is closed")
        self._close_current("superseded by a new iter() of the same loader")
        if self.device is not None and self._copy is None:
            self._copy = CopyStream(self.device)
        # blocking reads on the loop (local files) get io_concurrency threads
        current = self._chooser.current  # a count past the pool's, kept from a pass
        runtime = Runtime(max(self.num_threads, current.count)
                          if current.mode is Mode.THREADS else self.num_threads,
                          with_loop=self._use_fetch,
                          io_threads=self.io_concurrency,
                          on_loop_close=self._caps.close_io)
        try:
            pipeline, progress = self._make_pipeline(runtime)
        except BaseException:
            runtime.close()
            raise
        self._acct = pipeline.acct
        if runtime.loop is not None:
            # the loop holds its tasks weakly; the loop thread drops this when it ends
            # (set only when needed: pipeline -> runtime -> pipeline is a cycle)
            runtime.keepalive = pipeline
        self._ckpt.last = progress
        it = _Iterator(self._pass_context(), pipeline, runtime, progress)
        pipeline.acct.start()  # stopped with the pass (its close or finalizer)
        if self.progress or self.log_every:
            it._view = LiveView(pipeline.acct, available_cores(), progress=self.progress,
                                log_every=self.log_every, total=self._len_or_none(),
                                epoch=self._epoch, execution=self._chooser.report)
        self._current = weakref.ref(it)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_current, [self._current])
        self._stats.epoch = self._epoch
        it._start()
        return it

    def _pass_context(self) -> PassContext:
        """What the pass's iterator needs from this loader (no reference to it)."""
        return PassContext(
            dataset=self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
            timeout=self.timeout, in_order=self.in_order, on_error=self.on_error,
            iterable=self._iterable, epoch=self._epoch, plan=self._plan,
            generator=self.generator, stats=self._stats, skips=self._skips,
            host_pool=self._host_pool, layouts=self._layouts,
            length=functools.partial(batch_count, self.dataset, self._plan, self._iterable,
                                     self.batch_size, self.drop_last),
            owner=self)

    def _make_pipeline(self, runtime: Runtime
                       ) -> tuple[Pipeline | IterablePipeline, PassProgress]:
        """The pass's pipeline and its progress record (where the pass starts)."""
        resume, self._resume = self._resume, None
        config = PassConfig(batch_size=self.batch_size, collate=self._collate,
                            auto_collation=self._plan.auto_collation,
                            default_collate=self._layouts.enabled, prefetch=self.prefetch,
                            prefetch_given=self._prefetch_given,
                            io_concurrency=self.io_concurrency, in_order=self.in_order,
                            readahead_bytes=self.readahead_bytes, pin_host=self.pin_memory,
                            drop_last=self.drop_last, skip=self.on_error == "skip")
        if self._iterable:
            self._stats.path = "iterable"
            tracker = StreamTracker(self.dataset, resume.stream if resume is not None
                                    else None)
            stream_pipeline = IterablePipeline(config, dataset=self.dataset, caps=self._caps,
                                               runtime=runtime, copy=self._copy,
                                               ranks=(self.rank, self.world_size),
                                               stream=tracker)
            # a resumed pass counts on from the batches the state had taken
            progress = PassProgress(self._epoch, base=resume.batches_taken if resume else 0,
                                    offset=resume.offset if resume else 0,
                                    stream_start=tracker.start)
            progress.stream = tracker
            return stream_pipeline, progress
        plan, progress = self._start_plan(resume)
        chooser = self._chooser
        # workers left idle by the last pass's choice
        self._exec.keep(chooser.current.count if chooser.current.mode is Mode.PROCESSES
                        else None)
        base_seed = getattr(self._plan, "base_seed", None)
        if base_seed is None:
            base_seed = (self.seed or 0) + self._epoch
        current = chooser.current
        executors = Executors.build(
            gate=Gate(0 if current.mode is Mode.INLINE
                      else current.count if current.mode is Mode.THREADS
                      else self.num_threads),
            row_cost=self._row_cost, pool=runtime.pool, chooser=chooser,
            processes=ProcessRows(self._exec, base_seed, runtime.pool.quiet))
        pipeline = Pipeline(config, dataset=self.dataset, caps=self._caps, plan=plan,
                            layouts=self._layouts, runtime=runtime, memory=self._memory,
                            copy=self._copy, executors=executors,
                            first_call=self._first_call,
                            # the GIL probe's budget holds across passes (see gilprobe)
                            probe_not_before=(self._acct.probe.next_wake
                                              if self._acct is not None else None))
        self._readahead_stats = pipeline.readahead.stats if pipeline.readahead else None
        return pipeline, progress


    def _start_plan(self, resume: LoaderState | None) -> tuple[Iterator[Any], PassProgress]:
        """The epoch's plan and the pass's progress record (see
        :meth:`Checkpoints.start_plan`)."""
        return self._ckpt.start_plan(resume)

    # -------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: plain (JSON and ``torch.save``), small, versioned.

        Taken after k batches were handed out, a fresh loader given this state
        yields exactly the batches an uninterrupted run would yield after those
        k, whatever was prefetched or in flight.  The position of the last pass
        is kept after its iterator is gone (a ``break``) until the next
        ``iter()``.  Between passes, it says which epoch comes next and fixes its
        order (without a generator, the seed DataLoader would draw from the
        global RNG at the next ``iter()`` is drawn now).  It holds the dataset's
        and the sampler's own ``state_dict()`` when they have one.
        """
        return self._ckpt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues where it was.

        Raises :class:`StateError` for a state of another format or version, data
        set length or batch size (and changes nothing then).  Versions written by
        earlier asyncfeed releases are read.  The dataset's (and sampler's) own
        state is loaded into them now; a mid-pass state's at the next ``iter()``
        (the dataset's once the pass's sampler has started, as StatefulDataLoader
        does), and a mid-pass stream position too.
        """
        st = self._ckpt.check(state)
        self._close_current("a state was loaded")
        self._ckpt.adopt(st)

    def _len_or_none(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def _close_current(self, reason: str) -> None:
        it = self._current() if self._current is not None else None
        self._current = None
        if it is not None:
            it._close(reason)

    def close(self) -> None:
        """Stop the current pass, join its threads and free pinned slots. Idempotent."""
        self._closed = True
        self._close_current("the loader was closed")
        self._memory.close()
        self._finalizer.detach()
        self._exec.close()

    def __enter__(self) -> AsyncLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_current(ref_box: list[Any]) -> None:
    ref = ref_box[0]
    it = ref() if ref is not None else None
    if it is not None:
        it._close("the loader was garbage-collected")
