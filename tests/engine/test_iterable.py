"""IterableDataset passes: the split protocol (``iter_raw`` + ``decode``), errors, ranks.

A dataset with ``iter_raw()`` and ``decode(raw)`` is pulled raw under the
iterator's lock and decoded in the decode threads.  Whatever the threads do, the
batches must be those of ``DataLoader(num_workers=0)`` over the same dataset (whose
``__iter__`` is ``map(decode, iter_raw())``), and the plain path (``__iter__`` only)
must give the same batches and the same skips.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from asyncfeed import AsyncLoader, SampleError
from asyncfeed._engine.handoff import PassConfig
from asyncfeed._engine.iterable import MAX_CONSECUTIVE_ERRORS, IterablePipeline, split_decode
from asyncfeed._engine.runtime import Runtime
from support.datasets import drain
from support.datasets import chunks
from support.oracle import assert_same, assert_same_batches

pytestmark = pytest.mark.timeout(60)


class SplitStream(IterableDataset):
    """Items 0..n-1.  Pulling an item in ``bad_pull`` raises (the stream goes on);
    decoding one in ``bad_decode`` raises.  Records how the loader used it."""

    def __init__(self, n: int, bad_pull=(), bad_decode=(), decode_sleep: float = 0.0,
                 jitter: bool = False, split: bool = True) -> None:
        self.n, self.bad_pull, self.bad_decode = n, set(bad_pull), set(bad_decode)
        self.decode_sleep, self.jitter = decode_sleep, jitter
        if not split:
            self.use_iter_raw = False
        self._lock = threading.Lock()
        self.iter_calls = self.iter_raw_calls = 0
        self.decode_threads: set[str] = set()
        self.decoding = self.max_decoding = 0
        self.pulling = self.max_pulling = 0
        self.pulls_during_decode = 0

    def __iter__(self):
        self.iter_calls += 1
        return map(self.decode, self.iter_raw())

    def iter_raw(self):
        self.iter_raw_calls += 1
        return _RawIter(self)

    def decode(self, raw, index=None):
        i = int.from_bytes(raw, "little")
        with self._lock:
            self.decode_threads.add(threading.current_thread().name)
            self.decoding += 1
            self.max_decoding = max(self.max_decoding, self.decoding)
        try:
            if self.decode_sleep or self.jitter:
                time.sleep(self.decode_sleep + (random.random() * 0.003 if self.jitter else 0))
            if i in self.bad_decode:
                raise ValueError(f"item {i} does not decode")
            return torch.tensor([i, -i], dtype=torch.int32), i
        finally:
            with self._lock:
                self.decoding -= 1


class _RawIter:
    def __init__(self, ds: SplitStream) -> None:
        self.ds, self.i = ds, 0

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        ds = self.ds
        with ds._lock:
            ds.pulling += 1
            ds.max_pulling = max(ds.max_pulling, ds.pulling)
            ds.pulls_during_decode += ds.decoding > 0
        try:
            time.sleep(0.0005)  # two pulls at once would overlap here
            i = self.i
            if i >= ds.n:
                raise StopIteration
            self.i += 1
            if i in ds.bad_pull:
                raise OSError(f"item {i} cannot be read")
            return i.to_bytes(4, "little")
        finally:
            with ds._lock:
                ds.pulling -= 1




def ids_of(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def run(ds, **kw):
    """(batches or errors, skipped (index, batch) pairs) of one AsyncLoader pass."""
    with AsyncLoader(ds, **kw) as al:
        got = drain(iter(al))
        skipped = [(s.index, s.batch) for s in al.stats().skipped]
        assert al.stats().path == "iterable"
    return got, skipped


def assert_same_outcome(got: list, want: list) -> None:
    """Batches equal, errors at the same places naming the same samples."""
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        if isinstance(w, BaseException):
            assert isinstance(g, SampleError), repr(g)
            cause = w.__cause__ if isinstance(w, SampleError) else w
            assert type(g.__cause__) is type(cause) and str(g.__cause__) == str(cause)
        else:
            assert_same(g, w)


# ------------------------------------------------------------------- protocol
def test_split_decode_detection():
    assert split_decode(SplitStream(3)) is not None
    assert split_decode(SplitStream(3, split=False)) is None

    class OnlyIter(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    class NoDecode(OnlyIter):
        decode = None

        def iter_raw(self):
            return iter(range(3))

    assert split_decode(OnlyIter()) is None
    assert split_decode(NoDecode()) is None


def test_split_path_pulls_raw_and_decodes_in_the_pool():
    ds = SplitStream(96, decode_sleep=0.004)
    with AsyncLoader(ds, batch_size=8, num_threads=4) as al:
        got = list(al)
    assert ids_of(got) == chunks(list(range(96)), 8)
    assert ds.iter_raw_calls == 1 and ds.iter_calls == 0
    assert all(t.startswith("asyncfeed-decode") for t in ds.decode_threads)
    assert ds.max_pulling == 1                  # the iterator is never advanced twice at once
    assert ds.max_decoding >= 2                 # decoding is not serial
    assert ds.pulls_during_decode > 0           # and not under the iterator's lock


def test_plain_path_when_the_split_is_off():
    ds = SplitStream(20, split=False)
    with AsyncLoader(ds, batch_size=4, num_threads=3) as al:
        assert ids_of(list(al)) == chunks(list(range(20)), 4)
    assert ds.iter_calls == 1 and ds.iter_raw_calls == 1  # through __iter__
    assert ds.max_pulling == 1


@pytest.mark.parametrize("batch_size,drop_last", [(4, False), (4, True), (1, False),
                                                  (None, False), (23, True), (30, False),
                                                  (7, True)])
@pytest.mark.parametrize("split", [True, False])
def test_matches_dataloader(batch_size, drop_last, split):
    ds = SplitStream(23, jitter=True, split=split)
    want = list(DataLoader(ds, batch_size=batch_size, drop_last=drop_last))
    with AsyncLoader(ds, batch_size=batch_size, drop_last=drop_last, num_threads=4) as al:
        got = list(al)
    assert_same_batches(got, want)


def test_collate_fn_and_in_order_false():
    ds = SplitStream(41, jitter=True)

    def collate(batch):
        return [i for _, i in batch]

    want = list(DataLoader(ds, batch_size=5, collate_fn=collate))
    with AsyncLoader(ds, batch_size=5, collate_fn=collate, num_threads=4) as al:
        assert list(al) == want
    with AsyncLoader(ds, batch_size=5, collate_fn=collate, num_threads=4, in_order=False) as al:
        assert sorted(al) == want


def test_break_with_decodes_in_flight():
    ds = SplitStream(400, decode_sleep=0.005)
    with AsyncLoader(ds, batch_size=8, num_threads=4) as al:
        for k, b in enumerate(al):
            if k == 2:
                break
        assert ids_of([b]) == [list(range(16, 24))]
        assert ids_of(list(al)) == chunks(list(range(400)), 8)  # a fresh pass


# --------------------------------------------------------------------- errors
ERROR_CASES = [
    dict(bad_decode={5, 6, 13}),
    dict(bad_decode={0}, bad_pull={9}),
    dict(bad_decode={3, 17, 22}, bad_pull={4, 21}),
    dict(bad_decode={19, 20, 21, 22}),
    dict(bad_decode=set(range(0, 23, 2)), bad_pull=set(range(1, 23, 4))),
    dict(bad_decode=set(range(23))),
]


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_raise_mode_matches_dataloader(case, drop_last):
    ds = SplitStream(23, jitter=True, **case)
    want = drain(iter(DataLoader(ds, batch_size=4, drop_last=drop_last)))
    got, skipped = run(ds, batch_size=4, drop_last=drop_last, num_threads=4)
    assert_same_outcome(got, want)
    assert not skipped
    errors = [g for g in got if isinstance(g, SampleError)]
    assert [e.index for e in errors] == sorted(case.get("bad_decode", set())
                                               | case.get("bad_pull", set()))
    assert [e.batch for e in errors] == [k for k, w in enumerate(want)
                                         if isinstance(w, BaseException)]


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("in_order", [True, False])
def test_skip_mode_fills_batches_from_the_next_items(case, drop_last, in_order):
    ds = SplitStream(23, jitter=True, **case)
    bad = case.get("bad_decode", set()) | case.get("bad_pull", set())
    got, skipped = run(ds, batch_size=4, drop_last=drop_last, on_error="skip",
                       in_order=in_order, num_threads=4)
    want = chunks([i for i in range(23) if i not in bad], 4, drop_last)
    assert all(not isinstance(g, BaseException) for g in got), got
    assert (ids_of(got) if in_order else sorted(ids_of(got))) == want
    assert sorted(i for i, _ in skipped) == sorted(bad)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_split_and_plain_paths_agree(seed, on_error):
    """Random failures: same batches, same errors, same skips (index and batch number)."""
    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    bad_decode = {i for i in range(n) if rng.random() < 0.2}
    bad_pull = {i for i in range(n) if rng.random() < 0.1}
    bs = rng.choice([1, 3, 4, 8])
    drop_last = rng.random() < 0.5
    kw = dict(batch_size=bs, drop_last=drop_last, on_error=on_error, num_threads=3)
    split, split_skips = run(SplitStream(n, bad_pull, bad_decode, jitter=True), **kw)
    plain, plain_skips = run(SplitStream(n, bad_pull, bad_decode, split=False), **kw)
    assert_same_outcome(split, plain)
    for a, b in zip(split, plain):
        if isinstance(a, SampleError):
            assert (a.index, a.batch) == (b.index, b.batch)
    assert split_skips == plain_skips
    # the same pass twice: the same result
    again, again_skips = run(SplitStream(n, bad_pull, bad_decode, jitter=True), **kw)
    assert_same_outcome(again, split)
    assert again_skips == split_skips


def test_skip_drop_last_reports_failures_of_a_dropped_tail():
    ds = SplitStream(10, bad_decode={9})
    got, skipped = run(ds, batch_size=4, drop_last=True, on_error="skip")
    assert ids_of(got) == [[0, 1, 2, 3], [4, 5, 6, 7]]      # [8] is short: dropped
    assert skipped == [(9, 2)]


@pytest.mark.parametrize("split", [True, False])
def test_long_runs_of_failures_are_cut(split):
    """MAX_CONSECUTIVE_ERRORS failures in a row end the batch: what loaded goes out short."""
    first_bad, n_bad = 6, 2 * MAX_CONSECUTIVE_ERRORS + 10
    bad = set(range(first_bad, first_bad + n_bad))
    n = first_bad + n_bad + 7
    ds = SplitStream(n, bad_decode=bad, split=split)
    got, skipped = run(ds, batch_size=4, on_error="skip", num_threads=2)
    good_after = list(range(first_bad + n_bad, n))
    assert ids_of(got) == [[0, 1, 2, 3], [4, 5]] + chunks(good_after, 4)
    assert sorted(i for i, _ in skipped) == sorted(bad)
    # batches 1 (two samples, 100 failures) and 2 (100 failures) were cut by the guard
    assert [b for i, b in skipped].count(1) == MAX_CONSECUTIVE_ERRORS
    assert [b for i, b in skipped].count(2) == MAX_CONSECUTIVE_ERRORS


def test_collate_error_is_the_batch_error():
    ds = SplitStream(12)

    def collate(batch):
        if any(i == 5 for _, i in batch):
            raise RuntimeError("no")
        return [i for _, i in batch]

    with AsyncLoader(ds, batch_size=4, collate_fn=collate) as al:
        got = drain(iter(al))
    assert got[0] == [0, 1, 2, 3] and got[2] == [8, 9, 10, 11]
    assert isinstance(got[1], Exception) and isinstance(got[1].__cause__, RuntimeError)


# ---------------------------------------------------------------------- ranks
class RankedStream(IterableDataset):
    """Every ``world_size``-th item from ``rank`` on, as told by ``set_rank``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list = []

    def set_rank(self, rank: int, world_size: int) -> None:
        self.calls.append(("set_rank", rank, world_size))
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        self.calls.append(("iter",))
        return iter(range(self.rank, self.n, self.world_size))


def test_pipeline_calls_set_rank_before_iter():
    ds = RankedStream(10)
    with Runtime(1, with_loop=False) as rt:
        IterablePipeline(PassConfig(batch_size=2, collate=list), dataset=ds, runtime=rt,
                         copy=None, ranks=(1, 3))
    assert ds.calls == [("set_rank", 1, 3), ("iter",)]
    # without ranks (or without set_rank) nothing is called
    plain = SplitStream(3)
    with Runtime(1, with_loop=False) as rt:
        IterablePipeline(PassConfig(batch_size=2, collate=list), dataset=plain, runtime=rt,
                         copy=None, ranks=(0, 2))


def test_loader_hands_its_rank_to_the_dataset():
    ds = RankedStream(10)
    with AsyncLoader(ds, batch_size=None, rank=1, world_size=3) as al:
        assert list(al) == [1, 4, 7]
    assert ds.calls[:2] == [("set_rank", 1, 3), ("iter",)]
