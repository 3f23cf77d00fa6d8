"""A pass's explicit state (``PassState``), its frozen config, and an injected copy stream."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from asyncfeed import AsyncLoader, LoaderClosedError
from asyncfeed._engine.handoff import BatchHandoff, PassConfig, PassState
from asyncfeed._engine.iterable import IterablePipeline
from asyncfeed._engine.pipeline import Pipeline
from asyncfeed._engine.runtime import Runtime
from asyncfeed._memory.device import map_tensors
from asyncfeed.protocols import DeviceTransfer
from support.oracle import assert_same_batches


class Squares:
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return torch.full((3,), i * i, dtype=torch.int64), i


class Count(IterableDataset):
    def __iter__(self):
        return iter(range(9))


# ----------------------------------------------------------------- PassState
def test_a_pass_runs_drains_and_finishes():
    with AsyncLoader(Squares(), batch_size=4, num_threads=2, prefetch=2) as al:
        it = iter(al)
        p = it._p
        assert p.state is PassState.RUNNING and not p.exhausted and not p.stopping
        got = [next(it) for _ in range(7)]     # 8 batches: the plan is now exhausted
        assert p.state is PassState.DRAINING and p.exhausted and not p.stopping
        got.append(next(it))
        with pytest.raises(StopIteration):
            next(it)
        assert p.state is PassState.FINISHED and p.stopping and it._done
        it.close()                             # a finished pass stays finished
        assert p.state is PassState.FINISHED
        with pytest.raises(StopIteration):
            next(it)
    assert_same_batches(got, list(DataLoader(Squares(), batch_size=4)))


def test_a_closed_pass_says_why_and_stays_closed():
    with AsyncLoader(Squares(), batch_size=4, num_threads=2) as al:
        it = iter(al)
        next(it)
        it2 = iter(al)                         # supersedes the first pass
        p = it._p
        assert p.state is PassState.CLOSED and p.stopping and not it._done
        assert "superseded" in p.close_reason
        p.finish()
        assert p.state is PassState.CLOSED
        with pytest.raises(LoaderClosedError, match="superseded"):
            next(it)
        next(it2)
        it2.close()
        assert it2._p.state is PassState.CLOSED and it2._p.close_reason == "closed"


def test_a_closed_pass_wakes_its_waiter():
    """stop() from another thread wakes a consumer waiting for a batch."""
    gate = threading.Event()

    class Slow(Squares):
        def __getitem__(self, i):
            gate.wait(10)
            return super().__getitem__(i)

    with AsyncLoader(Slow(), batch_size=2, num_threads=1) as al:
        it = iter(al)
        threading.Timer(0.2, it._p.stop, args=("stopped by the test",)).start()
        with pytest.raises(LoaderClosedError):
            it._p.wait(0, 10)
        gate.set()


class FirstBatchTail:
    """Sequential rows; the first batch's last row (``hold``) waits until a row of a
    later batch has started (at most ``wait_s``), and notes whether one did."""

    def __init__(self, n: int, hold: int, wait_s: float = 10.0) -> None:
        self.n, self.hold, self.wait_s = n, hold, wait_s
        self.later_started = threading.Event()
        self.overlapped: bool | None = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i > self.hold:
            self.later_started.set()
        elif i == self.hold:
            self.overlapped = self.later_started.wait(self.wait_s)
        return torch.full((3,), i, dtype=torch.int64), i


@pytest.mark.timeout(60)
def test_the_next_batches_are_planned_once_the_first_rows_know_the_layout():
    """A pass plans the batches after its first as soon as the first rows have read
    the layout, not once the consumer has taken the first batch: a thread that has
    no row of the first batch left runs the next batch's rows meanwhile (here the
    first batch's last row waits for that), and every batch still comes in order."""
    ds = FirstBatchTail(16, hold=3)
    with AsyncLoader(ds, batch_size=4, num_threads=2, prefetch=2) as al:
        got = [b[1].tolist() for b in al]
    assert ds.overlapped is True
    assert got == [[4 * k + j for j in range(4)] for k in range(4)]


def test_iterable_pass_state():
    with AsyncLoader(Count(), batch_size=4, num_threads=2) as al:
        it = iter(al)
        assert it._p.state is PassState.RUNNING
        assert_same_batches(list(it), list(DataLoader(Count(), batch_size=4)))
        assert it._p.state is PassState.FINISHED


def test_both_passes_share_a_small_base_not_each_other():
    assert issubclass(Pipeline, BatchHandoff) and issubclass(IterablePipeline, BatchHandoff)
    assert not issubclass(IterablePipeline, Pipeline)


def test_pass_config_is_frozen_and_given_whole():
    with AsyncLoader(Squares(), batch_size=4, num_threads=2, prefetch=3,
                     io_concurrency=7) as al:
        it = iter(al)
        cfg = it._p.config
        assert isinstance(cfg, PassConfig)
        assert (cfg.batch_size, cfg.prefetch, cfg.io_concurrency) == (4, 3, 7)
        assert cfg.default_collate and cfg.auto_collation and not cfg.skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.prefetch = 1  # type: ignore[misc]
        it.close()
    rt = Runtime(1, with_loop=False)
    try:
        p = IterablePipeline(PassConfig(batch_size=3, collate=list, drop_last=True, skip=True),
                             dataset=Count(), runtime=rt, copy=None)
        assert p.skip and p.drop_last and p.size == 3 and p.memory is None
    finally:
        rt.close()


# ----------------------------------------------------------- copy_stream injection
class QueueCopy:
    """A DeviceTransfer without CUDA: a thread "copies" each batch, then completes its
    event; counts what it pinned, copied and handed over."""

    class Event:
        def __init__(self) -> None:
            self.done = threading.Event()

        def query(self) -> bool:
            return self.done.is_set()

        def synchronize(self) -> None:
            assert self.done.wait(10)

    def __init__(self) -> None:
        self.pinned = self.copied = self.handed = 0
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="test-queue-copy")
        self.thread.start()

    def pin(self, host):
        self.pinned += 1
        return host

    def to_device(self, host):
        pairs = []

        def alloc(t):
            pairs.append((t, torch.empty_like(t)))
            return pairs[-1][1]
        out, ev = map_tensors(host, alloc), QueueCopy.Event()
        self.q.put((pairs, ev))
        return out, ev

    def hand_over(self, out, ev):
        self.handed += 1
        ev.synchronize()

    def _run(self):
        while (item := self.q.get()) is not None:
            pairs, ev = item
            for s, d in pairs:
                d.copy_(s)
            self.copied += 1
            ev.done.set()

    def close(self):
        self.q.put(None)
        self.thread.join()


@pytest.mark.parametrize("pin_memory", [None, False])
def test_an_injected_copy_stream_carries_every_batch(pin_memory):
    copy = QueueCopy()
    assert isinstance(copy, DeviceTransfer)
    try:
        with AsyncLoader(Squares(), batch_size=4, num_threads=2, prefetch=2,
                         copy_stream=copy, pin_memory=pin_memory) as al:
            got = list(al)
            ring = al._ring
        assert_same_batches(got, list(DataLoader(Squares(), batch_size=4)))
        assert copy.copied == copy.handed == len(got) == 8
        if pin_memory is None:      # pinned by the transfer, written into its slot ring
            assert ring is not None and ring.count == 2 and copy.pinned > 0
        else:                       # pin_memory=False: host batches, copied as they are
            assert ring is None and copy.pinned == 0
    finally:
        copy.close()


def test_copy_stream_must_be_a_device_transfer():
    with pytest.raises(TypeError, match="DeviceTransfer"):
        AsyncLoader(Squares(), copy_stream=object())


def test_an_inline_consumer_finds_a_task_queued_without_a_notify():
    """An inline consumer (it runs the queued tasks while it waits) finds a task
    that reached the queue with no notify -- a decode thread puts back the task it
    took while its gate was being installed -- within a few milliseconds, not
    after the one-second wait that serves a consumer whose batches threads make."""
    from asyncfeed._engine.tasksize import Gate
    from asyncfeed._engine.batch import Batch
    rt = Runtime(1, with_loop=False)
    try:
        rt.pool.admit(Gate(0))  # its thread runs nothing: the consumer does
        p = BatchHandoff(PassConfig(batch_size=1, collate=list), runtime=rt, copy=None)
        p.inline = True
        b = Batch(0, [0], "collate")
        p.submitted = 1
        threading.Timer(0.2, rt.pool._q.put, args=((p._mark_ready, (b,)),)).start()
        t0 = time.monotonic()
        assert p.wait(0, 5) is b
        assert time.monotonic() - t0 < 0.6
        p.stop()
    finally:
        rt.close()


def test_the_thread_that_readied_a_batch_waits_for_the_consumers_hand_over(monkeypatch):
    """The thread that readied the batch the consumer waits for goes on only once the
    consumer is done with its hand-over (``handed()``), not as soon as it took the
    batch: the consumer plans and assembles with nobody contending for the GIL."""
    from asyncfeed._engine import handoff
    from asyncfeed._engine.batch import Batch
    monkeypatch.setattr(handoff, "HAND_S", 5.0)
    rt = Runtime(1, with_loop=False)
    try:
        p = BatchHandoff(PassConfig(batch_size=1, collate=list), runtime=rt, copy=None)
        b = Batch(0, [0], "collate")
        p.submitted = 1
        went_on = threading.Event()

        def ready() -> None:
            p._mark_ready(b)
            went_on.set()

        threading.Timer(0.1, ready).start()  # the consumer waits by then
        assert p.wait(0, 5) is b
        assert not went_on.wait(0.3)         # taken, but not handed over yet
        p.handed()
        assert went_on.wait(2)
        p.handed()                           # idempotent
        p.stop()
    finally:
        rt.close()


def test_every_next_hands_the_batch_over(monkeypatch):
    """``__next__`` ends the hand-over: with the readying thread's wait stretched to
    5 s, a pass of 12 batches on one thread still takes well under one such wait."""
    from asyncfeed._engine import handoff
    monkeypatch.setattr(handoff, "HAND_S", 5.0)
    t0 = time.monotonic()
    with AsyncLoader(Squares(), batch_size=2, num_threads=1) as al:
        got = list(al)
    assert time.monotonic() - t0 < 4.0
    assert_same_batches(got, list(DataLoader(Squares(), batch_size=2)))


@pytest.mark.parametrize("threads", [1, 2])
def test_one_pinned_thread_gets_each_batch_as_one_task(monkeypatch, threads):
    from asyncfeed._engine import rowtasks
    runs: list[tuple[int, int, int]] = []
    real = rowtasks.run_rows

    def spy(p, b, lo, hi):
        runs.append((b.n, lo, hi))
        real(p, b, lo, hi)

    class Slowish(Squares):  # 1 ms rows: tasks of ~2 ms would hold two of them
        def __getitem__(self, i):
            time.sleep(0.001)
            return super().__getitem__(i)

    monkeypatch.setattr(rowtasks, "run_rows", spy)
    with AsyncLoader(Slowish(), batch_size=10, num_threads=threads) as al:
        got = list(al)
    assert_same_batches(got, list(DataLoader(Squares(), batch_size=10)))
    ring = [r for r in runs if r[0] == 10]
    assert ring
    if threads == 1:
        assert all((lo, hi) == (0, 10) for _, lo, hi in ring), ring
    else:
        assert any((lo, hi) != (0, 10) for _, lo, hi in ring), ring
