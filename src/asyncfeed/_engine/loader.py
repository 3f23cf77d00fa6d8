"""``AsyncLoader``: DataLoader's interface over one process's threads."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import default_collate, default_convert

from .._memory.device import CopyStream, pin, resolve_device, resolve_pin
from .._errors import AsyncFeedError, LoaderClosedError, SampleError, StateError
from .._memory.hostpool import HostBufferPool
from .capabilities import Capabilities
from .autotune import Tuner
from .iterable import IterablePipeline
from .layout import Layout
from .pipeline import Batch, LayoutHolder, Pipeline, sample_error
from .plan import IndexPlan, is_iterable_dataset, validate
from .runtime import Runtime
from .._memory.slots import SlotRing
from .stats import LoaderStats, RateLimitedLog, SkippedSample

OnError = Literal["raise", "skip"]
STATE_FORMAT = "asyncfeed.AsyncLoader"
STATE_VERSION = 1


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each given, else torch.distributed's, else RANK/WORLD_SIZE,
    else (0, 1).  A world size given without a rank takes the rank from the same
    sources; one of several ranks with no rank anywhere is an error."""
    import torch.distributed as dist
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else \
            int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        if initialised:
            rank = dist.get_rank()
        elif "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        elif isinstance(world_size, int) and world_size > 1:
            raise ValueError(f"world_size={world_size} needs a rank: pass rank=, initialise "
                             "torch.distributed, or set RANK")
        else:
            rank = 0
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    return rank, world_size


def _blank_taken(plan: Iterator[Any], base: int, taken: set[int]) -> Iterator[Any]:
    """The plan with the batches already taken (out of order) replaced by empty ones."""
    for k, item in enumerate(plan, start=base):
        yield [] if k in taken else item


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """Decode threads by default: this process's share of the cores, plus up to two.

    The share is the cores this process may use divided by ``LOCAL_WORLD_SIZE``
    (set by torchrun: the ranks on this node), unless the affinity already
    gives each rank its own cores.  The spare threads keep every core busy when
    a thread stalls (a page-cache miss, the GIL, a preempted virtual CPU).
    """
    cores = available_cores()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    total = os.cpu_count() or cores
    share = cores if cores < total else max(1, cores // local)
    return share + min(2, share)


class AsyncLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` that runs in one process.

    With the same arguments (and the same ``generator``) it yields exactly the
    batches ``DataLoader(num_workers=0)`` yields: same order, same structure,
    bit-identical tensors.  Samples are loaded by ``num_threads`` decode threads;
    a dataset that defines ``async fetch(index)`` and ``decode(raw, index)`` has
    its reads run on an event loop, ``io_concurrency`` at a time.  Fixed-shape
    samples are written straight into their row of a preallocated batch.

    DataLoader's process arguments (``num_workers``, ``worker_init_fn``,
    ``multiprocessing_context``, ``prefetch_factor``, ``persistent_workers``,
    ``pin_memory_device``) are accepted and ignored: there are no worker
    processes.  asyncfeed's own knobs:

    - ``num_threads``: decode threads (default: this process's share of the cores,
      divided among torchrun's local ranks, plus up to two spare threads).
    - ``io_concurrency``: reads in flight on the event loop (default 64).
    - ``prefetch``: batches loaded ahead of the consumer (default: enough to keep
      every thread busy, at least 2).  Bounds memory.
    - ``device``: ``None``/``"cpu"`` for host batches, ``"cuda[:N]"`` to receive
      batches on the GPU, copied on a dedicated stream.
    - ``pin_memory``: default on when ``device`` is CUDA.
    - ``seed``: shuffle seed when no ``generator`` is given; epoch ``e`` shuffles
      with ``seed + e`` (see ``set_epoch``).  Without seed or generator, shuffling
      draws from torch's global RNG, as DataLoader does.
    - ``in_order``: deliver batches in plan order (default); ``False`` delivers
      each as soon as it is complete (the batches themselves are the same).
    - ``on_error``: ``"raise"`` raises :class:`SampleError` at the failing batch;
      ``"skip"`` fills the batch from the next samples and records each skipped
      sample in ``stats().skipped``.
    - ``rank``/``world_size``: this process's share of the data (default: from
      ``torch.distributed`` when initialised, else the ``RANK``/``WORLD_SIZE``
      environment, else the whole data set).  Each rank gets exactly the samples
      ``DistributedSampler(seed=seed or 0, drop_last=drop_last)`` gives it.

    ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly (see
    ``docs/distributed.md``).

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
                 num_threads: int | None = None, io_concurrency: int = 64,
                 prefetch: int | None = None, device: str | torch.device | int | None = None,
                 seed: int | None = None, on_error: OnError = "raise",
                 rank: int | None = None, world_size: int | None = None) -> None:
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
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
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
        self.num_workers = num_workers  # accepted for drop-in use; there are no workers
        self.in_order = in_order
        self.on_error: OnError = on_error
        self.seed = seed
        self.io_concurrency = io_concurrency
        self.num_threads = num_threads or default_threads()
        # how many of the threads run: adapted by measurement unless num_threads is given
        self._tuner = Tuner(self.num_threads, available_cores(), adaptive=num_threads is None)
        self.device = resolve_device(device)
        self.pin_memory = resolve_pin(pin_memory, self.device)
        self._iterable = is_iterable_dataset(dataset)
        self._plan = IndexPlan(dataset, batch_size, bool(shuffle), sampler, batch_sampler,
                               drop_last, generator, seed, self.rank, self.world_size)
        self._resume: dict[str, Any] | None = None
        auto = self._plan.auto_collation
        if collate_fn is None:
            collate_fn = default_collate if auto else default_convert
        self.collate_fn = collate_fn
        self._collate = collate_fn if auto else (lambda samples: collate_fn(samples[0]))
        self._caps = Capabilities.of(dataset)
        self.prefetch = prefetch or self._default_prefetch()
        self._layouts = LayoutHolder(enabled=collate_fn is default_collate and auto)
        self._ring: SlotRing | None = None
        self._ring_lock = threading.Lock()
        # Host batches (no CUDA ring): room for the prefetched ones, the one the user
        # holds and one being handed over.  Pinned host batches are not reused: a
        # user's own .to("cuda", non_blocking=True) may still be reading one after
        # dropping it; torch's pinned allocator caches them and knows about such copies.
        pinned = self.pin_memory and self.device is None
        self._host_pool = HostBufferPool(0 if pinned else self.prefetch + 2, pin=pinned)
        self._copy: CopyStream | None = None
        self._epoch = 0
        self._stats = LoaderStats()
        self._skip_log = RateLimitedLog()
        self._closed = False
        self._current: weakref.ref[_Iterator] | None = None
        self._finalizer = weakref.finalize(self, _close_current, [None])

    # ---------------------------------------------------------------- config
    @property
    def _use_fetch(self) -> bool:
        return self._caps.use_fetch

    def _default_prefetch(self) -> int:
        per_batch = self.batch_size or 1
        want = 2 * self.num_threads
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
        ``DistributedSampler``), and to an iterable dataset that has one (e.g.
        ``WebDatasetShards``, whose shard order then changes per epoch).  Takes effect at the next ``iter()``.
        """
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = epoch
        for s in (self.dataset if self._iterable else None,
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
                           execution=self._tuner.describe())

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise LoaderClosedError("this AsyncLoader is closed")
        self._close_current("superseded by a new iter() of the same loader")
        if self.device is not None and self._copy is None:
            self._copy = CopyStream(self.device)
        runtime = Runtime(self.num_threads, with_loop=self._use_fetch,
                          on_loop_close=self._caps.close_io)
        try:
            pipeline, origin = self._make_pipeline(runtime)
        except BaseException:
            runtime.close()
            raise
        if runtime.loop is not None:
            # the loop holds its tasks weakly; the loop thread drops this when it ends
            # (set only when needed: pipeline -> runtime -> pipeline is a cycle)
            runtime.keepalive = pipeline
        it = _Iterator(self, pipeline, runtime)
        if origin is not None:
            it._set_origin(*origin)
        self._current = weakref.ref(it)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_current, [self._current])
        self._stats.epoch = self._epoch
        it._start()
        return it

    def _make_pipeline(self, runtime: Runtime
                       ) -> tuple[Pipeline, tuple[dict[str, Any], dict[str, Any]] | None]:
        """The pass's pipeline and, for map-style data, its (replay, start position)."""
        if self._iterable:
            self._stats.path = "iterable"
            return IterablePipeline(dataset=self.dataset, caps=self._caps, batch_size=self.batch_size,
                                    drop_last=self.drop_last, collate=self._collate,
                                    runtime=runtime, prefetch=self.prefetch, copy=self._copy,
                                    pin_host=self.pin_memory, skip=self.on_error == "skip",
                                    ranks=(self.rank, self.world_size)), None
        plan, replay, position = self._start_plan()
        pipeline = Pipeline(dataset=self.dataset, caps=self._caps, plan=plan,
                        auto_collation=self._plan.auto_collation, collate=self._collate,
                        default_collate=self._layouts.enabled, layouts=self._layouts,
                        runtime=runtime, prefetch=self.prefetch,
                        io_concurrency=self.io_concurrency, use_fetch=self._use_fetch,
                        copy=self._copy, pin_host=self.pin_memory, ring=self._get_ring,
                        batch_size=self.batch_size, host_bufs=self._host_bufs)
        pipeline.tuner = self._tuner
        pipeline.gate = self._tuner.gate_for_pass()
        return pipeline, (replay, position)

    def _start_plan(self) -> tuple[Iterator[Any], dict[str, Any], dict[str, Any]]:
        """The epoch's plan, fast-forwarded past what a loaded state had consumed,
        its replay record, and where the pass starts (for the iterator's state)."""
        resume, self._resume = self._resume, None
        if resume is None:
            plan, replay = self._plan.start(self._epoch)
            return plan, replay, {"base": 0, "offset": 0, "extra": [], "carry": [],
                                  "resharded_from": None}
        taken = int(resume["batches_taken"])
        carry = list(resume.get("carry", []))
        offset = int(resume.get("offset", 0))
        if resume["world_size"] != self.world_size:
            # the rest of the epoch, from the first global position not consumed
            return (self._plan.resharded(self._epoch, offset), {},
                    {"base": 0, "offset": offset, "extra": [], "carry": carry,
                     "resharded_from": offset})
        origin = resume.get("resharded_from")
        if origin is not None:  # the pass was itself an elastic resume: replay its plan
            plan, replay = self._plan.resharded(self._epoch, int(origin)), {}
        else:
            plan, replay = self._plan.start(self._epoch, resume.get("replay"))
        for _ in range(taken):
            next(plan, None)
        extra = set(resume.get("taken_extra", []))
        if extra:
            plan = _blank_taken(plan, taken, extra)
        return plan, replay, {"base": taken, "offset": offset, "extra": sorted(extra),
                              "carry": carry, "resharded_from": origin}

    # -------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: plain (JSON and ``torch.save``), small, versioned.

        Taken after k batches were handed out, a fresh loader given this state
        yields exactly the batches an uninterrupted run would yield after those
        k, whatever was prefetched or in flight.  Between passes, it says which
        epoch comes next.
        """
        if self._resume is not None:
            return dict(self._resume)
        it = self._current() if self._current is not None else None
        base = {"format": STATE_FORMAT, "version": STATE_VERSION,
                "dataset_len": self._dataset_len(), "batch_size": self.batch_size,
                "drop_last": self.drop_last, "shuffle": self._plan.shuffle,
                "seed": self.seed, "world_size": self.world_size, "rank": self.rank,
                "on_error": self.on_error, "epoch": self._epoch}
        if it is None or it._done:
            replay = {}
            if self.generator is not None:
                from .plan import _gen_state_to_str
                replay = {"generator_state": _gen_state_to_str(self.generator)}
            return {**base, "in_pass": False, "batches_taken": 0, "taken_extra": [],
                    "offset": 0, "carry": [], "replay": replay, "resharded_from": None}
        return {**base, **it._position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues where it was.

        Raises :class:`StateError` for a state of another format or version, data
        set length or batch size.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateError("not an asyncfeed AsyncLoader state")
        if state.get("version") != STATE_VERSION:
            raise StateError(f"state version {state.get('version')} is not supported "
                             f"(this asyncfeed writes version {STATE_VERSION})")
        n = self._dataset_len()
        if state.get("dataset_len") != n:
            raise StateError(f"the state was taken on a data set of {state.get('dataset_len')} "
                             f"samples; this one has {n}")
        if state.get("batch_size") != self.batch_size:
            raise StateError(f"the state was taken with batch_size={state.get('batch_size')}; "
                             f"this loader has batch_size={self.batch_size}")
        if self._iterable:
            if state.get("in_pass"):
                raise StateError("resuming an IterableDataset mid-stream is not supported "
                                 "(a state taken between passes restores its epoch)")
            self._close_current("a state was loaded")
            self.set_epoch(int(state["epoch"]))
            self._resume = None
            return
        self._check_plan_matches(state)
        self._close_current("a state was loaded")
        self._epoch = int(state["epoch"])
        self.set_epoch(self._epoch)
        if not state.get("in_pass"):
            replay = state.get("replay") or {}
            if self.generator is not None and "generator_state" in replay:
                from .plan import _gen_state_from_str
                self.generator.set_state(_gen_state_from_str(replay["generator_state"]))
            self._resume = None
            return
        self._resume = dict(state)

    def _check_plan_matches(self, state: dict[str, Any]) -> None:
        """Raise StateError unless this loader can continue the plan ``state`` was in."""
        sharded = self._plan.sharded
        for key, mine in (("shuffle", self._plan.shuffle), ("drop_last", self.drop_last),
                          ("seed", self.seed)):
            theirs = state.get(key, mine)
            if key == "seed" and sharded:  # a sharded plan shuffles with seed 0 by default
                theirs, mine = theirs or 0, mine or 0
            if theirs != mine:
                raise StateError(f"the state was taken with {key}={state[key]!r}; this "
                                 f"loader has {key}={mine!r}, so it would continue another "
                                 "order")
        if state.get("world_size") == self.world_size:
            # ranks in step share one position; what is held back or taken out of
            # order is the rank's own
            if state.get("rank", self.rank) != self.rank and (
                    state.get("carry") or state.get("taken_extra")
                    or state.get("on_error") == "skip"):
                raise StateError(f"the state is rank {state.get('rank')}'s and holds that "
                                 f"rank's own progress; this loader is rank {self.rank} of "
                                 f"{self.world_size} (load each rank's own state)")
            return
        if not state.get("in_pass"):
            return  # between passes: the next epoch starts from scratch on any world size
        if self._plan.user_sampler is not None or self._plan.user_batch_sampler is not None:
            raise StateError("resuming with another world size needs the loader's own "
                             "sharding (no custom sampler)")
        if state.get("taken_extra"):
            raise StateError("an elastic resume (another world size) needs a state "
                             "taken with in_order=True")
        if state.get("on_error") == "skip":
            raise StateError("an elastic resume (another world size) needs a state taken "
                             "with on_error='raise': with skipping, ranks consume different "
                             "numbers of samples, so no one state says where the epoch stands")

    def _dataset_len(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _host_bufs(self, layout: Layout, rows: int) -> list[Any]:
        """Host buffers for a batch of ``rows``: reused once nobody holds them."""
        return self._host_pool.take(layout, max(rows, self.batch_size or rows))

    def _get_ring(self, layout: Layout, rows: int) -> SlotRing | None:
        """The pinned slot ring (CUDA only), made once the layout is known."""
        if self.device is None or not self.pin_memory:
            return None
        with self._ring_lock:
            if self._ring is None or not self._ring.fits(layout, rows):
                self._ring = SlotRing(layout, max(rows, self.batch_size or rows),
                                      self.prefetch)
            return self._ring

    def _close_current(self, reason: str) -> None:
        it = self._current() if self._current is not None else None
        self._current = None
        if it is not None:
            it._close(reason)

    def close(self) -> None:
        """Stop the current pass, join its threads and free pinned slots. Idempotent."""
        self._closed = True
        self._close_current("the loader was closed")
        self._ring = None
        self._host_pool.clear()
        self._finalizer.detach()

    def __enter__(self) -> AsyncLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ bookkeeping
    def _record_skips(self, b: Batch) -> None:
        for _, idx, e in sorted(b.failures, key=lambda f: f[0]):
            err = sample_error(self.dataset, idx, e, b.k)
            cause = err.cause
            entry = SkippedSample(index=idx, source=err.source,
                                  error=f"{type(cause).__name__}: {cause}", epoch=self._epoch,
                                  batch=b.k)
            self._stats.skipped.append(entry)
            self._skip_log.warning(f"asyncfeed: skipped {err}")
        # drop the exceptions (keep which rows failed): an exception's traceback holds
        # the frames that held ``b``, a cycle that would keep the batch's buffers from
        # the host pool until a garbage collection
        b.failures = [(row, idx, None) for row, idx, _ in b.failures]


def _let_go(b: Batch) -> None:
    """The consumer is done with ``b``'s buffers (delivered, or rows copied out).

    The batch's last decode task may still hold ``b`` for a moment (its thread has
    not had the GIL back since it finished the batch): ``b`` must not keep the
    buffers from the host pool once the user drops the batch, neither directly
    nor through its samples (a batch with failed samples still has its decoded
    rows there, views of its buffer).
    """
    b.output = b.bufs = b.views = None
    b.samples = [None] * b.n


def _close_current(ref_box: list[Any]) -> None:
    ref = ref_box[0]
    it = ref() if ref is not None else None
    if it is not None:
        it._close("the loader was garbage-collected")


def _shutdown_and_rewind(pipeline: Pipeline, runtime: Runtime, loader_ref: Any,
                         progress: dict[str, Any]) -> None:
    """Finalizer of a dropped iterator: stop its threads without waiting (any thread
    may run it) and rewind a user's generator as the pass was cut short."""
    pipeline.stop()
    runtime.close(wait=False)
    loader = loader_ref()
    if loader is not None:
        loader._host_pool.clear()
        _rewind(loader, progress)


def _rewind(loader: AsyncLoader, progress: dict[str, Any]) -> None:
    """Leave a user's generator where DataLoader would leave it after a pass cut
    short: prefetching may have drawn further than the batches taken."""
    replay = progress.get("replay") or {}
    if loader.generator is None or "generator_state" not in replay:
        return
    plan, _ = loader._plan.start(progress["epoch"], replay)
    for _ in range(progress["base"] + len(progress["taken"])):
        next(plan, None)


class _Iterator:
    """One pass of an :class:`AsyncLoader`.

    Dropping it (``break`` out of the loop) stops its threads; ``close()`` stops
    and joins them.  After the loader starts another pass, ``next()`` raises
    :class:`LoaderClosedError`.
    """

    def __init__(self, loader: AsyncLoader, pipeline: Pipeline, runtime: Runtime) -> None:
        self._loader = loader
        self._p = pipeline
        self._runtime = runtime
        self._closed_reason: str | None = None
        self._done = False
        self._carry: list[tuple[Any, Any]] = []
        self._emitted = 0
        self._last_n = 0                     # samples in the batch just handed out
        self._replay: dict[str, Any] = {}
        self._base = 0                       # plan batches consumed before this pass
        self._offset0 = 0                    # sharded: global positions consumed before
        self._resharded_from: int | None = None  # an elastic resume's plan origin
        self._taken_ids: set[int] = set()    # plan batches taken in this pass (ids from 0)
        self._taken_samples = 0              # planned samples of the taken batches
        self._progress = {"replay": {}, "base": 0, "taken": self._taken_ids,
                          "epoch": loader._epoch}
        self._finalizer = weakref.finalize(self, _shutdown_and_rewind, pipeline, runtime,
                                           weakref.ref(loader), self._progress)

    def _set_origin(self, replay: dict[str, Any], pos: dict[str, Any]) -> None:
        self._replay = replay
        self._base = pos["base"]
        self._offset0 = pos["offset"]
        self._resharded_from = pos["resharded_from"]
        self._taken_ids.update(k - self._base for k in pos["extra"])
        self._progress.update(replay=replay, base=self._base)
        if pos["carry"]:
            self._carry = self._reload(pos["carry"])

    def _reload(self, indices: list[Any]) -> list[tuple[Any, Any]]:
        """Load the samples a checkpoint had carried over (skip mode), here and now."""
        out = []
        for idx in indices:
            try:
                out.append((idx, self._loader.dataset[idx]))
            except Exception as e:  # noqa: BLE001
                if self._loader.on_error == "raise":
                    raise sample_error(self._loader.dataset, idx, e, None)
        return out

    def _position(self) -> dict[str, Any]:
        prefix = 0
        while prefix in self._taken_ids:
            prefix += 1
        extra = sorted(self._base + k for k in self._taken_ids if k > prefix)
        ws = self._loader.world_size
        return {"in_pass": True, "batches_taken": self._base + prefix, "taken_extra": extra,
                "offset": self._offset0 + self._taken_samples * ws,
                "carry": [idx for idx, _ in self._carry], "replay": dict(self._replay),
                "resharded_from": self._resharded_from}

    def _start(self) -> None:
        self._p.top_up()

    def __iter__(self) -> _Iterator:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        if self._closed_reason is not None:
            raise LoaderClosedError(f"this iterator is closed: {self._closed_reason}")
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._loader.on_error == "skip" and self._loader.in_order \
                    and not self._loader._iterable:
                out = self._next_skipping()
            else:
                out = self._next_plain()
        except StopIteration:
            self._done = True
            self._close(None)
            raise
        finally:
            self._loader._stats.wait_s += time.perf_counter() - t0
        st = self._loader._stats
        st.batches += 1
        st.samples += self._last_n
        if st.path == "":
            st.path = "collate"
        return out

    # plain: one planned batch → one delivered batch
    def _next_plain(self) -> Any:
        loader = self._loader
        while True:
            b = self._take()
            if b.error is not None:
                raise _batch_error(loader.dataset, b)
            if b.failures and b.output is not None:      # iterable stream, skipping
                loader._record_skips(b)
            elif b.failures:
                if loader.on_error == "raise":
                    row, idx, e = min(b.failures, key=lambda f: f[0])
                    raise sample_error(loader.dataset, idx, e, b.k)
                loader._record_skips(b)                  # in_order=False: short batch
                good = b.good_samples_host
                _let_go(b)
                if not good:
                    continue
                return self._emit([s for _, s in good])
            return self._deliver(b)

    def _next_skipping(self) -> Any:
        """in_order with on_error="skip": batch j = the next successful samples."""
        loader, p = self._loader, self._p
        if not self._carry:
            b = self._take()
            if b.error is not None:
                raise _batch_error(loader.dataset, b)
            if not b.failures:
                self._emitted += 1
                return self._deliver(b)
            loader._record_skips(b)
            self._carry.extend(b.good_samples_host)
            _let_go(b)
        target = (loader.batch_size or 1) if loader._plan.user_batch_sampler is None \
            else p.sizes[min(self._emitted, len(p.sizes) - 1)]
        while len(self._carry) < target:
            try:
                b = self._take(want_rows=True)
            except StopIteration:
                break
            if b.error is not None:
                raise _batch_error(loader.dataset, b)
            loader._record_skips(b)
            self._carry.extend(b.good_samples_host)
            _let_go(b)
        if not self._carry:
            raise StopIteration
        chunk, self._carry = self._carry[:target], self._carry[target:]
        if len(chunk) < target and loader.drop_last and loader.batch_size is not None:
            self._carry = []
            raise StopIteration
        self._emitted += 1
        return self._emit([s for _, s in chunk])

    def _take(self, want_rows: bool = False) -> Batch:
        """The next batch from the pipeline, its credit returned; StopIteration at the end.

        With ``want_rows`` (or when samples failed) the successful samples are
        copied out as ``b.good_samples_host`` before the batch's slot is reused.
        """
        loader, p = self._loader, self._p
        while True:
            k = p.taken if loader.in_order else None
            b = p.wait(k, loader.timeout)
            if b is None:
                raise StopIteration
            self._taken_ids.add(b.k)
            self._taken_samples += b.n
            if b.n:
                break
            p.release(b)
            p.top_up()
        # rows must be copied out of a pinned slot before the slot is reused
        if b.error is None and (want_rows or (b.failures and b.output is None)):
            b.good_samples_host = p.good_samples(b)
        p.release(b)
        p.top_up()
        if p.exhausted:
            # nothing left to plan: keep only the free buffers the batches still
            # waiting for their first row will take
            loader._host_pool.trim(p.unstarted())
        if loader._layouts.layout is not None and loader._stats.path in ("", "collate"):
            loader._stats.path = "ring" if b.mode == "ring" else loader._stats.path
        if b.mode == "batch":
            loader._stats.path = "batch"
        return b

    def _deliver(self, b: Batch) -> Any:
        self._last_n = b.n - len(b.failures)  # an iterable's skipped samples had a row number
        if self._p.copy is not None and b.event is not None:
            self._p.copy.hand_over(b.output, b.event)
        out = b.output
        _let_go(b)
        return out

    def _emit(self, samples: list[Any]) -> Any:
        """Collate samples in this thread (the slow path, after a skip)."""
        p = self._p
        self._last_n = len(samples)
        host = p.collate(samples)
        if p.copy is not None:
            out, event = p.copy.to_device(pin(host) if p.pin_host else host)
            p.copy.hand_over(out, event)
            return out
        return pin(host) if p.pin_host else host

    # ---------------------------------------------------------------- closing
    def _close(self, reason: str | None) -> None:
        """Stop this pass and join its threads (``reason`` None: it simply ended)."""
        if reason is not None and self._closed_reason is None and not self._done:
            self._closed_reason = reason
        self._p.stop()
        self._runtime.close(wait=True)
        # a pass's batch memory goes with it (batches still held keep theirs)
        self._loader._host_pool.clear()
        if self._finalizer.detach() is not None and not self._done:
            _rewind(self._loader, self._progress)

    def close(self) -> None:
        """Stop this pass early. Idempotent."""
        self._close("closed")


def _batch_error(dataset: Any, b: Batch) -> AsyncFeedError:
    e = b.error
    assert e is not None
    if isinstance(e, AsyncFeedError):
        return e
    if b.mode == "batch":
        err = SampleError(b.indices, None, e, b.k)
    else:
        err = AsyncFeedError(f"batch {b.k} (indices {b.indices[:8]}"
                             f"{'...' if b.n > 8 else ''}) failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err
