"""Failing samples: ``on_error="raise"`` and ``"skip"``, timeouts, collate errors.

Expected batches are computed by hand from the plan: with ``"skip"``, the good
samples in plan order, chunked by the batch size.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import simplejpeg
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

import asyncfeed
from asyncfeed import AsyncFeedError, AsyncLoader, LoaderTimeout, SampleError
from support.datasets import _drain, chunks, next_or_error
from support.executions import EXECUTIONS, OFF_THREAD, on
from support.oracle import assert_same, assert_same_batches

pytestmark = pytest.mark.timeout(60)

#: a folder read in ``__getitem__`` runs on every execution; one read on the event loop
#: (``io="async"``) runs on threads whatever ``execution`` says
FOLDER_CASES = [("thread", e) for e in EXECUTIONS] + [("async", "threads")]


# ----------------------------------------------------------- a folder of bad files
def _jpeg(seed: int, h: int = 48, w: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return simplejpeg.encode_jpeg(img, quality=85)


# file name -> what to write (None: a good JPEG; "deleted": good, removed after listing)
FOLDER_A = {
    "00.jpg": None, "01.jpg": None,
    "02_truncated.jpg": "truncated", "03.jpg": None,
    "04_empty.jpg": "empty", "05.jpg": None,
    "06_random.jpg": "random", "07.jpg": None,
    "08_text.jpg": "text", "09.jpg": None,
    "10_deleted.jpg": "deleted", "11.jpg": None,
}
BAD = {2: "02_truncated.jpg", 4: "04_empty.jpg", 6: "06_random.jpg", 8: "08_text.jpg",
       10: "10_deleted.jpg"}
N_IMAGES = len(FOLDER_A) + 3


@pytest.fixture
def bad_folder(tmp_path):
    """class ``a``: good and bad files alternating; class ``b``: 3 good files.

    Returns a function making an ImageFolder over it (the deleted file is gone
    once the first folder is listed) and the oracle to compute expected samples.
    """
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for j, (name, kind) in enumerate(FOLDER_A.items()):
        good = _jpeg(j, 40 + 3 * j, 70 - 2 * j)
        data = {None: good, "deleted": good, "truncated": good[:len(good) // 2],
                "empty": b"", "random": random.Random(j).randbytes(3000),
                "text": b"this is not a JPEG\n" * 20}[kind]
        (a / name).write_bytes(data)
    for j in range(3):
        (b / f"{j:02d}.jpg").write_bytes(_jpeg(100 + j))
    oracle = asyncfeed.ImageFolder(tmp_path, size=24)
    made = []

    def make(**kw):
        ds = asyncfeed.ImageFolder(tmp_path, size=24, **kw)
        made.append(ds)
        (a / "10_deleted.jpg").unlink(missing_ok=True)
        return ds

    return make, oracle


def _check_sample_error(e, index: int, name: str, batch: int) -> None:
    assert isinstance(e, SampleError), repr(e)
    assert e.index == index
    assert e.source is not None and e.source.endswith(name), e.source
    assert e.batch == batch
    msg = str(e)
    assert f"sample {index}" in msg and name in msg, msg
    cause = e.__cause__
    assert cause is not None and cause is not e
    assert not isinstance(cause, AsyncFeedError), repr(cause)
    assert isinstance(cause, (OSError, ValueError)), repr(cause)
    if name == "10_deleted.jpg":
        assert isinstance(cause, FileNotFoundError), repr(cause)


@pytest.mark.parametrize("io,execution", FOLDER_CASES, indirect=["execution"])
def test_raise_at_the_batch_of_each_bad_file(bad_folder, io, execution):
    make, oracle = bad_folder
    ds = make(io=io)
    assert len(ds) == N_IMAGES
    with AsyncLoader(ds, batch_size=2, num_threads=2, **on(execution)) as al:
        it = iter(al)
        for k in range(8):                      # batches [0,1] [2,3] ... [12,13] [14]
            out = next_or_error(it)
            bad = 2 * k if 2 * k in BAD else None
            if bad is not None:
                _check_sample_error(out, bad, BAD[bad], k)
            else:
                assert not isinstance(out, BaseException), repr(out)
                idx = list(range(2 * k, min(2 * k + 2, N_IMAGES)))
                assert_same(out, default_collate([oracle[i] for i in idx]), f"batch {k}")
        assert isinstance(next_or_error(it), StopIteration)


@pytest.mark.parametrize("io,execution", FOLDER_CASES, indirect=["execution"])
def test_skip_bad_files(bad_folder, io, execution):
    make, oracle = bad_folder
    ds = make(io=io)
    bs, seed = 3, 8
    order = [i for b in DataLoader(range(N_IMAGES), batch_size=bs, shuffle=True,
                                   generator=torch.Generator().manual_seed(seed))
             for i in b.tolist()]
    good = [i for i in order if i not in BAD]
    want = [default_collate([oracle[i] for i in c]) for c in chunks(good, bs)]
    with AsyncLoader(ds, batch_size=bs, shuffle=True, on_error="skip",
                     generator=torch.Generator().manual_seed(seed), **on(execution)) as al:
        got = list(al)
        skipped = al.stats().skipped
    assert_same_batches(got, want)
    assert [s.index for s in skipped] == [i for i in order if i in BAD]
    for s in skipped:
        assert s.source is not None and s.source.endswith(BAD[s.index])
        assert s.error and "Error" in s.error_type, s
        assert s.epoch == 0
    deleted = next(s for s in skipped if s.index == 10)
    assert deleted.error_type == "FileNotFoundError", deleted
    assert all("\n" not in s.error for s in skipped), "the reason is one line, as on threads"


# -------------------------------------------------- a map-style dataset of ids
class Ids:
    """Sample ``i`` is ``(tensor [i, -i], i)``; ``__getitem__`` raises for ``bad``."""

    def __init__(self, n: int, bad=(), slow: bool = False, exc=ValueError) -> None:
        self.n, self.bad, self.slow, self.exc = n, set(bad), slow, exc

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.slow:
            time.sleep(random.random() * 0.002)
        if i in self.bad:
            raise self.exc(f"bad sample {i}")
        return torch.tensor([i, -i]), i


def ids_of(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def test_getitem_error_raise_mode(execution):
    ds = Ids(20, bad={5, 6, 17})
    with AsyncLoader(ds, batch_size=4, **on(execution)) as al:
        it = iter(al)
        assert next(it)[1].tolist() == [0, 1, 2, 3]
        with pytest.raises(SampleError) as ei:
            next(it)
        e = ei.value
        assert e.index == 5 and e.source is None and e.batch == 1
        assert "sample 5" in str(e) and "bad sample 5" in str(e)
        assert type(e.__cause__) is ValueError and str(e.__cause__) == "bad sample 5"
        assert next(it)[1].tolist() == [8, 9, 10, 11]
        assert next(it)[1].tolist() == [12, 13, 14, 15]
        with pytest.raises(SampleError) as ei:
            next(it)
        assert ei.value.index == 17 and ei.value.batch == 4
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("collate_fn", [None, default_collate, lambda b: [s[1] for s in b]])
@pytest.mark.parametrize("num_threads,execution",
                         [(1, "threads"), (2, "threads"), (4, "threads")]
                         + [(2, e) for e in EXECUTIONS if e != "threads"], indirect=["execution"])
def test_skip_fills_batches_from_the_next_samples(num_threads, collate_fn, execution):
    n, bs, bad = 41, 4, {0, 5, 6, 7, 13, 22, 23, 24, 25, 26, 40}
    ds = Ids(n, bad=bad, slow=True)
    want = chunks([i for i in range(n) if i not in bad], bs)
    runs = []
    for _ in range(2):
        with AsyncLoader(ds, batch_size=bs, on_error="skip", num_threads=num_threads,
                         prefetch=3, collate_fn=collate_fn, **on(execution)) as al:
            got = list(al)
            st = al.stats()
        runs.append(got)
        ids = got if collate_fn is not None and collate_fn is not default_collate \
            else ids_of(got)
        assert ids == want
        assert [s.index for s in st.skipped] == sorted(bad)
        for s in st.skipped:
            assert s.source is None
            assert s.error == f"ValueError: bad sample {s.index}"
        assert st.batches == len(want)
        if collate_fn is None:
            assert st.samples == n - len(bad)
    if collate_fn is not None and collate_fn is not default_collate:
        assert runs[0] == runs[1]
    else:
        assert_same_batches(runs[0], runs[1])
        for b in runs[0]:   # the refilled batches are built like any other
            assert b[0].dtype == torch.int64 and b[0].shape == (len(b[1]), 2)
            assert torch.equal(b[0][:, 0], b[1]) and torch.equal(b[0][:, 1], -b[1])


class CountedIds(Ids):
    """:class:`Ids` (tiny rows) that counts its calls per index (rows run in this
    process; a worker process counts its own)."""

    def __init__(self, n: int, bad=()) -> None:
        super().__init__(n, bad)
        self.calls: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getitem__(self, i):
        with self._lock:
            self.calls[i] = self.calls.get(i, 0) + 1
        return super().__getitem__(i)


def test_tiny_rows_failing_mid_run_are_each_called_once(execution):
    """Tiny rows load many to a task; rows that fail in the middle of a task's run,
    side by side and at a batch's ends, are each called once and skipped, and
    every other row is delivered once, in every epoch (the later ones with the
    tasks sized by the measured row cost)."""
    n, bs = 600, 64
    bad = {0, 10, 11, 12, 63, 64, 200, 201, 599}
    ds = CountedIds(n, bad=bad)
    want = chunks([i for i in range(n) if i not in bad], bs)
    with AsyncLoader(ds, batch_size=bs, on_error="skip", **on(execution)) as al:
        for epoch in range(3):
            ds.calls.clear()
            assert ids_of(al) == want
            # the loader's skipped samples, every epoch's
            assert [s.index for s in al.stats().skipped] == sorted(bad) * (epoch + 1)
            if execution != "processes":
                assert ds.calls == {i: 1 for i in range(n)}, epoch


def test_skip_with_shuffle_follows_the_plan_order(execution):
    n, bs, bad = 30, 4, {2, 3, 11, 19, 29}
    order = [i for b in DataLoader(range(n), batch_size=bs, shuffle=True,
                                   generator=torch.Generator().manual_seed(4))
             for i in b.tolist()]
    with AsyncLoader(Ids(n, bad=bad), batch_size=bs, shuffle=True, on_error="skip",
                     generator=torch.Generator().manual_seed(4), **on(execution)) as al:
        assert ids_of(al) == chunks([i for i in order if i not in bad], bs)
        assert [s.index for s in al.stats().skipped] == [i for i in order if i in bad]


def test_skip_with_drop_last(execution):
    n, bs, bad = 23, 4, {1, 6, 7}
    planned = list(range(n // bs * bs))           # DataLoader's plan drops 20, 21, 22
    want = chunks([i for i in planned if i not in bad], bs, drop_last=True)
    with AsyncLoader(Ids(n, bad=bad), batch_size=bs, drop_last=True, on_error="skip",
                     **on(execution)) as al:
        got = ids_of(al)
        assert [s.index for s in al.stats().skipped] == sorted(bad)
    assert got == want
    assert all(len(b) == bs for b in got)


def test_skip_everything_yields_nothing(execution):
    with AsyncLoader(Ids(9, bad=range(9)), batch_size=2, on_error="skip", **on(execution)) as al:
        assert list(al) == []
        assert len(al.stats().skipped) == 9


def test_skip_without_batching(execution):
    with AsyncLoader(Ids(7, bad={0, 3}), batch_size=None, on_error="skip",
                     **on(execution)) as al:
        got = [s[1] for s in al]
    assert got == [1, 2, 4, 5, 6]


def test_skip_out_of_order_keeps_every_good_sample_once(execution):
    n, bs, bad = 40, 4, {3, 9, 10, 30}
    ds = Ids(n, bad=bad, slow=True)
    with AsyncLoader(ds, batch_size=bs, on_error="skip", in_order=False, num_threads=3,
                     prefetch=6, **on(execution)) as al:
        got = ids_of(al)
        skipped = sorted(s.index for s in al.stats().skipped)
    assert sorted(sum(got, [])) == [i for i in range(n) if i not in bad]
    assert all(0 < len(b) <= bs for b in got)
    assert skipped == sorted(bad)


def test_skip_async_fetch_errors():
    class Remote:
        def __len__(self):
            return 20

        async def fetch(self, i):
            if i in (4, 11):
                raise ConnectionError(f"fetch {i} failed")
            return i

        def decode(self, raw, i):
            if i == 15:
                raise ValueError("cannot decode 15")
            return torch.tensor([raw]), raw

        def __getitem__(self, i):
            raise AssertionError("the loader should use fetch and decode")

        def sample_source(self, i):
            return f"http://example.invalid/{i}"

    with AsyncLoader(Remote(), batch_size=3, on_error="skip") as al:
        got = ids_of(al)
        skipped = al.stats().skipped
    assert got == chunks([i for i in range(20) if i not in (4, 11, 15)], 3)
    assert [(s.index, s.source, s.error_type) for s in skipped] == [
        (4, "http://example.invalid/4", "ConnectionError"),
        (11, "http://example.invalid/11", "ConnectionError"),
        (15, "http://example.invalid/15", "ValueError")]
    with AsyncLoader(Remote(), batch_size=3) as al:
        it = iter(al)
        next(it)
        with pytest.raises(SampleError) as ei:
            next(it)
        assert ei.value.index == 4 and ei.value.source == "http://example.invalid/4"
        assert isinstance(ei.value.__cause__, ConnectionError)


# -------------------------------------- an error reads the same on every execution
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")


class WithFields(Exception):
    """A user's exception with attributes of its own."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def _raise_for(i: int) -> None:
    if i == 1:
        raise KeyError(f"no label for {i}")
    if i == 5:
        raise FileNotFoundError(2, "No such file or directory", f"/data/{i}.jpg")
    if i == 9:
        raise WithFields(f"record {i} is corrupt", code=42)
    if i == 13:
        raise Unprintable("x")
    if i == 17:
        raise MemoryError(f"cannot allocate sample {i}")


class Named:
    """Samples that fail in several ways, each named by a path."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        _raise_for(i)
        return torch.tensor([i, -i]), i

    def sample_source(self, i):
        return f"/data/{i}.jpg"


def _what_is_raised(execution: str) -> list[tuple]:
    out = []
    with AsyncLoader(Named(), batch_size=4, **on(execution)) as al:
        for e in _drain(iter(al)):
            if not isinstance(e, BaseException):
                continue
            cause = e.__cause__
            tb = str(e).split("Original Traceback (most recent call last):\n", 1)[1]
            frames = [line.strip() for line in tb.splitlines() if line.startswith("    ")]
            out.append((type(e).__name__, [c.__name__ for c in type(e).__mro__[1:]],
                        e.index, e.source, e.batch, str(e).split("\n")[0],
                        type(cause), cause.args, getattr(cause, "code", None),
                        getattr(cause, "filename", None), frames[-2:], tb.splitlines()[-1]))
    return out


@pytest.mark.parametrize("execution", [e for e in EXECUTIONS if e != "threads"],
                         indirect=True)
def test_a_samples_error_reads_as_on_threads(execution):
    """Type (also a SampleError), index, path, batch, message, cause (its type, args
    and attributes) and the traceback's last frames (the dataset's own lines) are
    what the thread execution raises."""
    want = _what_is_raised("threads")
    assert [w[2] for w in want] == [1, 5, 9, 13, 17]
    assert want[0][0] == "KeyError" and want[1][0] == "FileNotFoundError"
    assert want[2][8] == 42 and want[1][9] == "/data/5.jpg"
    assert "raise KeyError" in want[0][10][-1], want[0]
    assert want[3][5].endswith("Unprintable: <str() of the exception raised RuntimeError>")
    got = _what_is_raised(execution)
    for g, w in zip(got, want):
        assert g == w
    assert len(got) == len(want)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_keyboard_interrupt_and_system_exit_in_getitem_are_never_wrapped(exc, on_error,
                                                                         execution):
    with AsyncLoader(Ids(12, bad={6}, exc=exc), batch_size=4, on_error=on_error,
                     **on(execution)) as al:
        it = iter(al)
        assert next(it)[1].tolist() == [0, 1, 2, 3]
        with pytest.raises(exc) as ei:
            next(it)
        assert type(ei.value) is exc, repr(ei.value)
        assert ei.value.args == ("bad sample 6",)
        assert al.stats().skipped == []


# --------------------------------------------------------------- hangs, timeout
class Hangs:
    def __init__(self, hang_at: int) -> None:
        self.hang_at = hang_at
        self.release = threading.Event()

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.hang_at:
            self.release.wait(30)
        return torch.tensor([i]), i


@pytest.mark.parametrize("execution", OFF_THREAD, indirect=True)
def test_timeout_raises_loader_timeout(execution):
    """(In a worker process the sample stays stuck: closing the loader kills it.)"""
    ds = Hangs(hang_at=3)
    al = AsyncLoader(ds, batch_size=2, timeout=1, num_threads=2, **on(execution))
    try:
        it = iter(al)
        assert next(it)[1].tolist() == [0, 1]
        t0 = time.monotonic()
        with pytest.raises(LoaderTimeout) as ei:
            next(it)
        elapsed = time.monotonic() - t0
        assert 0.9 <= elapsed < 4, elapsed
        assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, AsyncFeedError)
        msg = str(ei.value)
        assert "batch 1" in msg and "3" in msg and "timeout" in msg, msg
    finally:
        ds.release.set()
        al.close()


def test_timeout_zero_waits_as_long_as_needed():
    ds = Hangs(hang_at=1)
    timer = threading.Timer(0.5, ds.release.set)
    timer.start()
    try:
        with AsyncLoader(ds, batch_size=2, timeout=0) as al:
            assert ids_of(al) == chunks(list(range(12)), 2)
    finally:
        ds.release.set()
        timer.join()


# --------------------------------------------------------- shapes and collate
class OddShape:
    def __init__(self, odd: int, n: int = 16) -> None:
        self.odd, self.n = odd, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 5 if i == self.odd else 4), float(i)), i


@pytest.mark.parametrize("prefetch", [1, 8])
def test_sample_with_a_different_shape(prefetch, execution):
    with AsyncLoader(OddShape(odd=9), batch_size=4, prefetch=prefetch, **on(execution)) as al:
        it = iter(al)
        got = [next(it), next(it)]
        with pytest.raises(AsyncFeedError) as ei:
            next(it)
        got.append(next(it))
        with pytest.raises(StopIteration):
            next(it)
    # As in DataLoader, the batch whose samples cannot be stacked fails as a whole
    # (asyncfeed falls back from in-place rows to collate and names the batch).
    e = ei.value
    msg = str(e)
    assert "batch 2" in msg and "[8, 9, 10, 11]" in msg and "stack" in msg, msg
    assert isinstance(e, RuntimeError) and type(e.__cause__) is RuntimeError, repr(e)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        torch.utils.data.default_collate([OddShape(9)[i] for i in (8, 9, 10, 11)])
    dl = list(DataLoader(OddShape(odd=-1), batch_size=4))
    assert_same_batches(got, [dl[0], dl[1], dl[3]])


def test_first_sample_with_an_odd_shape_does_not_poison_the_rest(execution):
    """Sample 0 is the odd one: only its batch fails, as in DataLoader.

    (One decode thread, so sample 0 is deterministically the first one decoded.)
    """
    want = list(DataLoader(OddShape(odd=-1), batch_size=4))
    with AsyncLoader(OddShape(odd=0), batch_size=4, prefetch=1, num_threads=1,
                     **on(execution)) as al:
        it = iter(al)
        with pytest.raises(AsyncFeedError) as ei:
            next(it)
        assert "size" in str(ei.value) or "shape" in str(ei.value), str(ei.value)
        got = list(it)
    assert_same_batches(got, want[1:])


@pytest.mark.parametrize("odd", [0, 9])
def test_an_odd_shape_fails_its_batch_even_when_skipping(odd, execution):
    """A batch that cannot be stacked is not one sample's fault: even under
    on_error="skip" it raises (naming the batch, DataLoader's RuntimeError), and the
    pass goes on.  (Sample 9 comes once the layout is known: its batch's other rows
    are in place already.)"""
    with AsyncLoader(OddShape(odd=odd), batch_size=4, prefetch=1, num_threads=1,
                     on_error="skip", **on(execution)) as al:
        it = iter(al)
        got = []
        if odd:
            got += [next(it)[1].tolist() for _ in range(odd // 4)]
        with pytest.raises(RuntimeError, match=f"batch {odd // 4}.*stack expects") as ei:
            next(it)
        assert isinstance(ei.value, AsyncFeedError)
        got += ids_of(it)
        assert al.stats().skipped == []
    planned = chunks(list(range(16)), 4)
    assert got == [b for b in planned if odd not in b]


def test_collate_fn_error_names_the_batch_and_continues(execution):
    class Boom(Exception):
        pass

    def collate(batch):
        if 6 in batch:
            raise Boom("cannot collate")
        return batch

    with AsyncLoader(list(range(13)), batch_size=4, collate_fn=collate, **on(execution)) as al:
        it = iter(al)
        assert next(it) == [0, 1, 2, 3]
        with pytest.raises(AsyncFeedError) as ei:
            next(it)
        assert "batch 1" in str(ei.value), str(ei.value)
        assert isinstance(ei.value.__cause__, Boom)
        assert next(it) == [8, 9, 10, 11]
        assert next(it) == [12]
        with pytest.raises(StopIteration):
            next(it)


# -------------------------------------------------------------- iterable data
class FlakyStream(IterableDataset):
    """Items 0..n-1; pulling an item in ``bad`` raises, and the stream goes on."""

    def __init__(self, n: int, bad) -> None:
        self.n, self.bad = n, set(bad)

    def __iter__(self):
        return _FlakyIter(self.n, self.bad)


class _FlakyIter:
    def __init__(self, n, bad):
        self.i, self.n, self.bad = 0, n, bad

    def __iter__(self):
        return self

    def __next__(self):
        i = self.i
        if i >= self.n:
            raise StopIteration
        self.i += 1
        if i in self.bad:
            raise ValueError(f"item {i} is broken")
        return torch.tensor([i]), i


def test_iterable_raise_mode_matches_dataloader():
    ds = FlakyStream(20, bad={6, 13})
    want = _drain(iter(DataLoader(ds, batch_size=4)))
    with AsyncLoader(ds, batch_size=4) as al:
        got = _drain(iter(al))
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        if isinstance(w, BaseException):
            assert isinstance(g, SampleError), repr(g)
            assert isinstance(g.__cause__, ValueError) and str(g.__cause__) == str(w)
            assert g.index in (6, 13)
        else:
            assert_same(g, w)


@pytest.mark.parametrize("bad", [
    {6, 13}, {0, 1, 2}, {17, 18, 19}, {4, 5, 6, 7, 8},
    pytest.param({16, 17, 18, 19}, id="tail-all-bad"),
    pytest.param(set(range(20)), id="all-bad")])
@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_skip_mode_continues_with_the_next_items(in_order, bad):
    ds = FlakyStream(20, bad=bad)
    with AsyncLoader(ds, batch_size=4, on_error="skip", in_order=in_order) as al:
        got = ids_of(al)
        skipped = al.stats().skipped
    want = chunks([i for i in range(20) if i not in bad], 4)
    if in_order:
        assert got == want
    else:       # batches may come in any order, each one is still the planned batch
        assert sorted(got) == want
    assert sorted(s.index for s in skipped) == sorted(bad)
    assert all(s.error_type == "ValueError" for s in skipped), skipped
