"""One pass of an :class:`~asyncfeed.AsyncLoader`: the iterator ``iter(loader)`` returns.

It takes finished batches from the pass's pipeline in plan order (or as they
finish, with ``in_order=False``), records the pass's progress for
``state_dict()``, turns failed samples into the errors DataLoader raises (or
skips them), and hands each batch over.  Dropping it stops the pass's threads
(a finalizer that never waits); ``close()`` stops and joins them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from .._memory.hostpool import HostBufferPool
from .._errors import AsyncFeedError, LoaderClosedError, is_fatal, rebuild_error
from .handoff import BatchHandoff, PassState
from .iterable import IterablePipeline
from .batch import Batch, sample_error
from .passcontext import PassContext
from .pipeline import Pipeline
from .plan import IndexPlan
from .progress import LiveView
from .runtime import Runtime
from .state import PassProgress


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


def _shutdown_and_rewind(pipeline: BatchHandoff, runtime: Runtime, owner_ref: Any,
                         host_pool: HostBufferPool, plan: IndexPlan,
                         generator: torch.Generator | None, progress: PassProgress) -> None:
    """Finalizer of a dropped iterator: stop its threads without waiting (any thread
    may run it); while the loader lives, free the pass's batch memory and rewind a
    user's generator as the pass was cut short."""
    pipeline.acct.stop(wait=False)
    pipeline.stop("the iterator was dropped")
    runtime.close(wait=False)
    if owner_ref() is not None:
        host_pool.clear()
        _rewind(plan, generator, progress)


def _rewind(index_plan: IndexPlan, generator: torch.Generator | None,
            progress: PassProgress) -> None:
    """Leave a user's generator where DataLoader would leave it after a pass cut
    short: prefetching may have drawn further than the batches taken."""
    if generator is None or "generator_state" not in progress.replay:
        return
    plan, _ = index_plan.start(progress.epoch, progress.replay)
    with progress.lock:
        drawn = progress.base + len(progress.taken)
    for _ in range(drawn):
        next(plan, None)


class _Iterator:
    """One pass of an :class:`AsyncLoader`.

    Dropping it (``break`` out of the loop) stops its threads; ``close()`` stops
    and joins them; the loader keeps the pass's position (``progress``) for
    ``state_dict()`` until its next ``iter()``.  After the loader starts another
    pass, ``next()`` raises :class:`LoaderClosedError`.  ``next()`` may be called
    from several threads: the calls are serialised (each batch goes to one caller).
    """

    def __init__(self, ctx: PassContext, pipeline: Pipeline | IterablePipeline,
                 runtime: Runtime, progress: PassProgress) -> None:
        self._ctx = ctx
        self._p = pipeline
        self._runtime = runtime
        self._progress = progress
        self._next_lock = threading.Lock()
        # the outputs handed out last (see _retire): at most the one the user is
        # likely to hold while calling next() again, and the one before it
        self._held: deque[Any] = deque()
        self._carry: list[tuple[Any, Any]] = []
        self._emitted = 0
        self._last_n = 0                     # samples in the batch just handed out
        self._view: LiveView | None = None   # progress bar / log lines
        self._finalizer = weakref.finalize(self, _shutdown_and_rewind, pipeline, runtime,
                                           weakref.ref(ctx.owner), ctx.host_pool, ctx.plan,
                                           ctx.generator, progress)
        if progress.carry:
            self._set_carry(self._reload(progress.carry))

    def _set_carry(self, carry: list[tuple[Any, Any]]) -> None:
        self._carry = carry
        self._progress.set_carry([idx for idx, _ in carry])

    def _reload(self, indices: list[Any]) -> list[tuple[Any, Any]]:
        """Load the samples a checkpoint had carried over (skip mode), here and now."""
        out = []
        ctx = self._ctx
        for idx in indices:
            try:
                out.append((idx, ctx.dataset[idx]))
            except Exception as e:  # noqa: BLE001
                if ctx.on_error == "raise":
                    raise sample_error(ctx.dataset, idx, e, None)
        return out

    def _start(self) -> None:
        self._p.start()

    @property
    def _done(self) -> bool:
        """The pass ended with the consumer taking every batch."""
        return self._p.state is PassState.FINISHED

    def __iter__(self) -> _Iterator:
        return self

    def __len__(self) -> int:
        return self._ctx.length()

    def __next__(self) -> Any:
        with self._next_lock:
            state = self._p.state
            if state is PassState.CLOSED:
                raise LoaderClosedError(f"this iterator is closed: {self._p.close_reason}")
            if state is PassState.FINISHED:
                raise StopIteration
            t0 = time.perf_counter()
            try:
                ctx = self._ctx
                if ctx.on_error == "skip" and ctx.in_order and not ctx.iterable:
                    out = self._next_skipping()
                else:
                    out = self._next_plain()
                if not self._p.inline:
                    self._held.append(out)
            except StopIteration:
                self._progress.done = True
                self._close(None)
                raise
            finally:
                waited = time.perf_counter() - t0
                self._ctx.stats.wait_s += waited
                self._p.handed()  # the thread that readied the batch goes on
            self._p.acct.took(waited, self._last_n)
            if self._view is not None:
                self._view.tick()
            st = self._ctx.stats
            st.batches += 1
            st.samples += self._last_n
            if st.path == "":
                st.path = "collate"
            return out

    # plain: one planned batch → one delivered batch
    def _next_plain(self) -> Any:
        ctx = self._ctx
        while True:
            b = self._take()
            if b.error is not None:
                raise _batch_error(ctx.dataset, b)
            if b.failures and b.output is not None:      # iterable stream, skipping
                ctx.skips.record(b, ctx.epoch)
            elif b.failures:
                if self._p.retry_failed_here(b) and not b.failures:
                    good = b.good_samples_host  # every row loaded, some of them here
                    _let_go(b)
                    return self._emit([s for _, s in good])
                fatal = [f for f in b.failures if f[2] is not None and is_fatal(f[2])]
                if ctx.on_error == "raise" or fatal:
                    row, idx, e = fatal[0] if fatal else min(b.failures, key=lambda f: f[0])
                    assert e is not None
                    raise sample_error(ctx.dataset, idx, e, b.k)
                ctx.skips.record(b, ctx.epoch)           # in_order=False: short batch
                good = b.good_samples_host
                _let_go(b)
                if not good:
                    continue
                return self._emit([s for _, s in good])
            return self._deliver(b)

    def _next_skipping(self) -> Any:
        """in_order with on_error="skip": batch j = the next successful samples."""
        ctx, p = self._ctx, self._p
        if not self._carry:
            b = self._take()
            if b.error is not None:
                raise _batch_error(ctx.dataset, b)
            if not b.failures:
                self._emitted += 1
                return self._deliver(b)
            p.retry_failed_here(b)
            ctx.skips.record(b, ctx.epoch)
            self._set_carry(self._carry + b.good_samples_host)
            _let_go(b)
        target = (ctx.batch_size or 1) if ctx.plan.user_batch_sampler is None \
            else p.sizes[min(self._emitted, len(p.sizes) - 1)]
        while len(self._carry) < target:
            try:
                b = self._take(want_rows=True)
            except StopIteration:
                break
            if b.error is not None:
                raise _batch_error(ctx.dataset, b)
            p.retry_failed_here(b)
            ctx.skips.record(b, ctx.epoch)
            self._set_carry(self._carry + b.good_samples_host)
            _let_go(b)
        if not self._carry:
            raise StopIteration
        chunk = self._carry[:target]
        self._set_carry(self._carry[target:])
        if len(chunk) < target and ctx.drop_last and ctx.batch_size is not None:
            self._set_carry([])
            raise StopIteration
        self._emitted += 1
        return self._emit([s for _, s in chunk])

    def _take(self, want_rows: bool = False) -> Batch:
        """The next batch from the pipeline, its credit returned; StopIteration at the end.

        With ``want_rows`` (or when samples failed) the successful samples are
        copied out as ``b.good_samples_host`` before the batch's slot is reused.
        """
        ctx, p = self._ctx, self._p
        while True:
            k = p.taken if ctx.in_order else None
            if p.inline:
                # this thread loads the batch in wait() and nothing else runs Python:
                # no output need be held for freeing here (see _retire), and what the
                # user let go of is freed now, its memory warm for this batch
                self._held.clear()
            b = p.wait(k, ctx.timeout)
            self._retire()
            if b is None:
                raise StopIteration
            end = (b.indices[-1] + 1 if b.indices else None) if ctx.iterable else None
            self._progress.took(b.k, b.n, end)
            if b.n or b.error is not None:
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
            ctx.host_pool.trim(p.unstarted())
        stats = ctx.stats
        if ctx.layouts.layout is not None and stats.path in ("", "collate"):
            stats.path = "ring" if b.mode == "ring" else stats.path
        if b.mode == "batch":
            stats.path = "batch"
        return b

    def _retire(self) -> None:
        """Let go of the output handed out two ``next()`` calls ago (the user, in
        ``for batch in loader``, still holds the last one).  Called as the
        consumer takes a batch, so that where the user dropped that output too,
        its tensors are freed now: while the thread that readied the batch waits
        for the hand-over (see ``BatchHandoff._mark_ready``).  Freeing a tensor
        lets go of the GIL (torch frees the C++ tensor without it); where the user
        drops it at ``for``'s next step, a decode thread running Python takes the
        GIL, and the consumer waits for it a switch interval (5 ms) or more per
        tensor.  Here nothing runs Python but the consumer,
        which gets the GIL back at once.  Outputs the user keeps only lose a
        reference; ``_close`` lets go of both."""
        held = self._held
        while len(held) > 1:
            held.popleft()

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
        out, event = p.to_target(p.collate(samples))
        if p.copy is not None:
            p.copy.hand_over(out, event)
        return out

    # ---------------------------------------------------------------- closing
    def _close(self, reason: str | None) -> None:
        """Stop this pass and join its threads (``reason`` None: it simply ended)."""
        self._p.acct.stop()
        self._held.clear()
        if self._view is not None:
            self._view.close()
        if reason is None:
            self._p.finish()
        else:
            self._p.stop(reason)
        self._runtime.close(wait=True, reason=reason or "the pass ended")
        # a pass's batch memory goes with it (batches still held keep theirs)
        self._p.forget()
        self._ctx.host_pool.clear()
        if self._finalizer.detach() is not None and not self._done:
            _rewind(self._ctx.plan, self._ctx.generator, self._progress)

    def close(self) -> None:
        """Stop this pass early. Idempotent."""
        self._close("closed")


def _batch_error(dataset: Any, b: Batch) -> BaseException:
    """What the consumer raises for a batch-level error: a sampler's error as it is;
    a ``__getitems__`` or ``collate_fn`` error as an exception of its type that is
    also a :class:`SampleError` naming the batch."""
    e = b.error
    assert e is not None
    if isinstance(e, AsyncFeedError) or is_fatal(e) or b.mode == "plan":
        return e
    if b.mode == "batch":
        return rebuild_error(e, b.indices, None, b.k)
    shown = f"{b.indices[:8]}{'...' if b.n > 8 else ''}"
    return rebuild_error(e, b.indices, None, b.k,
                         subject=f"collating (indices {shown})")
