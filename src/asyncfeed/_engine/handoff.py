"""The consumer's side of one pass, shared by both kinds of pass.

A pass (``Pipeline`` over an index plan, ``IterablePipeline`` over a stream)
makes batches in its threads and hands them to the consumer's thread here:
finished batches wait in ``ready`` by number, ``submitted - taken`` is the
credit in use, and :class:`PassState` says where the pass stands.  A pass is
configured by one frozen :class:`PassConfig` plus its live collaborators (the
runtime, the device transfer and the loader's :class:`BatchMemory`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._errors import LoaderClosedError, LoaderTimeout
from .._memory.layout import Layout
from ..protocols import DeviceTransfer
from . import transfer
from .accounting import QUEUE, Accounting
from .batch import WRITTEN, Batch, BatchMode
from .runtime import Runtime

if TYPE_CHECKING:
    from .._memory.slots import SlotRing

__all__ = ["BatchHandoff", "BatchMemory", "PassConfig", "PassState"]


class PassState(enum.Enum):
    """Where one pass stands.  It only moves forward:

    ``RUNNING`` → ``DRAINING`` → ``FINISHED``, and from ``RUNNING`` or
    ``DRAINING`` to ``CLOSED``.  ``FINISHED`` and ``CLOSED`` are final.
    """

    RUNNING = "running"      # the plan (or stream) still has batches to start
    DRAINING = "draining"    # the plan is exhausted: batches in flight finish, none start
    FINISHED = "finished"    # the consumer got every batch (StopIteration)
    CLOSED = "closed"        # stopped early: close(), a break, a new iter(), a loaded state


_ENDED = frozenset({PassState.FINISHED, PassState.CLOSED})

T = TypeVar("T")

#: the longest an inline consumer (see ``BatchHandoff.wait``) sleeps before it looks for
#: a queued task again: a decode thread that took a task as its gate was installed
#: puts it back without a notify (``TaskPool._work``)
INLINE_LOOK_S = 0.005

#: the longest a thread that readied the batch the consumer waits for waits for the
#: consumer to take it and be done with its hand-over (see ``BatchHandoff._mark_ready``)
HAND_S = 0.002


@dataclass(frozen=True)
class PassConfig:
    """What a pass is told, fixed for the pass (the loader's settings, resolved)."""

    batch_size: int | None
    collate: Callable[[list[Any]], Any]
    auto_collation: bool = True
    default_collate: bool = False   # the collate is torch's default_collate (rows allowed)
    prefetch: int = 2               # batches outstanding at most
    prefetch_given: bool = False    # the user's (a bound); else a default worker
                                    # processes may raise (Pipeline.ahead)
    io_concurrency: int = 64        # fetches in flight on the event loop
    in_order: bool = True           # batches are delivered in plan order
    readahead_bytes: int | None = 0  # raw reads ahead of the decode window (0: off,
                                     # None: automatic; see readahead.py)
    pin_host: bool = False          # host batches are pinned (by the transfer, if any)
    drop_last: bool = False         # (iterable passes) drop a short last batch
    skip: bool = False              # (iterable passes) on_error="skip"


class BatchMemory(Protocol):
    """Where a pass's batch buffers come from (the loader's host pool and slot ring)."""

    def ring(self, layout: Layout, rows: int) -> SlotRing | None:
        """The slot ring for batches of ``layout`` and up to ``rows`` rows (None: no ring)."""
        ...

    def host_buffers(self, layout: Layout, rows: int) -> tuple[list[Any], list[Any]]:
        """Host buffers for one batch of ``rows`` rows, and their NumPy views
        (``Layout.numpy_views``)."""
        ...


class BatchHandoff:
    """Ready batches, credit and lifecycle of one pass (see the module docstring).

    ``cond`` guards ``ready``, ``_tracked`` and the state; every change a waiter
    may care about notifies it, so ``close()`` wakes the consumer at once.
    """

    def __init__(self, config: PassConfig, *, runtime: Runtime,
                 copy: DeviceTransfer | None, memory: BatchMemory | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.copy = copy
        self.memory = memory
        self.collate = config.collate
        self.prefetch = config.prefetch
        self.pin_host = config.pin_host
        self.batch_size = config.batch_size
        self.auto_collation = config.auto_collation
        self.cond = threading.Condition()
        self.ready: dict[int, Batch] = {}
        # the batch the consumer is blocked waiting for (-1: any; None: not waiting),
        # and the hand-over of the GIL to it (see _mark_ready)
        self._awaited: int | None = None
        self._calls: list[Callable[[], None]] = []  # see call_waiting
        self.inline = False  # the consumer runs queued tasks while it waits (Mode.INLINE)
        # past the pass's start: the consumer waited for a batch after its first, or the
        # ready batches filled the credit (before, the producer fills the credit at
        # its own pace, whatever the consumer takes: no measure of the pass)
        self.primed = False
        self.waiting_since = 0.0  # perf_counter() when the consumer's wait() began (0: none)
        self._handing: Any = None  # the lock a readying thread waits on until it is taken
        self._taken_hand: Any = None  # ... and, once taken, until the consumer's handed()
        self.submitted = 0          # batches submitted so far (= next k)
        self.taken = 0              # batches handed to the consumer
        self.state = PassState.RUNNING
        self.close_reason: str | None = None
        # views of ``state``, kept as plain attributes for the per-row checks of the
        # decode loops (a property costs ~0.2 us a read); only _set_state writes them
        self.exhausted = False      # no new batch will start: the plan ran out, or ended
        self.stopping = False       # the pass is over: queued work is dropped, not done
        self.sizes: list[int] = []  # planned size of every submitted batch (map-style)
        self._tracked: dict[int, Batch] = {}   # submitted, not yet ready
        # where the pass's time goes (stats()); the pass sets acct.resources
        self.acct = Accounting()
        runtime.on_close(self.stop)  # at interpreter exit too: no sample starts after it

    # ---------------------------------------------------------------- lifecycle
    def _set_state(self, state: PassState) -> None:
        """Move to ``state`` (call with ``cond`` held): forward only, and keep
        ``exhausted``/``stopping`` in step."""
        if self.state in _ENDED or state is self.state:
            return
        if state is PassState.RUNNING or (state is PassState.DRAINING
                                          and self.state is not PassState.RUNNING):
            raise RuntimeError(f"a pass cannot go from {self.state.name} to {state.name}")
        self.state = state
        self.exhausted = True
        self.stopping = state in _ENDED

    def _plan_exhausted(self) -> None:
        """The plan has no more batches (call with ``cond`` held, then notify)."""
        self._set_state(PassState.DRAINING)

    def finish(self) -> None:
        """The consumer got every batch. Idempotent; a closed pass stays closed."""
        with self.cond:
            self._set_state(PassState.FINISHED)
            self.cond.notify_all()
        self._ended()

    def stop(self, reason: str = "stopped") -> None:
        """End the pass early: the consumer's ``wait`` raises LoaderClosedError, queued
        work is dropped.  Idempotent; a finished pass stays finished."""
        with self.cond:
            if self.state not in _ENDED:
                self.close_reason = reason
            self._set_state(PassState.CLOSED)
            self.cond.notify_all()
        self._ended()

    def _ended(self) -> None:
        """Called after the pass finished or was stopped (each time, any thread)."""

    def forget(self) -> None:
        """(once the pass ended and its threads are joined; any thread) Let go of the
        batches the consumer has not taken (an ended pass hands out none): whatever
        still refers to the pass -- a traceback the user keeps, an iterator not yet
        collected -- then keeps none of their memory (host buffers, shared-memory
        segments).  Batches the user holds keep theirs."""
        with self.cond:
            self.ready.clear()
            self._tracked.clear()

    # ----------------------------------------------------------------- consumer
    def start(self) -> None:
        """(consumer thread, at ``iter()``) Start the pass: plan its first batches."""
        self.top_up()

    def top_up(self) -> None:
        """Start batches while fewer than the credit allows are outstanding."""
        raise NotImplementedError

    def wait(self, k: int | None, timeout: float | None) -> Batch | None:
        """The batch ``k`` (or, with ``k=None``, the oldest ready one) once ready;
        None when the epoch has no more batches.  Raises LoaderTimeout, and
        LoaderClosedError once the pass was stopped (batches already ready are
        still returned until the stopped pass is joined: :meth:`forget`)."""
        deadline = None if not timeout else time.monotonic() + timeout
        self.waiting_since = time.perf_counter()
        try:
            return self._wait(k, deadline, timeout)
        finally:
            self.waiting_since = 0.0

    def _wait(self, k: int | None, deadline: float | None, timeout: float | None
              ) -> Batch | None:
        with self.cond:
            while True:
                due = self._unlocked(self.tick)
                if self._calls:
                    self._unlocked(self._run_call)
                    continue
                if k is not None:
                    if k in self.ready:
                        return self._queued(self.ready.pop(k))
                elif self.ready:
                    return self._queued(self.ready.pop(min(self.ready)))
                if self.stopping:
                    raise self._closed_error()
                if self.taken >= self.submitted and self.exhausted:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LoaderTimeout(self._timeout_message(k, timeout))
                if self.taken:  # the consumer waits (or loads) for a batch past its first
                    self.primed = True
                # with inline rows, load them here instead of waking a thread for them
                if self.inline and self._unlocked(self.runtime.pool.run_one):
                    continue
                self._awaited = -1 if k is None else k
                step = min(due, INLINE_LOOK_S if self.inline else 1.0)
                try:
                    self.cond.wait(step if remaining is None else min(remaining, step))
                finally:
                    self._awaited = None

    def _closed_error(self) -> LoaderClosedError:
        """What the consumer raises for a batch it asked for after the pass was stopped."""
        return LoaderClosedError(
            f"this iterator is closed: {self.close_reason or 'the loader was closed'}"
            " (while waiting for a batch)")

    def tick(self) -> float:
        """(consumer thread, each time it waits or looks again) What the pass does
        while the consumer waits; returns the seconds until it should be called
        again (a pass that measures its execution closes windows here)."""
        return 1.0

    def _unlocked(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the pass's lock released (the caller holds it once)."""
        self.cond.release()
        try:
            return fn()
        finally:
            self.cond.acquire()

    def call_waiting(self, fn: Callable[[], None]) -> None:
        """Have the consumer thread call ``fn`` (any thread): at once if it is waiting
        for a batch, else the next time it waits.  Calls are made in the order
        asked; one equal to a call not yet made is made once.  ``fn`` runs without
        the pass's lock; what it raises reaches the consumer (the calls after it
        are still made the next time it waits)."""
        with self.cond:
            if fn not in self._calls:
                self._calls.append(fn)
            self.cond.notify_all()

    def _run_call(self) -> bool:
        """(consumer thread, without the pass's lock) Make the oldest call
        ``call_waiting`` left, if one is left; whether one was."""
        with self.cond:
            if not self._calls:
                return False
            call = self._calls.pop(0)
        call()
        return True

    def _queued(self, b: Batch) -> Batch:
        if self._handing is not None:  # (cond held) a thread that readied it waits:
            self.handed()              # until the consumer is done with this batch
            self._taken_hand, self._handing = self._handing, None
        self.acct.add_wall(QUEUE, time.perf_counter() - b.t_ready)
        return b

    def handed(self) -> None:
        """(consumer thread) Done with the hand-over of the batch taken last (its
        credit returned, the next batches planned, the output made): the thread
        that readied it, waiting for this (at most ``HAND_S``), goes on.
        Idempotent."""
        hand, self._taken_hand = self._taken_hand, None
        if hand is not None:
            hand.release()

    def _timeout_message(self, k: int | None, timeout: float | None) -> str:
        """DataLoader's "timed out after N seconds", naming the samples still pending."""
        waiting = [f"batch {b.k} waits for samples {b.pending()[:8]}" for b in self._inflight]
        return (f"AsyncLoader timed out after {timeout} seconds (timeout={timeout})"
                + (f" waiting for batch {k}" if k is not None else "")
                + ("; " + "; ".join(waiting[:3]) if waiting else ""))

    def release(self, b: Batch) -> None:
        """The consumer took ``b``: its credit (and slot) can be used again."""
        self.taken += 1
        if b.slot is not None:
            b.slot.event = b.event
            assert b.layout is not None  # a batch with a slot is a ring batch
            ring = self.memory.ring(b.layout, b.n) if self.memory is not None else None
            if ring is not None:
                ring.release(b.slot)   # a slot of an older ring is dropped there
            b.slot = None

    def unstarted(self) -> int:
        """Outstanding batches that have not taken their host buffers yet."""
        with self.cond:
            return sum(1 for b in self._tracked.values()
                       if b.mode is BatchMode.RING and b.bufs is None and b.n)

    @property
    def _inflight(self) -> list[Batch]:
        return sorted(self._tracked.values(), key=lambda b: b.k)

    # ------------------------------------------------------------------ workers
    def _mark_ready(self, b: Batch) -> None:
        """``b`` is ready (any thread).  When the consumer is blocked waiting for
        it, this thread then waits (at most ``HAND_S``) until the consumer has
        taken it and is done with its hand-over (:meth:`handed`: the credit
        returned, the next batches planned, the output made): the consumer gets
        the GIL at once and runs that Python alone, instead of waiting for the
        GIL while this thread goes on with Python and wakes it at every release
        of the GIL (NumPy lets go of it for every copy), up to a switch
        interval -- and, with the roles swapped, this thread waking at every
        release the consumer's torch calls make while it plans and assembles."""
        b.t_ready = time.perf_counter()
        with self.cond:
            self._tracked.pop(b.k, None)
            self.ready[b.k] = b
            if len(self.ready) >= self.prefetch:
                self.primed = True
            self.cond.notify_all()
            hand = None
            if HAND_S > 0 and self._handing is None and self._awaited in (-1, b.k):
                hand = self._handing = threading.Lock()
                hand.acquire()
        if hand is not None and not hand.acquire(timeout=HAND_S):
            with self.cond:
                if self._handing is hand:
                    self._handing = None  # not taken in time: nobody releases it now

    def to_target(self, host: Any) -> tuple[Any, Any]:
        """Pin or start the device copy of a host batch; returns (batch, event)."""
        return transfer.to_target(self.copy, self.pin_host, host)

    def retry_failed_here(self, b: Batch) -> bool:
        """(consumer thread) Load again in this thread the rows of ``b`` that failed
        elsewhere, where that is known to help; whether any row was loaded here
        (then they are in ``b.good_samples_host``, and left ``b.failures``).  None
        is here; the map-style pass's does it (see ``threadbound``)."""
        return False

    def good_samples(self, b: Batch) -> list[tuple[Any, Any]]:
        """(index, host sample) of every sample of ``b`` that loaded, in batch order."""
        failed = {r for r, _, _ in b.failures}
        out = []
        for r, idx in enumerate(b.indices):
            if r in failed:
                continue
            if b.mode is BatchMode.RING and (not b.mismatch or b.samples[r] is WRITTEN):
                assert b.layout is not None and b.bufs is not None  # a ring batch's layout is known
                out.append((idx, b.layout.row_sample(b.bufs, r)))
            else:
                out.append((idx, b.samples[r]))
        return out
