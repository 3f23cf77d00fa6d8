"""Datasets that open what they need on first use, as DataLoader's users write them.

The idiom (``if self.env is None: self.env = lmdb.open(...)`` in ``__getitem__``)
is safe in DataLoader's worker processes, where one thread makes the first call.
Every execution keeps it safe: in threads, a call that raced the pass's first
call into ``__getitem__`` (or ``__getitems__``) and raised is made once more
after it, and the batches are DataLoader's.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from asyncfeed import AsyncLoader
from asyncfeed._engine.firstcall import retry_racing_first
from support.executions import on
from support.oracle import assert_same_batches

pytestmark = pytest.mark.timeout(60)

#: per process, the "environments" open, as LMDB keeps them: a second open of one
#: path in one process raises
_OPEN: set[str] = set()
_OPEN_LOCK = threading.Lock()


def open_env(path: str) -> dict[int, int]:
    with _OPEN_LOCK:
        if (os.getpid(), path) in _OPEN:
            raise RuntimeError(f"the environment {path!r} is already open in this process")
        _OPEN.add((os.getpid(), path))  # type: ignore[arg-type]
    time.sleep(0.05)  # opening takes a while: the other threads arrive meanwhile
    return {i: 3 * i for i in range(1000)}


class OpensOnFirstUse(Dataset):
    """An LMDB-style data set: the environment opened on first use, at most once
    per process."""

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path, self.env = n, path, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.env is None:
            self.env = open_env(self.path)
        return torch.tensor([self.env[i]]), i


class FillsIndexOnFirstUse(Dataset):
    """An index built in place on first use: a thread that finds it no longer
    ``None`` before it is full would miss keys."""

    def __init__(self, n: int) -> None:
        self.n, self.index = n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.index is None:
            self.index = {}
            for k in range(self.n):
                self.index[k] = k * k
                if k == 0:
                    time.sleep(0.1)  # a slow source: the other threads arrive meanwhile
        return torch.tensor([self.index[i]]), i


class BatchOpensOnFirstUse(OpensOnFirstUse):
    """The same with ``__getitems__``: one call a batch."""

    def __getitems__(self, indices: list[int]):
        if self.env is None:
            self.env = open_env(self.path)
        return [(torch.tensor([self.env[i]]), i) for i in indices]


def dataloader_batches(ds: Dataset) -> list:
    return list(DataLoader(ds, batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(3)))



@pytest.mark.parametrize("make", [
    lambda tag: OpensOnFirstUse(64, f"/envs/{tag}"),
    lambda tag: FillsIndexOnFirstUse(64),
    lambda tag: BatchOpensOnFirstUse(64, f"/envs/{tag}"),
], ids=["opens-once", "fills-index", "getitems"])
def test_a_data_set_that_opens_on_first_use_gives_dataloaders_batches(execution, make,
                                                                       request):
    want = dataloader_batches(make(request.node.name + "-oracle"))
    ds = make(request.node.name)
    with AsyncLoader(ds, batch_size=4, shuffle=True, num_threads=4,
                     generator=torch.Generator().manual_seed(3), **on(execution)) as al:
        got = list(al)
        stats = al.stats()
    assert_same_batches(got, want)
    assert stats.skipped == []


def test_in_threads_the_first_call_opens_once_and_later_passes_run_side_by_side():
    ds = OpensOnFirstUse(64, "/envs/threads-once")
    with AsyncLoader(ds, batch_size=4, num_threads=4, execution="threads") as al:
        for _ in range(2):
            assert [int(x) for b in al for x in b[1]] == list(range(64))
    assert (os.getpid(), "/envs/threads-once") in _OPEN  # opened here, once: no error


def test_after_a_first_call_returned_later_passes_call_the_dataset_directly():
    """The loader's first pass wraps ``__getitem__``; once a first call returned (the
    resource open), the later passes call the bound method, nothing in between."""
    ds = OpensOnFirstUse(16, "/envs/later-passes")
    with AsyncLoader(ds, batch_size=4, num_threads=2, execution="threads") as al:
        it = iter(al)
        rows = it._p.rows  # type: ignore[attr-defined]
        assert rows.getitem != ds.__getitem__  # wrapped until the first call ends
        assert len(list(it)) == 4
        assert rows.getitem == ds.__getitem__  # swapped for the method itself
        later = iter(al)
        assert later._p.rows.getitem == ds.__getitem__  # type: ignore[attr-defined]
        assert len(list(later)) == 4


def racing(first_blocks: threading.Event, first_in: threading.Event, fails: set[str],
           calls: list[str]):
    """A function whose call "first" blocks until released; the tags in ``fails``
    raise while "first" has not returned (the race), and succeed after."""
    state = {"first_done": False}

    def fn(tag: str) -> str:
        calls.append(tag)
        if tag == "first":
            first_in.set()
            first_blocks.wait(5)
            state["first_done"] = True
        elif tag in fails and not state["first_done"]:
            raise KeyError(tag)
        return tag

    return fn


def test_a_call_that_raced_the_first_and_raised_is_made_again_after_it():
    release, first_in = threading.Event(), threading.Event()
    calls: list[str] = []
    fn = racing(release, first_in, {"racer"}, calls)
    settled: list[object] = []
    wrapped = retry_racing_first(fn, lambda f, ok: settled.append((f, ok)))
    out: dict[str, object] = {}
    first = threading.Thread(target=lambda: out.setdefault("first", wrapped("first")))
    first.start()
    assert first_in.wait(5)
    racer = threading.Thread(target=lambda: out.setdefault("racer", wrapped("racer")))
    racer.start()
    racer.join(0.2)
    assert racer.is_alive() and calls == ["first", "racer"]  # raised: waits for the first
    assert wrapped("quick") == "quick"  # a call that does not fail never waits
    release.set()
    first.join(5)
    racer.join(5)
    assert out == {"first": "first", "racer": "racer"}
    assert calls == ["first", "racer", "quick", "racer"]
    assert settled == [(fn, True)]  # the owner swaps the wrapper for fn itself


def test_a_call_that_fails_after_the_first_ended_is_not_made_again():
    calls: list[int] = []

    def fn(i: int) -> int:
        calls.append(i)
        if i < 0:
            raise ValueError(f"bad sample {i}")
        return i

    settled: list[object] = []
    wrapped = retry_racing_first(fn, lambda f, ok: settled.append((f, ok)))
    assert wrapped(0) == 0 and settled == [(fn, True)]
    with pytest.raises(ValueError, match="bad sample -1"):
        wrapped(-1)
    assert calls == [0, -1]


def test_where_the_first_call_raises_the_racing_failures_stand():
    release, first_in = threading.Event(), threading.Event()

    def fn(tag: str) -> str:
        if tag == "first":
            first_in.set()
            release.wait(5)
            raise ValueError("bad first sample")
        raise KeyError(tag)  # a sample that is bad for its own reasons

    calls: list[str] = []
    settled: list[object] = []
    wrapped = retry_racing_first(lambda t: calls.append(t) or fn(t),
                                 lambda f, ok: settled.append(ok))
    errors: dict[str, BaseException] = {}

    def run(tag: str) -> None:
        try:
            wrapped(tag)
        except BaseException as e:  # noqa: BLE001
            errors[tag] = e

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert first_in.wait(5)
    racer = threading.Thread(target=run, args=("racer",))
    racer.start()
    racer.join(0.2)
    assert racer.is_alive()
    release.set()
    first.join(5)
    racer.join(5)
    assert isinstance(errors["first"], ValueError) and isinstance(errors["racer"], KeyError)
    assert calls == ["first", "racer"]  # not made again
    assert settled == [False]  # the first call raised: the loader's later passes wrap too
