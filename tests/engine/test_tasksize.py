"""Decode tasks (their size, the gate, the row writer) and candidates switched
mid-pass: whatever runs the rows, batches stay bit-identical to DataLoader's
and no thread is left parked or running.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._engine.policy import INLINE, Mode, processes, threads
from asyncfeed._engine.tasksize import Gate, rows_per_task
from asyncfeed._memory.layout import Layout
from asyncfeed._engine.rowwrite import FlatWriter
from support.buffers import assert_same_buffers, zeroed_pair
from support.oracle import MixedFixed, TupleFixed, assert_parity


def test_rows_per_task_hands_tiny_samples_out_in_batches():
    assert rows_per_task(128, 4, None) == 8                    # before any measurement
    assert rows_per_task(128, 1, 20e-6) == 100                 # tiny: ~2 ms per task
    assert rows_per_task(128, 1, 1e-6) == 128                  # whole batch
    assert rows_per_task(128, 4, 1e-6) == 32                   # every running thread a share
    assert rows_per_task(32, 4, 5e-3) == 1                     # expensive: one row a task
    assert rows_per_task(32, 4, 5e-3, 4e-3) == 1               # ... on a core: still one
    # rows that mostly wait (5 ms, 10 us of CPU): two a task, even with many threads
    assert rows_per_task(32, 128, 5e-3, 1e-5) == 2


def test_gate_lets_limit_tasks_run_and_open_releases_waiters():
    g = Gate(1)
    g.enter()
    entered = threading.Event()

    def second() -> None:
        g.enter()
        entered.set()
        g.leave()
    th = threading.Thread(target=second, name="asyncfeed-test-gate")
    th.start()
    assert not entered.wait(0.2)
    g.open()
    assert entered.wait(5)
    th.join(5)
    g.leave()


@pytest.mark.parametrize("sample", [
    (np.arange(12, dtype=np.int16).reshape(3, 4), 7),
    (torch.arange(6, dtype=torch.float32).reshape(2, 3), 2.5, True, "name", b"x"),
    [torch.zeros(2, dtype=torch.uint8), np.float64(0) * np.ones(2)],
    np.ones((2, 2), dtype=np.float32),
])
def test_flat_writer_writes_the_bytes_write_row_writes(sample):
    layout = Layout.infer(sample)
    w = FlatWriter.for_layout(layout)
    assert w is not None
    a, b = zeroed_pair(layout, 3)
    assert w.write(a, layout.numpy_views(a), 1, sample)
    layout.write_row(b, 1, sample, layout.numpy_views(b))
    assert_same_buffers(a, b)


def test_flat_writer_declines_what_it_does_not_handle():
    layout = Layout.infer((np.zeros(3, np.uint8), 1))
    w = FlatWriter.for_layout(layout)
    bufs = layout.allocate(2)
    views = layout.numpy_views(bufs)
    assert not w.write(bufs, views, 0, (np.zeros(4, np.uint8), 1))        # other shape
    assert not w.write(bufs, views, 0, (np.zeros(3, np.int8), 1))         # other dtype
    assert not w.write(bufs, views, 0, (np.zeros(3, np.uint8), 1.0))      # other scalar
    assert not w.write(bufs, views, 0, [np.zeros(3, np.uint8), 1])        # other container
    assert FlatWriter.for_layout(Layout.infer({"a": np.zeros(2)})) is not None  # a flat dict
    assert FlatWriter.for_layout(Layout.infer({"a": (np.zeros(2), 1)})) is None  # not flat


class TinyNumpy:
    """CIFAR-sized (3x8x8 uint8 array, int label) samples computed from the index."""

    def __init__(self, n: int = 300) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, (3, 8, 8), dtype=np.uint8), i % 10


class Varying(TupleFixed):
    """Shapes change from sample 32 on (each batch of 16 is uniform): rows give way
    to collate mid-pass."""

    def __getitem__(self, i: int):
        img, label = super().__getitem__(i)
        return (img if i < 32 else img[:, :4].contiguous()), label


@pytest.mark.parametrize("ds", [TinyNumpy(), TupleFixed(150), MixedFixed(45)],
                         ids=["tiny-numpy", "tuple", "mixed"])
@pytest.mark.parametrize("threads", [None, 1, 3])
def test_batches_match_dataloader_whatever_runs(ds, threads):
    assert_parity(ds, batch_size=16, shuffle=True, num_threads=threads)


def _collate_by_hand(batch):
    return torch.utils.data.default_collate(batch)


@pytest.mark.parametrize("collate", [None, _collate_by_hand], ids=["rows", "collate_fn"])
def test_candidates_switched_mid_pass_keep_batches_identical(collate):
    """Inline, threads of every count and worker processes applied by hand while
    batches are in flight (each switch mid-batch), or between batches the
    consumer loaded itself inline (nothing planned ahead then): the batches are
    DataLoader's, written into rows or collated by a ``collate_fn``."""
    ds = TinyNumpy(600)
    loader_kw = dict(batch_size=8, shuffle=True,
                     **({"collate_fn": collate} if collate is not None else {}))
    want = list(torch.utils.data.DataLoader(ds, generator=torch.Generator().manual_seed(3),
                                            **loader_kw))
    # threads(6): past the pool's 3 threads, which it grows
    order = [INLINE, threads(1), processes(2), threads(3), INLINE, processes(2), threads(6),
             threads(2)]
    with AsyncLoader(ds, generator=torch.Generator().manual_seed(3), num_threads=3,
                     **loader_kw) as al:
        it = iter(al)
        got = []
        for k, batch in enumerate(it):
            got.append(batch)
            if k % 5 == 0:
                assert it._p.apply(order[(k // 5) % len(order)])
    from support.oracle import assert_same_batches
    assert_same_batches(got, want)


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_shapes_that_vary_mid_pass_are_collated_like_dataloader(threads):
    assert_parity(Varying(80), batch_size=16, num_threads=threads)


def test_break_with_parked_threads_leaves_no_thread():
    ds = TinyNumpy(2000)
    al = AsyncLoader(ds, batch_size=4, prefetch=8, num_threads=4)
    it = iter(al)
    assert it._p.apply(threads(1))  # three of the four decode threads wait at the gate
    next(it)
    next(it)
    al.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("asyncfeed-")]
    assert not left, left


def test_a_thread_count_past_the_pool_grows_it_and_close_joins_every_thread():
    ds = TinyNumpy(2000)
    al = AsyncLoader(ds, batch_size=4, prefetch=8, num_threads=2)
    it = iter(al)
    next(it)
    assert it._p.runtime.pool.size == 2
    assert it._p.apply(threads(8))
    assert it._p.runtime.pool.size == 8 and it._p.runtime.num_threads == 8
    assert it._p.gate.limit == 8
    got = sum(1 for _ in zip(range(20), it))
    assert got == 20
    names = {t.name for t in threading.enumerate() if t.name.startswith("asyncfeed-decode")}
    assert len(names) == 8, names
    al.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("asyncfeed-")]
    assert not left, left


def test_tasks_are_cut_for_the_threads_a_grown_pool_has():
    """While candidates are measured, a batch is cut into tasks for the most threads
    the duel runs, up to the pool's threads: those it has now, once it grew."""
    from types import SimpleNamespace
    from asyncfeed._engine.executors import ThreadRows
    from asyncfeed._engine.taskpool import TaskPool
    from asyncfeed._engine.tasksize import RowCost
    cost = RowCost()
    cost.record(10, 1e-3, 1e-3)  # 0.1 ms of CPU a row: 20 rows make a 2 ms task
    duel = SimpleNamespace(exploring=True, decision=SimpleNamespace(most_threads=lambda: 8))
    pool = TaskPool(2, "asyncfeed-test-grow")
    try:
        rows = ThreadRows(Gate(2), cost, pool, duel)  # type: ignore[arg-type]
        assert rows.step(64) == 20  # two threads: a 2 ms task, under a thread's share
        pool.grow(8)
        assert rows.step(64) == 8  # eight threads: each its share of the batch
    finally:
        pool.shutdown()


class Held:
    """Two rows of the second batch wait until the test lets them go; the rest cost
    nothing."""

    go = threading.Event()

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in (8, 9):
            Held.go.wait(30)
        return torch.tensor([i])


def test_running_counts_the_places_threads_keep_after_the_limit_went_down():
    """Switched from 8 threads to 1, every thread holding a place takes a task of
    the candidate before (running, or waiting for one with its place kept) before
    it sees the limit went down: ``running()`` counts them, so the chooser's next
    window opens after their completions, not during them."""
    Held.go.clear()
    al = AsyncLoader(Held(), batch_size=8, prefetch=4, num_threads=8)
    it = iter(al)
    try:
        p = it._p
        next(it)  # batch 0: the layout known, the batches after it are planned
        # two rows wait; the rows after them get done, and every thread waits for a
        # task with its place kept (nothing more is planned: batch 1 is not done)
        deadline = time.monotonic() + 20
        while not (1 <= p.runtime.pool.running() <= 2 and p.gate.held == 8) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = p.runtime.pool.running()
        assert 1 <= busy <= 2 and p.gate.held == 8, (busy, p.gate.held)
        assert p.apply(threads(1))
        assert p.gate.limit == 1 and p.running() == 8
    finally:
        Held.go.set()
        al.close()


def test_stats_say_which_execution_ran():
    with AsyncLoader(TupleFixed(40), batch_size=8, num_threads=2) as al:
        list(al)
        ex = al.stats().execution
        assert (ex.mode, ex.count, ex.reason.value) == (Mode.THREADS, 2, "fixed")
        assert str(ex) == "threads: 2 threads (chosen by the loader's arguments)"
