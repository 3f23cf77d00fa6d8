"""``AsyncLoader``: DataLoader's interface over one process's threads."""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.utils.data import default_collate, default_convert

from .._memory.batches import LoaderMemory
from .._memory.device import CopyStream, resolve_device, resolve_pin
from .._errors import LoaderClosedError, SampleError, StateError, describe, is_fatal
from .capabilities import Capabilities
from .chooser import Chooser, ExecutionReport
from .policy import INLINE, Candidate, Mode, Reason, Space, processes, threads
from .processes import Execution
from .executors import Executors, ProcessRows
from .tasksize import Gate, RowCost
from .iterable import IterablePipeline
from .handoff import PassConfig
from .batch import Batch, sample_error
from .pipeline import Pipeline
from .samples import LayoutHolder
from .plan import IndexPlan, _gen_state_from_str, _gen_state_to_str, is_iterable_dataset, validate
from .runtime import Runtime
from .._memory.slots import SlotRing
from .accounting import Accounting
from .progress import LiveView
from .readahead import ReadAheadStats
from .._io.hedge import CountsReads
from .iterator import _Iterator
from .resources import available_cores, default_threads, resolve_ranks
from .state import LoaderState, PassProgress
from ..protocols import DeviceTransfer
from .stats import IOStats, LoaderStats, RateLimitedLog, SkippedSample, observe
from .stream import StreamTracker, has_state

OnError = Literal["raise", "skip"]
T_co = TypeVar("T_co", covariant=True)
# DataLoader's rule: these define the plan and may not change after construction
_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
           "persistent_workers")


def _blank_taken(plan: Iterator[Any], base: int, taken: set[int]) -> Iterator[Any]:
    """The plan with the batches already taken (out of order) replaced by empty ones."""
    for k, item in enumerate(plan, start=base):
        yield [] if k in taken else item


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
    cores), ``worker_init_fn`` and ``multiprocessing_context`` apply to the
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
      every thread busy, at least 2).  Bounds memory: twice as many while the
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
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        if not isinstance(io_concurrency, int) or io_concurrency < 1:
            raise ValueError(f"io_concurrency must be a positive int, got {io_concurrency!r}")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        if readahead_bytes is not None and (not isinstance(readahead_bytes, int)
                                            or readahead_bytes < 0):
            raise ValueError(f"readahead_bytes must be None or an int >= 0, "
                             f"got {readahead_bytes!r}")
        self.readahead_bytes = readahead_bytes
        if log_every is not None and not (isinstance(log_every, (int, float))
                                          and log_every > 0):
            raise ValueError(f"log_every must be a positive number of seconds, got {log_every!r}")
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if copy_stream is not None and not isinstance(copy_stream, DeviceTransfer):
            raise TypeError(f"copy_stream must be a DeviceTransfer (pin, to_device, "
                            f"hand_over), got {type(copy_stream).__name__}")
        self.rank, self.world_size = resolve_ranks(rank, world_size)
        if seed is not None and generator is not None:
            if self.world_size > 1:
                # the sharded plan shuffles as DistributedSampler does: by seed, not generator
                warnings.warn("both seed and generator given with world_size > 1: shards are "
                              "shuffled by the seed, the generator is ignored", stacklevel=2)
            else:
                warnings.warn("both seed and generator given: the generator is used, the "
                              "seed ignored", stacklevel=2)
                seed = None
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.timeout = timeout
        self.generator = generator
        self.num_workers = num_workers  # worker processes, when they run (0: the cores)
        self.persistent_workers = persistent_workers
        # StatefulDataLoader's: accepted; every state is exact here whenever it is taken
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.in_order = in_order
        self.on_error: OnError = on_error
        self.seed = seed
        self.io_concurrency = io_concurrency
        self.progress = bool(progress)
        if self.progress:  # fail here, not at iter(), when tqdm is missing
            from .._optional import require
            require("tqdm", "AsyncLoader(progress=True)")
        self.log_every = log_every
        self.num_threads = num_threads or default_threads()
        self._threads_given = num_threads is not None
        self._row_cost = RowCost()  # what a row costs: sizes the decode tasks
        self.device = resolve_device(device)
        # with a transfer of the user's, pinning is its pin(): no CUDA check here
        self.pin_memory = resolve_pin(pin_memory, self.device) if copy_stream is None \
            else pin_memory is not False
        self._iterable = is_iterable_dataset(dataset)
        self._plan = IndexPlan(dataset, batch_size, bool(shuffle), sampler, batch_sampler,
                               drop_last, generator, seed, self.rank, self.world_size)
        self._resume: LoaderState | None = None
        self._last: PassProgress | None = None      # the last pass's position (until iter())
        self._predrawn: dict[str, Any] | None = None  # a global-RNG shuffle's seed, drawn early
        auto = self._plan.auto_collation
        if collate_fn is None:
            collate_fn = default_collate if auto else default_convert
        self.collate_fn = collate_fn
        self._collate = collate_fn if auto else (lambda samples: collate_fn(samples[0]))
        self._caps = Capabilities.of(dataset)
        self.prefetch = prefetch or self._default_prefetch()
        # where samples run: measured among the candidates (see policy, chooser)
        self.execution = execution
        workers = num_workers if num_workers > 0 else available_cores()
        self._exec = Execution(execution, dataset, workers, multiprocessing_context,
                               worker_init_fn, capacity=self.prefetch + 2)
        self._chooser = self._make_chooser(execution, workers)
        self._exec_finalizer = weakref.finalize(self, self._exec.close)
        self._layouts = LayoutHolder(enabled=collate_fn is default_collate and auto)
        transfer = self.device is not None or copy_stream is not None
        self._memory = LoaderMemory(batch_size=batch_size, prefetch=self.prefetch,
                                    use_ring=transfer and self.pin_memory,
                                    pin_host=self.pin_memory and not transfer)
        self._host_pool = self._memory.pool
        self._copy: DeviceTransfer | None = copy_stream
        self._epoch = 0
        self._stats = LoaderStats()
        self._readahead_stats: ReadAheadStats | None = None
        self._acct: Accounting | None = None   # the current or last pass's
        self._skip_log = RateLimitedLog()
        self._closed = False
        self._current: weakref.ref[_Iterator] | None = None
        self._finalizer = weakref.finalize(self, _close_current, [None])
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FROZEN and self.__dict__.get("_initialized", False):
            raise ValueError(f"{name} attribute should not be set after "
                             f"{type(self).__name__} is initialized")
        super().__setattr__(name, value)

    # ---------------------------------------------------------------- config
    def _make_chooser(self, execution: str, workers: int) -> Chooser:
        """The execution chooser for ``execution``: a fixed candidate where the
        arguments fix one (``inline``, ``processes``, ``num_threads=N``, an
        ``IterableDataset``), else the candidates to measure."""
        pinned: Candidate | None = None
        if self._iterable:  # a stream's items are read in order by the threads
            return Chooser(None, threads(self.num_threads), Reason.ONLY)
        if execution == "inline":
            pinned = INLINE
        elif execution == "processes" and self._use_fetch:
            # reads on the event loop feed the decode threads: no process stage there
            return Chooser(None, threads(self.num_threads), Reason.ONLY)
        elif execution == "processes":
            pinned = processes(workers)
        elif self._threads_given:
            pinned = threads(self.num_threads)
        if pinned is not None:
            return Chooser(None, pinned)
        cores = available_cores()
        ladder = Space.thread_ladder(cores, self.num_threads)
        start = threads(min(cores, self.num_threads))
        with_processes = execution == "auto" and not self._use_fetch
        # a timeout bounds the wait for rows loaded elsewhere: rows the consumer loads
        # itself cannot be timed out (as DataLoader's num_workers=0), so a loader given
        # one never chooses inline
        return Chooser(Space(ladder=ladder, start=start, cores=cores,
                             process=processes(workers) if with_processes else None,
                             inline=execution == "auto" and not self.timeout))

    @property
    def _use_fetch(self) -> bool:
        return self._caps.use_fetch

    @property
    def _ring(self) -> SlotRing | None:
        return self._memory.current_ring

    def _default_prefetch(self) -> int:
        per_batch = self.batch_size or 1
        # rows in flight: four per thread (a task may hold two rows that mostly
        # wait, see tasksize.rows_per_task; with many threads the consumer's cadence
        # needs the slack: 128 threads of 5 ms sleeps ran 7% faster with it)
        want = 4 * self.num_threads
        if self._use_fetch:
            want = max(want, self.io_concurrency)
        return max(2, min(64, math.ceil(want / per_batch) + 1))

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
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = epoch
        for s in (self.dataset,
                  self._plan.user_sampler, self._plan.user_batch_sampler,
                  getattr(self._plan.user_batch_sampler, "sampler", None)):
            if s is not None and callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next pass plans (set by ``set_epoch`` or a loaded state)."""
        return self._epoch

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.dataset)  # TypeError when the dataset has no length, as DataLoader
            if self.batch_size is not None:
                n = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
            return n
        return len(self._plan)

    def stats(self) -> LoaderStats:
        """A snapshot of the counters (see :class:`LoaderStats`)."""
        s = self._stats
        ring = self._ring
        return LoaderStats(epoch=s.epoch, batches=s.batches, samples=s.samples,
                           wait_s=s.wait_s, slot_waits=ring.waits if ring else 0,
                           path=s.path, skipped=list(s.skipped),
                           execution=self._execution_report(),
                           io=self._io_stats(),
                           **observe(self._acct, available_cores(), self.dataset))

    def _execution_report(self) -> ExecutionReport:
        report = self._chooser.report()
        failed = self._exec.failed
        if failed and not report.detail:
            report = dataclasses.replace(report, detail=failed)
        return report

    def _io_stats(self) -> IOStats | None:
        if not self._use_fetch:
            return None
        io = IOStats()
        if isinstance(self.dataset, CountsReads):
            counts = self.dataset.read_stats()
            for name in ("attempts", "hedges", "hedge_wins", "stalls", "retries"):
                setattr(io, name, int(getattr(counts, name, 0)))
        ra = self._readahead_stats
        if ra is not None:
            io.readahead_reads, io.readahead_peak_bytes = ra.reads, ra.peak_bytes
            io.readahead_budget = ra.budget
        return io

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[T_co]:
        if self._closed:
            raise LoaderClosedError("this AsyncLoader is closed")
        self._close_current("superseded by a new iter() of the same loader")
        if self.device is not None and self._copy is None:
            self._copy = CopyStream(self.device)
        # blocking reads on the loop (local files) get io_concurrency threads
        runtime = Runtime(self.num_threads, with_loop=self._use_fetch,
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
        self._last = progress
        it = _Iterator(self, pipeline, runtime, progress)
        pipeline.acct.start()  # stopped with the pass (its close or finalizer)
        if self.progress or self.log_every:
            it._view = LiveView(pipeline.acct, available_cores(), progress=self.progress,
                                log_every=self.log_every, total=self._len_or_none(),
                                epoch=self._epoch)
        self._current = weakref.ref(it)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_current, [self._current])
        self._stats.epoch = self._epoch
        it._start()
        return it

    def _make_pipeline(self, runtime: Runtime
                       ) -> tuple[Pipeline | IterablePipeline, PassProgress]:
        """The pass's pipeline and its progress record (where the pass starts)."""
        resume, self._resume = self._resume, None
        config = PassConfig(batch_size=self.batch_size, collate=self._collate,
                            auto_collation=self._plan.auto_collation,
                            default_collate=self._layouts.enabled, prefetch=self.prefetch,
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
        if self._exec.stage is not None and chooser.current.mode is not Mode.PROCESSES:
            self._exec.close()  # workers left idle by the last pass's choice
        base_seed = getattr(self._plan, "base_seed", None)
        if base_seed is None:
            base_seed = (self.seed or 0) + self._epoch
        current = chooser.current
        executors = Executors.build(
            gate=Gate(0 if current.mode is Mode.INLINE
                      else current.count if current.mode is Mode.THREADS
                      else self.num_threads),
            row_cost=self._row_cost, num_threads=runtime.num_threads, chooser=chooser,
            processes=ProcessRows(self._exec, base_seed, runtime.pool.quiet))
        pipeline = Pipeline(config, dataset=self.dataset, caps=self._caps, plan=plan,
                            layouts=self._layouts, runtime=runtime, memory=self._memory,
                            copy=self._copy, executors=executors,
                            # the GIL probe's budget holds across passes (see gilprobe)
                            probe_not_before=(self._acct.probe.next_wake
                                              if self._acct is not None else None))
        self._readahead_stats = pipeline.readahead.stats if pipeline.readahead else None
        return pipeline, progress

    def _stateful_sampler(self) -> Any:
        """The user's batch sampler or sampler when it keeps its own state, else None."""
        for s in (self._plan.user_batch_sampler, self._plan.user_sampler):
            if s is not None and has_state(s):
                return s
        return None

    def _start_plan(self, resume: LoaderState | None) -> tuple[Iterator[Any], PassProgress]:
        """The epoch's plan, fast-forwarded past what a loaded state had consumed,
        and the pass's progress record (where it starts)."""
        sampler = self._stateful_sampler()
        if resume is None:
            predrawn, self._predrawn = self._predrawn, None
            plan, replay = self._plan.start(self._epoch, predrawn, predrawn=predrawn is not None)
            progress = PassProgress(self._epoch, replay)
            return _snapshotting(plan, sampler, progress, 0), progress
        taken = resume.batches_taken
        if resume.world_size != self.world_size:
            # the rest of the epoch, from the first global position not consumed
            progress = PassProgress(self._epoch, {}, 0, resume.offset, [], resume.carry,
                                    resharded_from=resume.offset)
            plan = self._plan.resharded(self._epoch, resume.offset)
            self._load_dataset_state(resume)
            return plan, progress
        origin = resume.resharded_from
        own_position = sampler is not None and resume.sampler_state is not None and taken
        if own_position:
            # a sampler with its own state resumes itself (as StatefulDataLoader does)
            sampler.load_state_dict(resume.sampler_state)
        if origin is not None:  # the pass was itself an elastic resume: replay its plan
            plan, replay = self._plan.resharded(self._epoch, origin), {}
        else:
            plan, replay = self._plan.start(self._epoch, resume.replay)
        if not own_position:
            for _ in range(taken):
                next(plan, None)
        self._load_dataset_state(resume)
        extra = set(resume.taken_extra)
        if extra:
            plan = _blank_taken(plan, taken, extra)
        progress = PassProgress(self._epoch, replay, taken, resume.offset, sorted(extra),
                                resume.carry, origin,
                                sampler_state=resume.sampler_state if own_position else None)
        return _snapshotting(plan, sampler, progress, taken), progress

    def _load_dataset_state(self, resume: LoaderState) -> None:
        """Load a mid-pass state's dataset state, once the resumed pass's plan has
        started: a sampler drawing its order from the global RNG draws it as in the
        interrupted pass, before a dataset whose state holds that RNG sets it (the
        order StatefulDataLoader restores them in)."""
        if resume.dataset_state is not None and has_state(self.dataset):
            self.dataset.load_state_dict(resume.dataset_state)

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
        if self._resume is not None:
            return self._resume.to_dict()
        st = LoaderState(epoch=self._epoch, dataset_len=self._dataset_len(),
                         batch_size=self.batch_size, drop_last=self.drop_last,
                         shuffle=self._plan.shuffle, seed=self.seed,
                         world_size=self.world_size, rank=self.rank, on_error=self.on_error)
        progress = self._last
        if progress is not None and not progress.done:
            progress.fill(st, self.world_size)
            if not self._iterable and has_state(self.dataset):
                st.dataset_state = self.dataset.state_dict()
            return st.to_dict()
        if self.generator is not None:
            st.replay = {"generator_state": _gen_state_to_str(self.generator)}
        elif self._plan.global_shuffle:
            if self._predrawn is None:
                self._predrawn = self._plan.predraw()
            st.replay = dict(self._predrawn)
        if has_state(self.dataset):
            st.dataset_state = self.dataset.state_dict()
        if progress is not None and progress.stream is not None:
            st.stream = progress.stream.ended()
        sampler = self._stateful_sampler()
        if sampler is not None:
            st.sampler_state = sampler.state_dict()
        return st.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues where it was.

        Raises :class:`StateError` for a state of another format or version, data
        set length or batch size (and changes nothing then).  Versions written by
        earlier asyncfeed releases are read.  The dataset's (and sampler's) own
        state is loaded into them now; a mid-pass state's at the next ``iter()``
        (the dataset's once the pass's sampler has started, as StatefulDataLoader
        does), and a mid-pass stream position too.
        """
        st = LoaderState.from_dict(state)
        n = self._dataset_len()
        if st.dataset_len != n:
            raise StateError(f"the state was taken on a data set of {st.dataset_len} "
                             f"samples; this one has {n}")
        if st.batch_size != self.batch_size:
            raise StateError(f"the state was taken with batch_size={st.batch_size}; "
                             f"this loader has batch_size={self.batch_size}")
        if not self._iterable:
            self._check_plan_matches(st)
        elif st.in_pass and st.stream is None:
            raise StateError("this mid-stream state of an IterableDataset was written by an "
                             "older asyncfeed (state version 1), which did not record the "
                             "stream position; a state taken between passes is accepted")
        self._close_current("a state was loaded")
        self._last = None
        self._predrawn = None
        self._epoch = st.epoch
        self.set_epoch(self._epoch)
        if st.dataset_state is not None and has_state(self.dataset) \
                and (self._iterable or not st.in_pass):
            self.dataset.load_state_dict(st.dataset_state)   # mid-pass: see _start_plan
        if self._iterable:
            self._resume = st if st.in_pass else None
            if not st.in_pass and st.stream is not None and st.stream.get("ended"):
                caps = self._caps
                StreamTracker.restore_ended(
                    lambda: iter(caps.iter_raw() if caps.iter_raw is not None
                                 else self.dataset), st.stream)
            return
        if not st.in_pass:
            sampler = self._stateful_sampler()
            if sampler is not None and st.sampler_state is not None:
                sampler.load_state_dict(st.sampler_state)
            if self.generator is not None and "generator_state" in st.replay:
                self.generator.set_state(_gen_state_from_str(st.replay["generator_state"]))
            elif self._plan.global_shuffle and "sampler_seed" in st.replay:
                self._predrawn = dict(st.replay)
            self._resume = None
            return
        self._resume = st

    def _check_plan_matches(self, state: LoaderState) -> None:
        """Raise StateError unless this loader can continue the plan ``state`` was in."""
        sharded = self._plan.sharded
        for key, mine in (("shuffle", self._plan.shuffle), ("drop_last", self.drop_last),
                          ("seed", self.seed)):
            theirs = getattr(state, key)
            shown = theirs
            if key == "seed" and sharded:  # a sharded plan shuffles with seed 0 by default
                theirs, mine = theirs or 0, mine or 0
            if theirs != mine:
                raise StateError(f"the state was taken with {key}={shown!r}; this "
                                 f"loader has {key}={mine!r}, so it would continue another "
                                 "order")
        if state.world_size == self.world_size:
            # ranks in step share one position; what is held back or taken out of
            # order is the rank's own
            if state.rank != self.rank and (state.carry or state.taken_extra
                                            or state.on_error == "skip"):
                raise StateError(f"the state is rank {state.rank}'s and holds that "
                                 f"rank's own progress; this loader is rank {self.rank} of "
                                 f"{self.world_size} (load each rank's own state)")
            return
        if not state.in_pass:
            return  # between passes: the next epoch starts from scratch on any world size
        if self._plan.user_sampler is not None or self._plan.user_batch_sampler is not None:
            raise StateError("resuming with another world size needs the loader's own "
                             "sharding (no custom sampler)")
        if state.taken_extra:
            raise StateError("an elastic resume (another world size) needs a state "
                             "taken with in_order=True")
        if state.on_error == "skip":
            raise StateError("an elastic resume (another world size) needs a state taken "
                             "with on_error='raise': with skipping, ranks consume different "
                             "numbers of samples, so no one state says where the epoch stands")

    def _len_or_none(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def _dataset_len(self) -> int | None:
        try:
            return len(self.dataset)
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

    # ------------------------------------------------------------ bookkeeping
    def _record_skips(self, b: Batch) -> None:
        """Record ``b``'s failed samples as skipped (KeyboardInterrupt, SystemExit:
        raised as they are, never skipped)."""
        for _, _, e in b.failures:
            if e is not None and is_fatal(e):
                raise e
        for _, idx, e in sorted(b.failures, key=lambda f: f[0]):
            if e is None:
                continue  # recorded already
            err = sample_error(self.dataset, idx, e, b.k)
            source = err.source if isinstance(err, SampleError) else None
            cause = err.cause if isinstance(err, SampleError) and err.cause is not None else e
            entry = SkippedSample(index=idx, source=source, error=describe(cause),
                                  epoch=self._epoch, batch=b.k)
            self._stats.skipped.append(entry)
            self._skip_log.warning(f"skipped {_first_line(err)}")
            del err, cause
        # drop the exceptions (keep which rows failed): an exception's traceback holds
        # the frames that held ``b``, a cycle that would keep the batch's buffers from
        # the host pool until a garbage collection
        b.failures = [(row, idx, None) for row, idx, _ in b.failures]


def _first_line(e: BaseException) -> str:
    """The message of a rebuilt error without its traceback (for the skip log)."""
    return str(e).split("\n", 1)[0] if isinstance(e, SampleError) else describe(e)


def _snapshotting(plan: Iterator[Any], sampler: Any, progress: PassProgress,
                  base: int) -> Iterator[Any]:
    """The plan, with the sampler's own state recorded after each batch drawn (the
    state a resume after that many batches loads into the sampler)."""
    if sampler is None:
        return plan

    def gen() -> Iterator[Any]:
        for drawn, item in enumerate(plan, start=base + 1):
            progress.snap_sampler(drawn, sampler.state_dict())
            yield item
    return gen()


def _close_current(ref_box: list[Any]) -> None:
    ref = ref_box[0]
    it = ref() if ref is not None else None
    if it is not None:
        it._close("the loader was garbage-collected")


