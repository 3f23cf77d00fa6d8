"""How map-style rows reach the batch buffers.

* ``FlatWriter.write_rows`` writes a whole task's rows column by column (small rows
  copied holding the GIL, big ones in bulk with one ``torch.stack``): the bytes
  must be the ones ``Layout.write_row`` writes, row by row.
* Batches loaded by several tasks are written by the thread that finishes them
  (``samples.write_deferred``): batches still match DataLoader's bit for bit,
  whatever the rows (read-only, strided, tensors, shapes that change mid-pass).
* The decode pool passes the pass's gate before taking a task (``TaskPool.admit``).

Nothing here measures speed (that is ``asyncfeed bench``'s job).
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from asyncfeed._engine import rowwrite, samples
from asyncfeed._engine.tasksize import Gate
from asyncfeed._memory.layout import Layout, _Leaf
from asyncfeed._engine.rowwrite import BULK_ROW_BYTES, FlatWriter, StackWays
from asyncfeed._engine.taskpool import TaskPool
from support.buffers import assert_same_buffers, zeroed_pair
from support.oracle import assert_parity

BIG = (3, 128, 128)  # 48 KiB of uint8: at least BULK_ROW_BYTES a row
assert np.prod(BIG) >= BULK_ROW_BYTES


def _rng_img(i: int, shape=BIG) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8)


def _read_only(i: int) -> np.ndarray:
    return np.frombuffer(_rng_img(i).tobytes(), np.uint8).reshape(BIG)


# samples of row i, each kind a flat layout FlatWriter takes (or declines: complex)
KINDS = {
    "small-ndarray-int": lambda i: (_rng_img(i, (3, 8, 8)), i),
    # small rows go in with one bytes.join, unless a row is not C-contiguous
    "small-strided": lambda i: (_rng_img(i, (8, 8, 3)).transpose(2, 0, 1), i),
    "small-tensor-f16": lambda i: (torch.full((3, 5), i / 3, dtype=torch.float16), i),
    "big-ndarray-float": lambda i: (_rng_img(i), i / 7),
    "big-read-only": lambda i: (_read_only(i), i),
    "big-strided": lambda i: (_rng_img(i, BIG[1:] + BIG[:1]).transpose(2, 0, 1), i),
    "big-tensor-bool": lambda i: (torch.from_numpy(_rng_img(i)), i % 2 == 0),
    "complex-tensor": lambda i: (torch.full((4,), complex(i, -i), dtype=torch.complex64), i),
    "strings": lambda i: [np.full((2, 2), i, np.int16), f"s{i}", bytes([i])],
    "single-array": lambda i: _rng_img(i, (5,)).astype(np.float32),
    "zero-d": lambda i: (np.array(i * 1.5), np.array(i, np.int32)),
}


# dict samples of row i: flat dicts FlatWriter takes as well
DICT_KINDS = {
    "dict-small": lambda i: {"image": _rng_img(i, (3, 8, 8)), "label": i, "name": f"s{i}"},
    "dict-big-tensor": lambda i: {"x": torch.from_numpy(_rng_img(i)), "y": i / 3},
}
ALL_KINDS = {**KINDS, **DICT_KINDS}


@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_write_rows_writes_the_bytes_write_row_writes(kind, bulk):
    make = ALL_KINDS[kind]
    samples = [make(i) for i in range(6)]
    layout = Layout.infer(samples[0])
    w = FlatWriter.for_layout(layout)
    assert w is not None
    a, b = zeroed_pair(layout, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.from_numpy on a read-only array warns
        # rows 1..5 in one run (row 0 left as zeros in both)
        assert w.write_rows(a, layout.numpy_views(a), 1, 6, samples, bulk=bulk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference warns on read-only arrays
        for row in range(1, 6):
            layout.write_row(b, row, samples[row], layout.numpy_views(b))
    assert_same_buffers(a, b)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("n", [6, 4])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_assemble_builds_what_the_collate_walk_builds(kind, n, own):
    """The shortcut for flat tuples and single leaves against default_collate's walk."""
    samples = [KINDS[kind](i) for i in range(6)]
    layout = Layout.infer(samples[0])
    bufs = layout.allocate(6)
    views = layout.numpy_views(bufs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.from_numpy on a read-only array warns
        for row, sample in enumerate(samples):
            layout.write_row(bufs, row, sample, views)
    got = layout.assemble(bufs, n, own=own)
    walk = Layout(layout.skeleton, layout.specs)
    walk._flat_tuple = False                      # what every other skeleton goes through
    leaf = walk.skeleton
    if type(leaf) is _Leaf:
        walk.skeleton = [leaf]                    # (a single leaf, walked inside a list)
        want = walk.assemble(bufs, n)[0]
    else:
        want = walk.assemble(bufs, n)
    assert type(got) is type(want)
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got],
                    want if isinstance(want, (list, tuple)) else [want], strict=True):
        assert type(g) is type(w)
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and torch.equal(g, w)
        else:
            assert g == w
    # a batch's own buffers of exactly n rows go out as they are, others as slices
    tensors = [b for b in bufs if isinstance(b, torch.Tensor)]
    out = [x for x in (got if isinstance(got, (list, tuple)) else [got])
           if isinstance(x, torch.Tensor)]
    assert out and all(any(o is t for t in tensors) is (own and n == 6) for o in out)


def test_write_rows_declines_a_run_it_cannot_write_as_one():
    samples = [(_rng_img(i, (3, 4)), i) for i in range(4)]
    layout = Layout.infer(samples[0])
    w = FlatWriter.for_layout(layout)
    bufs = layout.allocate(4)
    views = layout.numpy_views(bufs)
    for bad in [(_rng_img(9, (3, 5)), 1),            # another shape
                (_rng_img(9, (3, 4)).astype(np.int8), 1),   # another dtype
                (_rng_img(9, (3, 4)), 1.0),           # another scalar type
                [_rng_img(9, (3, 4)), 1],             # another container
                (_rng_img(9, (3, 4)), 1, 2),          # a longer tuple
                (_rng_img(9, (3, 4)),)]:              # a shorter one
        for bulk in (False, True):
            assert not w.write_rows(bufs, views, 0, 4, samples[:3] + [bad], bulk=bulk)


class _Marked(torch.Tensor):
    """A tensor subclass a user might return (stacks of it are of it)."""


def _kept(writer: FlatWriter, copy: bool) -> FlatWriter:
    """``writer`` with every tensor leaf's way fixed (copy, or check: ``StackWays``)."""
    for ways in writer.ways:
        ways.kept = copy
    return writer


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "check"])
@pytest.mark.parametrize("shape", [(3, 4), (3, 16, 24)], ids=["small-rows", "large-rows"])
def test_write_rows_declines_a_run_of_tensors_it_cannot_stack_as_the_layout_says(shape, copy):
    """A column of tensors goes in with one ``torch.stack``, which would promote or
    cast a row of another dtype and refuse one of another shape, or one that needs
    grad: each such run is declined whole (and nothing declined is left half
    checked: the good run after it writes the bytes ``write_row`` writes).  Either
    way of reading the rows' dtypes (stacked, then copied; or checked, then
    stacked into the buffers)."""
    def good(i):
        return (torch.full(shape, i, dtype=torch.int16), torch.tensor(i))
    samples = [good(i) for i in range(4)]
    layout = Layout.infer(samples[0])
    w = _kept(FlatWriter.for_layout(layout), copy)
    bufs = layout.allocate(4)
    views = layout.numpy_views(bufs)
    wider = shape[:-1] + (shape[-1] + 1,)
    for bad in [(torch.zeros(wider, dtype=torch.int16), torch.tensor(1)),  # another shape
                (torch.zeros(shape, dtype=torch.int32), torch.tensor(1)),  # another dtype
                (torch.zeros(shape, dtype=torch.int16), torch.tensor(1.0)),
                (torch.zeros(shape[::-1], dtype=torch.int16), torch.tensor(1))]:
        for at in (0, 3):  # the first row (checked here) or a later one
            run = samples[:at] + [bad] + samples[at + 1:]
            for bulk in (False, True):
                assert not w.write_rows(bufs, views, 0, 4, run, bulk=bulk)
    # a row of a tensor subclass: default_collate's stack would be of that subclass
    for at in (0, 3):
        run = samples[:at] + [(good(1)[0].as_subclass(_Marked), torch.tensor(1))] \
            + samples[at + 1:]
        assert not w.write_rows(bufs, views, 0, 4, run, bulk=True)
    floats = [(torch.full((2,), float(i), requires_grad=i == 2), i) for i in range(4)]
    flayout = Layout.infer(floats[0])
    fbufs = flayout.allocate(4)
    fw = _kept(FlatWriter.for_layout(flayout), copy)
    assert not fw.write_rows(fbufs, flayout.numpy_views(fbufs), 0, 4, floats, bulk=True)
    a, b = zeroed_pair(layout, 4)
    assert w.write_rows(a, layout.numpy_views(a), 0, 4, samples, bulk=True)
    for row in range(4):
        layout.write_row(b, row, samples[row], layout.numpy_views(b))
    assert_same_buffers(a, b)


def test_a_run_stacked_then_copied_is_written_as_default_collate_stacks_it():
    """The copy way, a row of a narrower dtype among tensors of the layout's:
    ``torch.stack`` promotes it to the layout's dtype, as ``default_collate`` does,
    so the run is written in bulk (not declined to be collated row by row), its
    bytes what ``default_collate`` returns; a run whose stack comes out in another
    dtype than the layout's is declined with nothing written."""
    samples = [(torch.full((3, 4), 10 * i, dtype=torch.int32), i) for i in range(4)]
    samples[2] = (torch.full((3, 4), 20, dtype=torch.int16), 2)
    layout = Layout.infer(samples[0])
    w = _kept(FlatWriter.for_layout(layout), True)
    bufs = layout.allocate(4)
    assert w.write_rows(bufs, layout.numpy_views(bufs), 0, 4, samples, bulk=True)
    got, want = layout.assemble(bufs, 4), default_collate(samples)
    assert got[0].dtype == want[0].dtype == torch.int32 and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    wider = samples[:3] + [(torch.full((3, 4), 30, dtype=torch.int64), 3)]
    a, b = zeroed_pair(layout, 4)
    assert not w.write_rows(a, layout.numpy_views(a), 0, 4, wider, bulk=True)
    assert_same_buffers(a, b)  # nothing written


def _replay(check: list[float], copy: list[float], rows: int = 100) -> StackWays:
    """``StackWays`` fed the runs ``check`` and ``copy`` (seconds a row, each way's
    cold run first) in the order it asks for them, until it keeps a way."""
    ways, c, k = StackWays(), iter(check), iter(copy)
    while ways.kept is None:
        way = ways.next()
        ways.record(way, (next(k) if way else next(c)) * rows, rows)
    return ways


def test_the_ways_alternate_and_each_ones_cold_run_is_left_out():
    """Check first, then copy, alternating; each way's first run is not a reading,
    and the way is kept once each has two readings (the fewest with a spread)."""
    order, seen = StackWays(), []
    while order.kept is None:
        seen.append(order.next())
        order.record(seen[-1], 1e-6 * (len(seen) if seen[-1] else 50 + len(seen)), 10)
    assert seen == [False, True] * 3
    assert len(order.check) == len(order.copy) == 2
    # the cold runs (51 us and 2 us for 10 rows) are not among the readings
    assert order.check == pytest.approx([5.3e-6, 5.5e-6])
    assert order.copy == pytest.approx([0.4e-6, 0.6e-6])
    assert order.kept is True
    order.record(False, 1e-9, 1)   # later readings change nothing
    assert order.kept is True and order.next() is True and len(order.check) == 2


def test_a_leaf_keeps_the_way_that_leads_by_more_than_its_runs_spread():
    """Replayed readings: the cheaper median is kept where it leads by more than
    the spread between like runs."""
    # small rows: a dtype read a row costs more than their copy
    assert _replay([900e-9, 60e-9, 58e-9], [900e-9, 30e-9, 31e-9]).kept is True
    # large rows: the copy costs more
    assert _replay([900e-9, 60e-9, 61e-9], [900e-9, 200e-9, 190e-9]).kept is False
    # a cold run that reads cheapest does not decide: it is left out
    assert _replay([1e-9, 60e-9, 61e-9], [900e-9, 50e-9, 52e-9]).kept is True
    # the same lead with runs 2% apart decides in the first round
    ways = _replay([900e-9, 65e-9, 66e-9], [900e-9, 58e-9, 59e-9])
    assert ways.kept is True and len(ways.copy) == 2


def test_a_tie_is_measured_again_in_longer_rounds_before_the_check_way_stays():
    """Where neither way leads by the spread, the runs go on: each way's runs
    double (2, 4, 8: ``PolicyConfig.like_windows`` and ``max_rounds``) and are
    judged again on all of them; a lead that shows once the first touches are
    past decides; a tie to the last round keeps the check way."""
    # the copy way's first runs still pay for the allocator's first touches: they
    # read dearer than the check way's, then cheaper by 15%, as a small-row leaf
    # traced on the loader's first runs reads
    check = [1100e-9] + [450e-9, 470e-9, 455e-9, 460e-9, 452e-9, 458e-9, 461e-9, 449e-9]
    copy = [900e-9] + [640e-9, 420e-9, 390e-9, 392e-9, 388e-9, 395e-9, 391e-9, 389e-9]
    ways = _replay(check, copy)
    assert ways.kept is True and len(ways.check) == len(ways.copy) == 4
    # copy reads 10% cheaper, but like runs read 40% apart in every round: a tie
    check = [900e-9] + [50e-9, 80e-9] * 4
    copy = [900e-9] + [48e-9, 69e-9] * 4
    ways = _replay(check, copy)
    assert ways.kept is False and len(ways.check) == len(ways.copy) == 8
    # a clear lead of the check way ends the first round
    ways = _replay([900e-9, 60e-9, 61e-9], [900e-9, 90e-9, 91e-9])
    assert ways.kept is False and len(ways.copy) == 2


def test_a_leaf_reads_its_runs_in_the_threads_cpu_time(monkeypatch):
    """A run is timed with ``time.thread_time``: a thread that waits (for the GIL,
    for a core) has its run read what its work cost, not the wait."""
    samples = [(torch.full((3, 4), i, dtype=torch.int16),) for i in range(4)]
    layout = Layout.infer(samples[0])
    w = FlatWriter.for_layout(layout)
    clock = iter([0.0, 1.0, 1.0, 1.5, 1.5, 3.5, 3.5, 4.0, 4.0, 6.0, 6.0, 6.5])
    monkeypatch.setattr(rowwrite, "thread_time", lambda: next(clock))
    for _ in range(6):
        bufs = layout.allocate(4)
        assert w.write_rows(bufs, layout.numpy_views(bufs), 0, 4, samples, bulk=True)
    assert w.ways[0].check == [0.5, 0.5] and w.ways[0].copy == [0.125, 0.125]
    assert w.ways[0].kept is True


def test_a_writer_measures_its_tensor_leaves_on_its_runs():
    """Every bulk run of a tensor leaf is timed until the leaf's way is kept; a
    writer's leaves are measured apart, and the bytes are ``write_row``'s whatever
    the way."""
    samples = [(torch.full((3, 4), i, dtype=torch.int16), torch.tensor(i)) for i in range(4)]
    layout = Layout.infer(samples[0])
    w = FlatWriter.for_layout(layout)
    for _ in range(2 * (1 + 8)):  # each way's cold run, and at most three rounds' runs
        a, b = zeroed_pair(layout, 4)
        assert w.write_rows(a, layout.numpy_views(a), 0, 4, samples, bulk=True)
        for row in range(4):
            layout.write_row(b, row, samples[row], layout.numpy_views(b))
        assert_same_buffers(a, b)
    assert all(len(x.check) == len(x.copy) in (2, 4, 8) for x in w.ways)
    assert all(x.kept is not None for x in w.ways)


def test_a_dict_writer_declines_other_keys_and_containers():
    samples = [{"image": _rng_img(i, (3, 4)), "label": i} for i in range(4)]
    layout = Layout.infer(samples[0])
    w = FlatWriter.for_layout(layout)
    assert w is not None
    bufs = layout.allocate(4)
    views = layout.numpy_views(bufs)
    for bad in [{"image": _rng_img(9, (3, 4)), "other": 1},          # another key
                {"image": _rng_img(9, (3, 4)), "label": 1, "x": 2},  # one more key
                (_rng_img(9, (3, 4)), 1)]:                            # not a dict
        for bulk in (False, True):
            assert not w.write_rows(bufs, views, 0, 4, samples[:3] + [bad], bulk=bulk)
        assert not w.write(bufs, views, 0, bad)
    assert w.write_rows(bufs, views, 0, 4, samples)
    a, b = zeroed_pair(layout, 4)
    assert w.write(a, layout.numpy_views(a), 2, samples[2])
    layout.write_row(b, 2, samples[2], layout.numpy_views(b))
    assert_same_buffers(a, b)


class BigRows:
    """Rows of ``BIG`` bytes of one kind (see KINDS) and an int label."""

    def __init__(self, kind: str, n: int = 40) -> None:
        self.make, self.n = KINDS[kind], n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.make(i)


class BigVarying(BigRows):
    """Big rows whose shape changes from sample 16 on (at a batch of 8's start)."""

    def __getitem__(self, i: int):
        img, label = super().__getitem__(i)
        return (img if i < 16 else img[:, :64]), label


@pytest.fixture
def deferred_calls(monkeypatch):
    calls = []
    real = samples.write_deferred

    def spy(p, b):
        calls.append(b.k)
        real(p, b)
    monkeypatch.setattr(samples, "write_deferred", spy)
    return calls


@pytest.mark.parametrize("kind", ["big-ndarray-float", "big-read-only", "big-strided",
                                  "big-tensor-bool", "small-ndarray-int", "strings"])
def test_batches_written_by_the_finishing_thread_match_dataloader(kind, deferred_calls):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # three threads: every batch of 8 is split into several tasks
        assert_parity(BigRows(kind), batch_size=8, shuffle=True, num_threads=3)
    assert deferred_calls, "no batch was written by its finishing thread"


def test_shapes_that_change_in_deferred_batches_are_collated(deferred_calls):
    assert_parity(BigVarying("big-ndarray-float", 40), batch_size=8, num_threads=3)


# ---------------------------------------------------------------- the pool's gate
@pytest.mark.parametrize("late", [False, True])
def test_threads_beyond_the_gate_take_no_task(late):
    gate = Gate(1)
    if late:  # admitted while the threads wait for tasks
        pool = TaskPool(4, "asyncfeed-test-admit")
        time.sleep(0.05)
        pool.admit(gate)
    else:
        pool = TaskPool(4, "asyncfeed-test-admit", gate=gate)
    release, started = threading.Event(), threading.Event()
    running, most = [0], [0]
    lock = threading.Lock()

    def task():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        started.set()
        release.wait(10)
        with lock:
            running[0] -= 1

    try:
        for _ in range(4):
            pool.submit(task)
        assert started.wait(10)
        time.sleep(0.1)
        assert running[0] == 1
        if not late:
            assert pool._q.qsize() == 3  # the parked threads hold no task
        gate.set_limit(2)
        release.set()
    finally:
        pool.shutdown(wait=True)
    assert most[0] <= 2 and running[0] == 0


def test_a_pass_s_first_tasks_run_in_order_at_its_first_limit():
    """A pass installs its gate after the pool's threads started and lowers the limit
    before its first submit (a fresh loader's sizing tasks run alone): the tasks
    run in the order submitted, one at a time.  (Threads that waited in the queue
    took the first tasks before the gate and put them back at the end: the sizing
    rows ran out of order, one of them as a 2-row task.)"""
    pool = TaskPool(4, "asyncfeed-test-admit")
    time.sleep(0.05)  # every thread started and waiting
    gate = Gate(4)
    pool.admit(gate)
    gate.set_limit(1)
    order: list[int] = []
    running, most = [0], [0]
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def task(i: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.append(i)
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        done.release()

    try:
        for i in range(8):
            pool.submit(task, i)
        for _ in range(8):
            assert done.acquire(timeout=10)
    finally:
        pool.shutdown(wait=True)
    assert order == list(range(8)) and most[0] == 1, (order, most[0])


def test_a_pool_shut_down_before_any_task_lets_its_threads_go():
    pool = TaskPool(3, "asyncfeed-test-admit")
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool.threads)


def test_threads_keep_their_place_until_the_limit_goes_down():
    gate = Gate(3)
    pool = TaskPool(3, "asyncfeed-test-admit", gate=gate)
    running, most, names = [0], [0], set()
    lock = threading.Lock()

    def task():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            names.add(threading.current_thread().name)
        time.sleep(0.002)
        with lock:
            running[0] -= 1

    def run(n: int) -> None:
        done = threading.Semaphore(0)
        for _ in range(n):
            pool.submit(lambda: (task(), done.release()))
        for _ in range(n):
            assert done.acquire(timeout=10)

    try:
        run(30)
        assert most[0] >= 2  # three places: tasks ran side by side
        gate.set_limit(1)
        for _ in range(50):  # each holder over the limit leaves after its next task
            run(3)
            if gate._active == 1:
                break
        assert gate._active == 1
        most[0] = 0
        names.clear()
        run(30)
        assert most[0] == 1 and len(names) == 1  # one place: one thread, task after task
        assert gate._active == 1
    finally:
        pool.shutdown(wait=True)


def test_shutdown_opens_the_gate_threads_wait_at():
    pool = TaskPool(3, "asyncfeed-test-admit")
    pool.admit(Gate(0))  # nobody may take a task
    ran = []
    pool.submit(ran.append, 1)
    pool.shutdown(wait=True, cancel_futures=True)
    assert not [t for t in pool.threads if t.is_alive()]
    assert ran == []
