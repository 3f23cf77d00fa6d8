"""Batch-sized decode tasks and the thread count chosen by measurement.

The tuner is driven with synthetic task reports (a clock given explicitly), so
its decisions are tested without timing anything; the loader tests check that
whatever it decides, batches stay bit-identical to DataLoader's and no thread
is left parked or running.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._engine.autotune import WINDOW_S, Gate, Tuner, rows_per_task
from asyncfeed._engine.layout import Layout
from asyncfeed._engine.rowtasks import FlatWriter
from support.buffers import assert_same_buffers, zeroed_pair
from support.oracle import MixedFixed, TupleFixed, assert_parity


def _drive(t: Tuner, rate_at, busy_at, windows: int, clock: list[float]) -> list[int]:
    """Feed ``windows`` measuring windows; each window's rate and busy cores depend
    on the limit in force.  Returns the limit after each window."""
    seen = []
    for _ in range(windows):
        n = t.limit
        for _ in range(4):  # four tasks per window, each a quarter of it
            dt = WINDOW_S / 4 * 1.01
            clock[0] += dt
            t.record(max(1, int(rate_at(n) * dt)), dt, busy_at(n) * dt, now=clock[0])
        seen.append(t.limit)
    return seen


def test_tiny_gil_bound_samples_settle_on_one_thread(caplog):
    # a GIL convoy: every thread beyond one makes the whole slower
    t = Tuner(size=4, cores=2, adaptive=True)
    assert t.gate_for_pass() is not None
    with caplog.at_level(logging.DEBUG, logger="asyncfeed"):
        seen = _drive(t, lambda n: 30_000 / n ** 0.5, lambda n: 0.9, 60, [0.0])
    assert seen[-1] == 1 and t.limit == 1
    assert t.moves[0][:2] == (4, 1)
    assert "decode threads 4 -> 1" in caplog.text
    assert "adaptive" in t.describe() and "1 of 4" in t.describe()


def test_busy_threads_that_scale_are_left_alone():
    # GIL-free decode keeping both cores busy, one thread per core: nothing to gain
    t = Tuner(size=2, cores=2, adaptive=True)
    t.gate_for_pass()
    seen = _drive(t, lambda n: 500 * min(n, 2), lambda n: min(n, 2) * 0.97, 60, [0.0])
    assert set(seen) == {2} and t.moves == []


def test_spare_threads_that_add_nothing_go_and_probes_back_off():
    # GIL-free decode keeping both cores busy at the default (cores + 2): the spare
    # threads add no rate, so the limit settles on the cores; probes back up to
    # them fail and come ever later
    t = Tuner(size=4, cores=2, adaptive=True)
    t.gate_for_pass()
    seen = _drive(t, lambda n: 500 * min(n, 2), lambda n: min(n, 2) * 0.97, 300, [0.0])
    assert t.moves[0][:2] == (4, 2)
    assert seen[-1] == 2
    ups = [m for m in t.moves if m[1] > m[0]]
    assert 2 <= len(ups) <= 10  # backoff 2, 4, ... 64 decision rounds
    assert sum(1 for n in seen[20:] if n != 2) <= 25


def test_spare_threads_that_cover_stalls_stay():
    # every core busy, and the spare threads add rate (they read while others
    # stall): the probe down to the cores is undone and the spare threads stay
    t = Tuner(size=4, cores=2, adaptive=True)
    t.gate_for_pass()
    seen = _drive(t, lambda n: 400 + 100 * n, lambda n: min(n, 2) * 0.97, 300, [0.0])
    assert t.moves[0][:2] == (4, 2) and t.moves[1][:2] == (2, 4)
    assert seen[-1] == 4
    assert sum(1 for n in seen if n != 4) <= 25
    downs = [m for m in t.moves if m[1] < m[0]]
    assert 2 <= len(downs) <= 8, t.moves  # ever rarer: 2, 4, ... 64 rounds apart


def test_waiting_threads_that_scale_come_back_and_probes_back_off():
    # threads wait on I/O (few cores busy) yet each one adds rate: a probe down
    # fails, is undone, and the next probes come ever later (no oscillation)
    t = Tuner(size=8, cores=2, adaptive=True)
    t.gate_for_pass()
    seen = _drive(t, lambda n: 200.0 * n, lambda n: 0.05 * n, 300, [0.0])
    assert seen[-1] == 8
    assert sum(1 for n in seen if n != 8) <= 20  # windows spent probing, of 300
    downs = [i for i, (a, b, _) in enumerate(t.moves) if b < a]
    assert 2 <= len(downs) <= 10  # backoff 2, 4, ... 64 windows: ~9 in 300


def test_pinned_threads_never_move():
    t = Tuner(size=4, cores=2, adaptive=False)
    assert t.gate_for_pass() is None
    _drive(t, lambda n: 30_000 / n, lambda n: 0.5, 40, [0.0])
    assert t.limit == 4 and t.moves == [] and t.describe() == "threads: 4 (pinned)"
    assert t.row_cost_s is not None  # still measured, for sizing tasks


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
    assert FlatWriter.for_layout(Layout.infer({"a": np.zeros(2)})) is None  # not flat


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


def test_limit_moved_mid_pass_keeps_batches_identical():
    ds = TinyNumpy(600)
    loader_kw = dict(batch_size=8, shuffle=True)
    want = list(torch.utils.data.DataLoader(ds, generator=torch.Generator().manual_seed(3),
                                            **loader_kw))
    with AsyncLoader(ds, generator=torch.Generator().manual_seed(3), **loader_kw) as al:
        it = iter(al)
        got = []
        for k, batch in enumerate(it):
            got.append(batch)
            if k % 5 == 0:  # move the limit by hand while batches are in flight
                tuner = al._tuner
                with tuner._lock:
                    tuner._set(1 + (k // 5) % tuner.size, "test", 0.0)
        assert "adaptive" in al.stats().execution
    from support.oracle import assert_same_batches
    assert_same_batches(got, want)


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_shapes_that_vary_mid_pass_are_collated_like_dataloader(threads):
    assert_parity(Varying(80), batch_size=16, num_threads=threads)


def test_break_with_parked_threads_leaves_no_thread():
    ds = TinyNumpy(2000)
    al = AsyncLoader(ds, batch_size=4, prefetch=8)
    al._tuner.limit = 1  # three of the four decode threads wait at the gate
    it = iter(al)
    next(it)
    next(it)
    al.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("asyncfeed-")]
    assert not left, left


def test_stats_say_which_execution_ran():
    with AsyncLoader(TupleFixed(40), batch_size=8, num_threads=2) as al:
        list(al)
        assert al.stats().execution == "threads: 2 (pinned)"
