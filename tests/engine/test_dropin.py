"""Drop-in behaviour users rely on (issue 12, items 4-9): exceptions of the original
type, DataLoader's timeout error, typing and assignment rules, out-of-order
delivery, StatefulDataLoader's extra arguments, one iterator shared by threads.
``torch.utils.data.DataLoader`` is the oracle where it runs here.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from asyncfeed import AsyncFeedError, AsyncLoader, LoaderTimeout, SampleError
from support.datasets import Ids, ids

pytestmark = pytest.mark.timeout(60)


def raised(fn):
    """The exception ``fn()`` raised (BaseException included), or None."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def first_error(loader):
    """(batches delivered before the error, the error) of one pass."""
    got = []
    it = iter(loader)
    while True:
        try:
            got.append(next(it))
        except StopIteration:
            return got, None
        except BaseException as e:  # noqa: BLE001
            return got, e


# ------------------------------------------------------- 4. exceptions keep their type
class Lookup:
    """``__getitem__`` raises KeyError for the keys it lacks, like a dict-backed set."""

    def __init__(self, n: int, missing: int) -> None:
        self.table = {i: torch.tensor([i]) for i in range(n) if i != missing}
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.table[i]


@pytest.mark.parametrize("loader_cls", [DataLoader, AsyncLoader])
def test_a_getitem_keyerror_is_caught_by_except_keyerror(loader_cls):
    loader = loader_cls(Lookup(12, missing=6), batch_size=4)
    it = iter(loader)
    assert next(it).tolist() == [[0], [1], [2], [3]]
    try:
        next(it)
    except KeyError as e:
        err = e
    else:
        pytest.fail("no KeyError")
    if loader_cls is AsyncLoader:
        assert isinstance(err, SampleError) and err.index == 6 and err.batch == 1
        msg = str(err)
        assert msg.startswith("sample 6 in batch 1 failed: KeyError: 6"), msg
        assert "Original Traceback" in msg and "in __getitem__" in msg
        assert "return self.table[i]" in msg
        assert type(err.__cause__) is KeyError
        assert next(it).tolist() == [[8], [9], [10], [11]]       # the pass goes on
        loader.close()


def test_a_missing_file_is_a_filenotfounderror_naming_the_path(tmp_path):
    import os

    import asyncfeed
    from support.imagegen import write
    (tmp_path / "a").mkdir()
    for j in range(6):
        write("baseline", tmp_path / "a" / f"{j:02d}.jpg", seed=j)
    ds = asyncfeed.ImageFolder(tmp_path, size=16)
    os.unlink(tmp_path / "a" / "04.jpg")
    with AsyncLoader(ds, batch_size=2) as loader:
        got, err = first_error(loader)
    assert len(got) == 2
    assert isinstance(err, FileNotFoundError) and isinstance(err, SampleError)
    assert err.errno == 2 and err.index == 4 and err.batch == 2
    assert err.source.endswith("04.jpg") and "04.jpg" in str(err).splitlines()[0]
    assert type(err.__cause__) is FileNotFoundError


class Boom(Exception):
    def __init__(self, code: int, where: str) -> None:
        super().__init__(code, where)
        self.code, self.where = code, where


def test_a_collate_fn_error_keeps_its_type_and_attributes():
    def collate(batch):
        if 5 in batch:
            raise Boom(42, "collate")
        return batch

    for loader_cls in (DataLoader, AsyncLoader):
        loader = loader_cls(list(range(12)), batch_size=4, collate_fn=collate)
        got, err = first_error(loader)
        assert got == [[0, 1, 2, 3]]
        assert isinstance(err, Boom) and err.code == 42 and err.where == "collate"
        if loader_cls is AsyncLoader:
            assert "batch 1" in str(err) and "Original Traceback" in str(err)
            loader.close()


class FailingSampler(Sampler):
    """Raises KeyError when asked for its 9th index."""

    def __len__(self):
        return 16

    def __iter__(self):
        for i in range(16):
            if i == 9:
                raise KeyError("sampler ran dry")
            yield i


@pytest.mark.parametrize("loader_cls", [DataLoader, AsyncLoader])
def test_a_sampler_error_is_raised_as_it_is_at_its_batch(loader_cls):
    loader = loader_cls(Ids(16), batch_size=4, sampler=FailingSampler())
    got, err = first_error(loader)
    assert [ids(b) for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert type(err) is KeyError and err.args == ("sampler ran dry",)
    if isinstance(loader, AsyncLoader):
        loader.close()


class Final(Exception):
    """An exception type that refuses subclasses."""

    def __init_subclass__(cls, **kw):
        raise TypeError("Final cannot be subclassed")


class Raises:
    def __init__(self, exc: BaseException, at: int = 3, n: int = 8) -> None:
        self.exc, self.at, self.n = exc, at, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at:
            raise self.exc
        return torch.tensor([i])


def test_a_type_that_cannot_be_rebuilt_falls_back_to_a_wrapper_that_says_so():
    with AsyncLoader(Raises(Final("no")), batch_size=2) as loader:
        _, err = first_error(loader)
    assert type(err) is SampleError and err.index == 3
    assert "could not be rebuilt" in str(err) and isinstance(err.__cause__, Final)


def test_stopiteration_from_getitem_does_not_end_the_loop_silently():
    with AsyncLoader(Raises(StopIteration()), batch_size=2) as loader:
        got, err = first_error(loader)
    assert len(got) == 1 and type(err) is SampleError and "would end the loop" in str(err)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_keyboardinterrupt_and_systemexit_are_never_wrapped_nor_skipped(exc, on_error):
    with AsyncLoader(Raises(exc()), batch_size=2, on_error=on_error) as loader:
        got, err = first_error(loader)
        assert type(err) is exc
        assert loader.stats().skipped == []
    assert len(got) == 1


class BadStr(ValueError):
    def __str__(self):
        raise RuntimeError("__str__ is broken")


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_exception_whose_str_raises_keeps_the_index(on_error):
    with AsyncLoader(Raises(BadStr(), at=3, n=8), batch_size=2, on_error=on_error) as loader:
        got, err = first_error(loader)
        skipped = loader.stats().skipped
    if on_error == "raise":
        assert isinstance(err, ValueError) and err.index == 3
        assert "sample 3" in str(err) and "BadStr" in str(err)
    else:
        assert err is None and [s.index for s in skipped] == [3]
        assert skipped[0].error_type == "BadStr"
        assert skipped[0].error.startswith("BadStr: ")  # the text, though str() raised
        assert sum((b.flatten().tolist() for b in got), []) == [0, 1, 2, 4, 5, 6, 7]


def test_a_rebuilt_error_pickles():
    with AsyncLoader(Lookup(4, missing=1), batch_size=2) as loader:
        _, err = first_error(loader)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, KeyError) and isinstance(again, SampleError)
    assert again.index == 1 and str(again) == str(err)


class FailingStream(IterableDataset):
    def __iter__(self):
        yield torch.tensor([0])
        raise IndexError("stream broke")


def test_an_iterable_datasets_error_keeps_its_type():
    with AsyncLoader(FailingStream(), batch_size=1) as loader:
        got, err = first_error(loader)
    assert len(got) == 1 and isinstance(err, IndexError) and err.index == 1


# ------------------------------------------------------------------------ 5. timeout
class Hangs:
    def __init__(self, at: int) -> None:
        self.at = at
        self.release = threading.Event()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.at:
            self.release.wait(30)
        return torch.tensor([i])


def test_timeout_raises_dataloaders_runtimeerror_naming_pending_samples():
    ds = Hangs(at=3)
    loader = AsyncLoader(ds, batch_size=2, timeout=0.5, num_threads=2)
    try:
        it = iter(loader)
        next(it)
        with pytest.raises(RuntimeError, match=r"timed out after 0\.5 seconds") as ei:
            next(it)
        assert isinstance(ei.value, LoaderTimeout) and isinstance(ei.value, AsyncFeedError)
        assert "samples [3]" in str(ei.value)
    finally:
        ds.release.set()
        loader.close()


# ---------------------------------------------------------- 6. typing and assignment
def test_asyncloader_is_generic_like_dataloader():
    def f(loader: AsyncLoader[List[torch.Tensor]]) -> None: ...
    assert AsyncLoader[List[torch.Tensor]] is not None
    assert DataLoader[List[torch.Tensor]] is not None


@pytest.mark.parametrize("attr, value", [("batch_size", 5), ("dataset", [1]),
                                         ("sampler", None), ("batch_sampler", None),
                                         ("drop_last", True)])
def test_assigning_plan_attributes_after_construction_raises_like_dataloader(attr, value):
    dl = DataLoader(Ids(10), batch_size=2)
    with pytest.raises(ValueError) as want:
        setattr(dl, attr, value)
    al = AsyncLoader(Ids(10), batch_size=2)
    with pytest.raises(ValueError) as got:
        setattr(al, attr, value)
    assert str(got.value) == str(want.value).replace("DataLoader", "AsyncLoader")
    assert [ids(b) for b in al][0] == [0, 1]
    al.timeout = 3                                  # other attributes stay assignable


# ------------------------------------------------------------ 7. in_order=False
class SlowFirst:
    def __init__(self, n: int = 12, delay: float = 0.6) -> None:
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:
            time.sleep(self.delay)
        return torch.tensor([i])


def test_out_of_order_delivers_fast_samples_first_at_batch_size_one():
    dl = DataLoader(SlowFirst(), batch_size=1, num_workers=2, in_order=False)
    oracle = [b.item() for b in dl]
    with AsyncLoader(SlowFirst(), batch_size=1, num_threads=2, in_order=False) as al:
        got = [b.item() for b in al]
    assert oracle[0] != 0 and got[0] != 0
    assert sorted(got) == sorted(oracle) == list(range(12))


def test_out_of_order_resume_is_exact():
    with AsyncLoader(SlowFirst(20, 0.3), batch_size=1, num_threads=2,
                     in_order=False) as al:
        it = iter(al)
        taken = [next(it).item() for _ in range(4)]
        state = al.state_dict()
    assert 0 not in taken and state["taken_extra"]
    with AsyncLoader(SlowFirst(20, 0.0), batch_size=1, in_order=False) as al:
        al.load_state_dict(state)
        rest = [b.item() for b in al]
    assert sorted(taken + rest) == list(range(20))


# --------------------------------------------------- 8. StatefulDataLoader's arguments
def test_snapshot_every_n_steps_is_accepted():
    with AsyncLoader(Ids(10), batch_size=2, snapshot_every_n_steps=5) as al:
        assert al.snapshot_every_n_steps == 5
        it = iter(al)
        next(it)
        assert al.state_dict()["batches_taken"] == 1   # every state is exact anyway


# ---------------------------------------------------------- 9. a shared iterator
class Plain:
    def __len__(self):
        return 3000

    def __getitem__(self, i):
        return torch.tensor([i])


@pytest.mark.parametrize("in_order", [True, False])
def test_one_iterator_shared_by_threads_delivers_every_batch_once(in_order):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # threads switch often: races show up at once
    try:
        _shared(workers=8, in_order=in_order)
    finally:
        sys.setswitchinterval(interval)


def _shared(workers: int, in_order: bool) -> None:
    n = len(Plain())
    with AsyncLoader(Plain(), batch_size=1, num_threads=2, prefetch=8,
                     in_order=in_order) as al:
        it = iter(al)
        seen: list[list[int]] = [[] for _ in range(workers)]
        errors: list[BaseException] = []

        def consume(j: int) -> None:
            try:
                for b in it:
                    seen[j].extend(b.flatten().tolist())
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(j,)) for j in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a consumer hung"
        assert errors == []
        assert sorted(sum(seen, [])) == list(range(n))
        st = al.stats()
        assert st.batches == n and st.samples == n
        assert al.state_dict()["in_pass"] is False
