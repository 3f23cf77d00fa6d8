"""One pass over an IterableDataset.

An iterator cannot be advanced from two threads at once, so only one thread
pulls from it at a time: it takes the iterator's lock, pulls a chunk of
``batch_size`` items and hands the chunk on, and it keeps pulling while the
consumer has credit for more batches.  Everything else happens in the other
decode threads, in parallel:

- a dataset that **splits its work** (``iter_raw()`` and ``decode(raw, index)``, see
  :func:`split_decode`) is pulled raw, and each raw item is decoded in a decode
  thread of its own;
- any other iterable is pulled with ``next(iter(dataset))``, which does all of
  its work under the lock; collating and the device copy still run outside it.

Decoded chunks are assembled into batches in stream order, with DataLoader's
rules: a batch is the next ``batch_size`` items; with ``on_error="raise"`` an
item that failed (pulling or decoding it) ends its batch, which the consumer
receives as that error; with ``"skip"`` failures are passed over and the batch
is filled from the next items (cut short after ``MAX_CONSECUTIVE_ERRORS``
failures in a row, so a stream that only fails still reports its skips); a
short last batch is dropped with ``drop_last`` (its failures are still
reported).  Batch numbers follow the stream, so the batches are those of
``DataLoader(num_workers=0)`` over the same iterable, however the decoding
threads interleave.

Batches keep ``samples`` aligned with their rows (``None`` where an item
failed), as map-style batches do, so ``Pipeline.good_samples`` applies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..protocols import DeviceTransfer
from .accounting import ASSEMBLE, DECODE, FETCH, H2D, Resource
from .capabilities import Capabilities
from .handoff import BatchHandoff, PassConfig
from .batch import Batch, BatchMode
from .runtime import Runtime
from .stream import StreamTracker

__all__ = ["IterablePipeline", "MAX_CONSECUTIVE_ERRORS", "split_decode"]

MAX_CONSECUTIVE_ERRORS = 100


def split_decode(dataset: Any) -> Callable[[Any, int], Any] | None:
    """The dataset's ``decode(raw, index)`` when it splits its work, else None.

    A dataset splits its work when it has a callable ``iter_raw()`` (the raw
    items of a pass, cheap to produce, pulled one thread at a time) and a
    callable ``decode(raw, index)`` (the heavy part, called from several threads
    at once), with ``iter(dataset)`` yielding ``decode(raw, i)`` for the ``i``-th
    item of ``iter_raw()`` (see :class:`asyncfeed.protocols.SplitIterableDataset`).
    ``use_iter_raw = False`` on the dataset turns the split off (e.g. in a
    subclass whose ``__iter__`` does more).  The loader reads this once, in
    :meth:`Capabilities.of`.
    """
    return Capabilities.of(dataset).decode


class _Chunk:
    """Items pulled together: a raw item or sample per row, or the error it raised."""

    __slots__ = ("seq", "start", "items", "errors", "pending", "last")

    def __init__(self, seq: int, start: int) -> None:
        self.seq = seq                      # chunks are assembled in this order
        self.start = start                  # stream position of the first item
        self.items: list[Any] = []
        self.errors: list[BaseException | None] = []
        self.pending = 0                    # items still being decoded
        self.last = False                   # the stream ended in this chunk


class IterablePipeline(BatchHandoff):
    """A pass over ``iter(dataset)``; ``on_error="skip"`` (``config.skip``) pulls past
    failures.  Batches are always collated (no layout, host pool or slot ring).

    ``ranks=(rank, world_size)``: handed to ``dataset.set_rank`` (when the
    dataset has one) before the pass's iterator is made, so a dataset that
    shards itself reads this process's share.  ``caps``: the dataset's
    capabilities as the loader read them (read here when not given).  ``stream``:
    opens the pass (resuming it where a loader state says) and snapshots the
    dataset's own state as chunks are pulled (see ``_stream``).
    """

    def __init__(self, config: PassConfig, *, dataset: Any, runtime: Runtime,
                 copy: DeviceTransfer | None, ranks: tuple[int, int] | None = None,
                 caps: Capabilities | None = None,
                 stream: StreamTracker | None = None) -> None:
        super().__init__(config, runtime=runtime, copy=copy)
        caps = caps if caps is not None else Capabilities.of(dataset)
        if ranks is not None and caps.set_rank is not None:
            caps.set_rank(*ranks)
        self.decode_fn = caps.decode if caps.iter_raw is not None else None
        # in the caller's thread, at iter(), as DataLoader does
        def make() -> Any:
            return iter(caps.iter_raw()) if caps.iter_raw is not None else iter(dataset)
        self.stream = stream
        self.it: Any
        self.it, start = stream.open(make) if stream is not None else (make(), 0)
        # one thread pulls at a time: pulling is a resource of capacity 1, and it is
        # the read ("fetch") when the dataset splits its work, else all of it ("decode")
        self.pull_stage = FETCH if self.decode_fn is not None else DECODE
        self.acct.resources = (
            Resource("iterator", (self.pull_stage,), 1),
            Resource("threads", (DECODE, ASSEMBLE) if self.decode_fn is not None
                     else (ASSEMBLE,), runtime.num_threads),
        ) + ((Resource("copy", (H2D,), 1),) if copy is not None else ())
        self.drop_last = config.drop_last
        self.skip = config.skip
        self.size = config.batch_size or 1
        # pulling (under it_lock)
        self.it_lock = threading.Lock()
        self.position = start    # items pulled from the stream so far
        self.pulled = 0          # chunks pulled so far
        # credits not yet given to a chunk (under cond).  Every credit is one batch
        # to come: ``submitted`` = batches made + chunks not yet assembled + wanted.
        self.wanted = 0
        self._count_lock = threading.Lock()
        # assembly (under asm_lock): chunks in stream order, cut into batches
        self.asm_lock = threading.Lock()
        self._decoded: dict[int, _Chunk] = {}
        self._next_chunk = 0
        self.made = 0            # batches numbered so far
        self._rows: list[Any] = []
        self._row_failures: list[tuple[int, Any, BaseException | None]] = []
        self._start = 0
        self._good = 0
        self._errors_in_row = 0

    def forget(self) -> None:
        """See ``BatchHandoff.forget``; the decoded chunks and the rows of the batch
        being cut go too."""
        super().forget()
        with self.asm_lock:
            self._decoded.clear()
            self._reset()

    # ------------------------------------------------------------------ credit
    def top_up(self) -> None:
        """Ask for chunks while fewer than ``prefetch`` batches are outstanding
        (any thread)."""
        with self.cond:
            want = 0
            while not self.exhausted and not self.stopping \
                    and self.submitted - self.taken < self.prefetch:
                self.submitted += 1
                want += 1
            self.wanted += want
        if want:
            self._spawn(self._pull)

    def _spawn(self, fn: Callable[..., None], *args: Any) -> bool:
        if self.runtime.submit(fn, *args) is None:
            self.stop("the loader's threads were shut down")  # the runtime is closing
            return False
        return True

    # ----------------------------------------------------------------- pulling
    def _pull(self) -> None:
        """Pull the chunks wanted; one thread at a time, the others leave it to that one."""
        while not self.stopping:
            if not self.it_lock.acquire(blocking=False):
                return  # the thread pulling now sees the new credit before it stops
            try:
                while not self.stopping:
                    with self.cond:
                        if not self.wanted:
                            break
                        self.wanted -= 1  # the credit goes with the chunk
                    self._dispatch(self._pull_chunk())
            finally:
                self.it_lock.release()
            with self.cond:  # credit given after our last look and before the release
                if not self.wanted:
                    return

    def _pull_chunk(self) -> _Chunk:
        if self.stream is not None:
            self.stream.mark(self.position, self.it)
        c = _Chunk(self.pulled, self.position)
        self.pulled += 1
        it = self.it
        acct, stage = self.acct, self.pull_stage
        t = acct.begin()
        while len(c.items) < self.size:
            try:
                item = next(it)
            except StopIteration:
                c.last = True
                break
            except BaseException as e:  # noqa: BLE001 - travels to the consumer
                c.items.append(None)
                c.errors.append(e)
            else:
                c.items.append(item)
                c.errors.append(None)
            t = acct.end(stage, t)
        self.position += len(c.items)
        if c.last:
            if self.stream is not None:  # where the pass ended: see StreamTracker.ended
                self.stream.mark(self.position, it)
            with self.cond:
                self._plan_exhausted()
                self.submitted -= self.wanted  # credits no chunk will use
                self.wanted = 0
                self.cond.notify_all()
        return c

    def _dispatch(self, c: _Chunk) -> None:
        """Decode the chunk's items in the pool, or assemble it there (in another thread)."""
        if self.decode_fn is None:
            self._spawn(self._chunk_done, c)
            return
        rows = [r for r, e in enumerate(c.errors) if e is None]
        if not rows:
            self._spawn(self._chunk_done, c)
            return
        c.pending = len(rows)
        for r in rows:
            if not self._spawn(self._decode_row, c, r):
                return

    # ---------------------------------------------------------------- decoding
    def _decode_row(self, c: _Chunk, row: int) -> None:
        if self.stopping:
            return
        t = self.acct.begin()
        try:
            c.items[row] = self.decode_fn(c.items[row], c.start + row)  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            c.items[row] = None
            c.errors[row] = e
        self.acct.end(DECODE, t)
        with self._count_lock:
            c.pending -= 1
            done = c.pending == 0
        if done:
            self._chunk_done(c)

    # ---------------------------------------------------------------- assembly
    def _chunk_done(self, c: _Chunk) -> None:
        """Cut every chunk now complete, in stream order, into batches; collate them here."""
        if self.stopping:
            return
        made: list[tuple[Batch, bool]] = []
        with self.asm_lock:
            self._decoded[c.seq] = c
            used = 0
            while self._next_chunk in self._decoded:
                ch = self._decoded.pop(self._next_chunk)
                self._next_chunk += 1
                used += 1
                for r, (item, err) in enumerate(zip(ch.items, ch.errors)):
                    self._add(ch.start + r, item, err, made)
                ch.items, ch.errors = [], []  # the batches hold them now
                if ch.last:
                    self._flush(made)
            with self.cond:
                for b, _ in made:
                    self._tracked[b.k] = b
                self.submitted += len(made) - used  # each chunk's credit becomes its batches
                self.cond.notify_all()
        for b, collate in made:
            self._finish_batch(b, collate)
        if len(made) < used:
            self.top_up()  # credit came back: pull more, the consumer may be waiting

    def _add(self, pos: int, item: Any, err: BaseException | None,
             made: list[tuple[Batch, bool]]) -> None:
        if not self._rows:
            self._start = pos
        row = len(self._rows)
        self._rows.append(item)
        if err is None:
            self._good += 1
            self._errors_in_row = 0
            if self._good == self.size:
                self._cut(made, collate=True)
            return
        self._row_failures.append((row, pos, err))
        self._errors_in_row += 1
        if not self.skip or self._errors_in_row >= MAX_CONSECUTIVE_ERRORS:
            # raise: the error ends the batch, as in DataLoader's fetch loop;
            # skip: a long run of failures is reported now, the good samples go out short
            self._cut(made, collate=False)

    def _flush(self, made: list[tuple[Batch, bool]]) -> None:
        """The stream ended: the last, short batch (or only its failures, with drop_last)."""
        if not self._rows:
            return
        if self.drop_last and self._good < self.size:
            if not self._row_failures:
                self._reset()
                return
            # the samples are dropped; the failures are still reported (skip mode)
            fails = self._row_failures
            self._rows = [None] * len(fails)
            self._row_failures = [(r, pos, e) for r, (_, pos, e) in enumerate(fails)]
            self._cut(made, collate=False, indices=[pos for _, pos, _ in fails])
            return
        self._cut(made, collate=True)

    def _cut(self, made: list[tuple[Batch, bool]], collate: bool,
             indices: list[Any] | None = None) -> None:
        rows = self._rows
        b = Batch(self.made, indices if indices is not None
                  else list(range(self._start, self._start + len(rows))), BatchMode.COLLATE)
        self.made += 1
        b.samples = rows
        b.failures = self._row_failures
        b.remaining = 0
        b.done[:] = b"\x01" * b.n
        made.append((b, collate and self._good > 0))
        self._reset()

    def _reset(self) -> None:
        self._rows = []
        self._row_failures = []
        self._good = 0
        self._errors_in_row = 0

    def _finish_batch(self, b: Batch, collate: bool) -> None:
        t = self.acct.begin()
        try:
            if collate:
                failed = {r for r, _, _ in b.failures}
                good = [s for r, s in enumerate(b.samples) if r not in failed]
                host = self.collate(good)
                del good
                b.output, b.event = self.to_target(host)
                b.samples = [None] * b.n  # the batch holds the data now
        except BaseException as e:  # noqa: BLE001
            b.error = e
        self.acct.end(ASSEMBLE, t)
        self._mark_ready(b)
