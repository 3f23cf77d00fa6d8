"""A data set bound to the thread that made it (a ``sqlite3`` connection opened in
``__init__``) works as under DataLoader: ``execution="auto"`` finds its rows fail in
decode threads and load in the consumer's thread, and runs them there.

A row that fails for its own reasons (everywhere), or only once (a flaky read),
is not taken for that: the failure stands as it would have, and later failures
are not loaded again.
"""

from __future__ import annotations

import sqlite3
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from asyncfeed import AsyncLoader, SampleError
from asyncfeed._engine.policy import Mode, Reason
from support.executions import on
from support.oracle import assert_same_batches

pytestmark = pytest.mark.timeout(60)


class SqliteRows(Dataset):
    """Rows read through a ``sqlite3`` connection opened in ``__init__``: usable only
    in the thread that opened it (and in a child forked from that thread)."""

    def __init__(self, path: str, n: int = 40, bad: tuple[int, ...] = ()) -> None:
        self.n, self.bad = n, set(bad)
        self.conn = sqlite3.connect(path)
        self.calls: list[tuple[int, str]] = []  # (index, the loading thread's name)
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with self.lock:
            self.calls.append((i, threading.current_thread().name))
        if i in self.bad:
            raise ValueError(f"row {i} is bad")
        (v,) = self.conn.execute("select v from t where i = ?", (i,)).fetchone()
        return torch.tensor([v]), i


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "rows.db")
    conn = sqlite3.connect(path)
    conn.execute("create table t (i integer primary key, v real)")
    conn.executemany("insert into t values (?, ?)", [(i, i * 0.5) for i in range(100)])
    conn.commit()
    conn.close()
    return path


def dataloader_batches(ds: Dataset) -> list:
    return list(DataLoader(ds, batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(5)))



@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_auto_runs_a_thread_bound_data_set_inline_with_dataloaders_batches(db, on_error):
    want = dataloader_batches(SqliteRows(db))
    ds = SqliteRows(db)
    with AsyncLoader(ds, batch_size=4, shuffle=True, on_error=on_error,
                     generator=torch.Generator().manual_seed(5)) as al:
        assert_same_batches(list(al), want)
        ex = al.stats().execution
        assert (ex.mode, ex.reason) == (Mode.INLINE, Reason.THREAD_BOUND)
        assert "bound to the thread that made it" in str(ex)
        assert al.stats().skipped == []
        assert len(list(al)) == 10  # later passes run inline from the start


def test_where_inline_may_not_run_a_thread_bound_data_set_goes_to_worker_processes(db):
    """A loader with a ``timeout`` never runs rows inline (a row the consumer loads
    cannot be timed out): the workers, forked from the consumer's thread, can."""
    want = dataloader_batches(SqliteRows(db))
    with AsyncLoader(SqliteRows(db), batch_size=4, shuffle=True, timeout=30,
                     multiprocessing_context="fork",
                     generator=torch.Generator().manual_seed(5)) as al:
        assert_same_batches(list(al), want)
        ex = al.stats().execution
        assert (ex.mode, ex.reason) == (Mode.PROCESSES, Reason.THREAD_BOUND)


@pytest.mark.parametrize("execution", ["inline", "processes"])
def test_a_thread_bound_data_set_loads_where_the_execution_fixed_keeps_it(db, execution):
    want = dataloader_batches(SqliteRows(db))
    with AsyncLoader(SqliteRows(db), batch_size=4, shuffle=True,
                     generator=torch.Generator().manual_seed(5), **on(execution)) as al:
        assert_same_batches(list(al), want)


def test_with_threads_fixed_by_the_user_the_failure_names_the_sample(db):
    ds = SqliteRows(db)
    with AsyncLoader(ds, batch_size=4, execution="threads") as al:
        with pytest.raises(SampleError, match=r"sample \d+ in batch 0 failed.*same thread"):
            list(al)
    here = threading.current_thread().name
    assert not [c for c in ds.calls if c[1] == here]  # nothing loaded again here


class Flaky(Dataset):
    """Row 3 fails the first time it is loaded, anywhere; every other row loads."""

    def __init__(self, n: int = 40) -> None:
        self.n, self.failed = n, False
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == 3:
            with self.lock:
                first, self.failed = not self.failed, True
            if first:
                raise OSError("connection reset")
        return torch.tensor([i]), i


def test_a_failure_that_passes_stands_and_the_execution_is_not_changed():
    with AsyncLoader(Flaky(), batch_size=4, num_workers=2) as al:
        with pytest.raises(SampleError, match=r"sample 3 in batch 0 failed.*connection reset"):
            list(al)
        ex = al.stats().execution
        assert ex.reason is not Reason.THREAD_BOUND


def test_a_row_bad_everywhere_is_skipped_and_later_bad_rows_are_not_loaded_again(db):
    free = SqliteRows(db, n=40, bad=(1, 17, 33))  # the same rows, any thread may read
    free.conn.close()
    free.conn = sqlite3.connect(db, check_same_thread=False)
    # (a timeout keeps the consumer from loading rows inline: its calls are retries)
    with AsyncLoader(free, batch_size=4, on_error="skip", timeout=30) as al:
        got = [int(x) for b in al for x in b[1]]
        assert got == [i for i in range(40) if i not in (1, 17, 33)]
        assert [s.index for s in al.stats().skipped] == [1, 17, 33]
        assert al.stats().execution.reason is not Reason.THREAD_BOUND
    # the first bad row (batch 0, loaded by the threads the loader starts on) was
    # loaded once more here, and failed: no check in a new thread; the later bad rows
    # are not loaded again here
    here = threading.current_thread().name
    assert [i for i, name in free.calls if name == here] == [1]
    assert not [c for c in free.calls if c[1] == "asyncfeed-thread-check"]
