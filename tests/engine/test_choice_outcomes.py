"""The measured choice on real passes, in cases whose outcome is clear-cut.

Each case's candidates differ by far more than any noise margin, or a bound
rules a candidate out by construction, whatever else runs on the machine: the
rows that decide between threads and processes wait instead of computing
(``Serialized``: one row at a time in a process, as the GIL makes pure Python;
``Waits``: rows that overlap freely), so their rates do not depend on the
cores left free.  The rules themselves are tested by replaying readings
(``test_policy.py``, ``test_policy_traces.py``).  Every pass is checked
against DataLoader.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader, Mode, Reason
from asyncfeed._engine.readings import Handoff
from support.oracle import assert_same_batches


class PurePython:
    """About 2 ms of pure Python a row: it holds the GIL."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        x = 0
        for k in range(25_000):
            x += k * k % 7
        return torch.tensor([x, i])


class Hashing:
    """About 2 ms of SHA-256 a row: the GIL released."""

    buf = bytes(2 << 20)

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        d = hashlib.sha256(self.buf).digest()
        return torch.tensor([d[0], i])


class Serialized:
    """Rows of 2 ms that run one at a time in a process (a lock per process held
    while the row waits): what the GIL does to pure Python, without the CPU.
    Threads cannot overlap them; worker processes can."""

    lock = threading.Lock()

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        with Serialized.lock:
            time.sleep(0.002)
        return torch.tensor([i % 7, i])


def _fresh_lock() -> None:
    Serialized.lock = threading.Lock()  # a forked child's copy may be held by a gone thread


os.register_at_fork(after_in_child=_fresh_lock)


class Waits:
    """Rows that wait 1 ms (the GIL released, no CPU): they overlap on any thread."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.001)
        return torch.tensor([i % 7, i])


class WaitsLong(Waits):
    """Rows that wait 10 ms: a thread's rate is 100 rows/s, whatever the cores."""

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor([i % 7, i])


class Free:
    """Rows that cost nothing."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i % 7, i])


class ManyFree(Free):
    """Rows that cost nothing, enough of them that a pass measures its candidates."""

    def __len__(self) -> int:
        return 20_000


class PickledBack:
    """Dict rows that cost next to nothing to load but carry 1 MiB each: with a
    custom ``collate_fn`` a worker process would send each row back pickled,
    and reading one back costs this process far more than loading it."""

    blob = torch.zeros(1 << 20, dtype=torch.uint8)

    def __len__(self) -> int:
        return 20_000

    def __getitem__(self, i: int) -> dict:
        return {"blob": self.blob, "i": i}


def ids_of(samples: list[dict]) -> torch.Tensor:
    """A collate_fn that keeps the rows' ids alone."""
    return torch.tensor([s["i"] for s in samples])


def _settle(al: AsyncLoader, ds, batch_size: int, passes: int = 30, step=None,
            collate_fn=None) -> None:
    """Iterate passes (each checked against DataLoader) until the choice settled."""
    want = list(DataLoader(ds, batch_size=batch_size, collate_fn=collate_fn))
    for _ in range(passes):
        got = []
        for b in al:
            got.append(b)
            if step is not None:
                step()
        assert_same_batches(got, want)
        if not al._chooser.exploring:
            return
    raise AssertionError(f"not settled after {passes} passes: {al.stats().execution}")


@pytest.mark.timeout(120)
def test_rows_serialized_in_one_process_go_to_worker_processes():
    """One thread's rate is all threads get; two processes get twice it."""
    if (os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the bound rules processes out (tested below)")
    ds = Serialized()
    with AsyncLoader(ds, batch_size=16, num_workers=2) as al:
        _settle(al, ds, 16)
        ex = al.stats().execution
    assert ex.mode is Mode.PROCESSES and ex.reason is Reason.FASTER, str(ex)
    rates = {m.candidate: m.rate for m in ex.candidates}
    best_threads = max(r for c, r in rates.items() if c.mode is Mode.THREADS)
    assert rates[ex.candidate] > 1.5 * best_threads, str(ex)


@pytest.mark.timeout(120)
def test_rows_that_overlap_on_threads_never_fork():
    """More threads than cores keep more rows in flight; processes, at most the
    cores times one thread's rate, have no room: they are not even started."""
    ds = Waits()
    with AsyncLoader(ds, batch_size=16) as al:
        _settle(al, ds, 16)
        ex = al.stats().execution
        assert al._exec.stage is None
    assert ex.mode is Mode.THREADS and ex.processes_skipped is Reason.NO_ROOM, str(ex)


@pytest.mark.timeout(120)
def test_rows_that_wait_climb_past_the_pools_threads():
    """Twice the pool's threads overlap twice the waits: the search climbs past the
    pool (leaping up the ladder, the rungs leapt over searched) and keeps more
    threads than it started, at more than twice the start's rate."""
    ds = WaitsLong()
    with AsyncLoader(ds, batch_size=16) as al:
        pool = al.num_threads
        start = al._chooser.space.start
        _settle(al, ds, 16)
        ex = al.stats().execution
    assert ex.mode is Mode.THREADS and ex.count >= 2 * pool, (pool, str(ex))
    rates = {m.candidate: m.rate for m in ex.candidates}
    assert rates[ex.candidate] > 2 * rates[start], str(ex)


@pytest.mark.timeout(120)
def test_rows_that_would_come_back_pickled_dearer_than_they_load_never_fork():
    """Reading a 1 MiB row back from a worker holds this process's GIL longer than
    loading it here takes: the measured hand-off bounds processes below what one
    thread delivers, so they are not even started.  (Skipping failed rows, workers
    send rows back, not the batch their ``collate_fn`` would make.)"""
    ds = PickledBack()
    with AsyncLoader(ds, batch_size=64, collate_fn=ids_of, on_error="skip") as al:
        # its passes are short: a duel's later rounds read windows over several
        _settle(al, ds, 64, passes=80, collate_fn=ids_of)
        ex = al.stats().execution
        assert al._exec.stage is None
        handoff = al._chooser.record.handoff
    assert handoff is not None and handoff.unpickle_s > 0, handoff
    assert ex.processes_skipped is Reason.HANDOFF, str(ex)
    assert not any(m.candidate.mode is Mode.PROCESSES for m in ex.candidates), str(ex)


def test_rows_written_in_place_cost_no_hand_off():
    """With the default collate and rows of one shape, workers write rows into
    shared memory: nothing is read back per row."""
    ds = ManyFree()
    with AsyncLoader(ds, batch_size=64) as al:
        _settle(al, ds, 64)
        assert al._chooser.record.handoff == Handoff.IN_PLACE


@pytest.mark.timeout(120)
def test_a_consumer_slower_than_the_rows_keeps_the_cheapest_candidate_that_keeps_up():
    """The training step (64 ms a batch) is all the time there is: rows cost
    nothing, so every candidate keeps up, and the cheapest, inline, stays;
    nothing dearer than one thread is tried.  (A thread's rows need it scheduled
    a few times a step, not once a row: the scheduler's delays on a loaded
    machine stay far below the step.)"""
    ds = Free()
    with AsyncLoader(ds, batch_size=8) as al:
        _settle(al, ds, 8, step=lambda: time.sleep(0.064))
        ex = al.stats().execution
    assert ex.mode is Mode.INLINE, str(ex)
    assert ex.processes_skipped is Reason.CONSUMER, str(ex)
    assert not any(m.candidate.mode is Mode.PROCESSES or m.candidate.count > 2
                   for m in ex.candidates), str(ex)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["Hashing", "PurePython"])
def test_on_one_core_rows_never_go_to_worker_processes(kind):
    """Pinned to one core (as ``taskset -c 0``), worker processes cannot beat one
    thread: the bound rules them out before any fork."""
    script = textwrap.dedent(f"""
        import os, sys
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
        sys.path[:0] = {sys.path!r}
        from test_choice_outcomes import {kind} as DS, _settle
        from asyncfeed import AsyncLoader
        with AsyncLoader(DS(), batch_size=16) as al:
            _settle(al, DS(), 16)
            ex = al.stats().execution
            assert al._exec.stage is None
        print(ex.mode.value, ex.processes_skipped.value if ex.processes_skipped else "-")
    """)
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=170, cwd=here,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])})
    assert out.returncode == 0, out.stderr[-3000:]
    mode, skipped = out.stdout.split()
    assert mode != "processes" and skipped == "no_room", out.stdout
