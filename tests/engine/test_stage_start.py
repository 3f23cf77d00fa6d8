"""Starting the process stage mid-pass, and leaving it: how, how fast, and safely.

A switch to processes (here requested by hand, ``Chooser.request``, where the
chooser would after measuring) is applied by the consumer as soon as it waits
(``call_waiting``); row tasks queued for the threads move to the stage; the
fork happens with no decode thread inside user code (``TaskPool.quiet``); a
forked child never runs its parent's exit hooks; a worker whose loader's
process is killed exits.  A switch away from processes gives the stage's
backlog of the pass back to the threads.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
from torch.utils.data import DataLoader

from asyncfeed._engine.pipeline import Pipeline
from asyncfeed import AsyncLoader
from asyncfeed._engine import processes
from asyncfeed._engine.processes import execution, handover, shm
from asyncfeed._engine.processes import stage as stage_mod
from asyncfeed._engine.policy import Mode
from asyncfeed._engine.policy import processes as processes_n
from asyncfeed._engine.policy import threads as threads_n
from asyncfeed._engine.tasksize import Gate
from asyncfeed._engine.exithooks import OpenSet
from asyncfeed._engine.taskpool import TaskPool
from support.oracle import TupleFixed, assert_same_batches


def test_quiet_holds_new_tasks_and_waits_for_running_ones():
    pool = TaskPool(3, "asyncfeed-test-quiet")
    try:
        running = threading.Event()
        release = threading.Event()
        ran: list[str] = []

        def slow() -> None:
            running.set()
            release.wait(5)
            ran.append("slow")

        pool.submit(slow)
        assert running.wait(5)
        threading.Timer(0.2, release.set).start()
        t0 = time.monotonic()
        with pool.quiet() as calm:
            waited = time.monotonic() - t0
            assert calm and ran == ["slow"] and waited >= 0.15
            pool.submit(ran.append, "held")
            time.sleep(0.1)
            assert ran == ["slow"]  # no task starts while quiet
        deadline = time.monotonic() + 5
        while "held" not in ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["slow", "held"]
        # a task that does not end in time: quiet says so (and lets tasks go on after)
        release.clear()
        running.clear()
        pool.submit(slow)
        assert running.wait(5)
        with pool.quiet(timeout=0.1) as calm:
            assert not calm
        release.set()
    finally:
        pool.shutdown(wait=True)


def test_take_queued_takes_back_only_the_tasks_asked_for_in_order():
    pool = TaskPool(1, "asyncfeed-test-take")
    try:
        running, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def block() -> None:
            running.set()
            release.wait(5)

        def mine(x: str) -> None:
            ran.append("mine " + x)

        pool.submit(block)
        assert running.wait(5)  # the only thread is busy: what follows stays queued
        for x in "ab":
            pool.submit(mine, x)
            pool.submit(ran.append, "other " + x)
        taken = pool.take_queued(lambda fn, args: fn is mine)
        assert [args for _, args in taken] == [("a",), ("b",)]
        assert pool.take_queued(lambda fn, args: fn is mine) == []
        release.set()
        deadline = time.monotonic() + 5
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert ran == ["other a", "other b"]  # the rest ran, in order; taken ones never
    finally:
        pool.shutdown(wait=True)
    # after shutdown the stop stays queued: taking tasks back cannot swallow it
    pool = TaskPool(2, "asyncfeed-test-take")
    pool.shutdown(wait=False)
    assert pool.take_queued(lambda fn, args: True) == []
    for t in pool.threads:
        t.join(5)
        assert not t.is_alive()


class _Item:
    closed = False


def test_a_forked_child_does_not_close_its_parents_objects():
    closed: list[int] = []
    opened = OpenSet(lambda items: closed.extend(os.getpid() for _ in items))
    item = _Item()
    opened.add(item)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of its parent's is its to close
        os.close(r)
        os.write(w, str(len(opened.left())).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"0"
    assert opened.left() == [item]  # the parent still has it


# --------------------------------------------------------------- mid-pass moves
class _Tiny:
    """Fixed-shape samples, slow in the loader's process; sample ``trigger`` (loaded
    there) asks for two worker processes, as a measured choice would."""

    def __init__(self, n: int, trigger: int) -> None:
        self.n, self.trigger = n, trigger
        self.loader: AsyncLoader | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if os.getpid() == _PARENT and self.loader is not None:
            if i == self.trigger:
                self.loader._chooser.request(processes_n(2))
            time.sleep(0.002)  # slow in threads: batches wait in the queue
        return np.full((3, 4), i, np.int64), i % 7


_PARENT = os.getpid()


def test_row_tasks_queued_for_threads_move_to_the_stage(monkeypatch):
    sent: list[str | None] = []
    real = processes.ProcessStage.submit

    def spy(self, p, b, lo, hi, path):
        ok = real(self, p, b, lo, hi, path)
        if ok:
            sent.append(path)
        return ok

    monkeypatch.setattr(processes.ProcessStage, "submit", spy)
    ds = _Tiny(400, trigger=16 * 2 + 3)
    with AsyncLoader(ds, batch_size=16, num_threads=1, prefetch=4) as al:
        ds.loader = al
        got = list(al)
        ex = al.stats().execution
        assert (ex.mode, ex.count) == (Mode.PROCESSES, 2), str(ex)
    ds.loader = None
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))
    assert None in sent, "no queued row task went to the stage (pickled back)"
    assert any(p is not None for p in sent), "later batches did not use shared memory"


def test_a_pass_leaving_the_stage_takes_back_only_its_backlog_in_order(monkeypatch):
    from types import SimpleNamespace
    queued: list[tuple[object, object, list[tuple[int, int]]]] = []
    monkeypatch.setattr(stage_mod, "rows_to_threads",
                        lambda p, b, spans: queued.append((p, b, spans)))
    stage = processes.ProcessStage(TupleFixed(8), 2, None, None, 0, 2)
    try:
        mine, other = SimpleNamespace(name="mine"), SimpleNamespace(name="other")
        stage._pending[0] = (mine, "b0", 0, 8, 1, 0.0)     # a worker holds it: stays
        for tid, (p, b, lo, hi) in enumerate(((mine, "b1", 0, 8), (other, "c1", 0, 4),
                                              (mine, "b1", 8, 16), (mine, "b2", 0, 3)), 1):
            stage._pending[tid] = (p, b, lo, hi, -1, 0.0)
            stage._backlog.append((tid, None))
        assert stage.give_back(mine) == 19
        assert queued == [(mine, "b1", [(0, 8)]), (mine, "b1", [(8, 16)]),
                          (mine, "b2", [(0, 3)])]
        assert list(stage._backlog) == [(2, None)]          # the other pass's task waits
        assert sorted(stage._pending) == [0, 2]
        assert stage.holds(mine) and stage.holds(other)     # the worker's task is mine
        queued.clear()
        assert stage.give_back(mine) == 0 and queued == []  # nothing left to give
    finally:
        stage._pending.clear()
        stage._backlog.clear()
        stage.close()


class _Recorded:
    """Fixed-shape samples; slow in the workers (their tasks pile up in the stage's
    backlog); the indices loaded in the loader's own process are recorded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.here: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if os.getpid() == _PARENT:
            self.here.append(i)
        else:
            time.sleep(0.004)
        return np.full((3, 4), i, np.int64), i % 7


def test_rows_the_workers_had_not_taken_run_in_threads_after_the_switch(monkeypatch):
    given: list[int] = []
    real = processes.ProcessStage.give_back

    def spy(self, p):
        n = real(self, p)
        given.append(n)
        return n

    monkeypatch.setattr(processes.ProcessStage, "give_back", spy)
    ds = _Recorded(320)
    with AsyncLoader(ds, batch_size=16, num_threads=1, prefetch=6,
                     execution="processes") as al:
        got = []
        for k, batch in enumerate(al):
            got.append(batch)
            if k == 3:
                ds.here.clear()
                al._chooser.request(threads_n(1))
        ex = al.stats().execution
        assert (ex.mode, ex.count) == (Mode.THREADS, 1), str(ex)
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))
    assert given and given[0] > 0, "the stage had no backlog to give back"
    # the rows given back are those of batches already planned: some of the next
    # batches' rows ran here, not only those of batches planned after the switch
    planned_before = set(range(4 * 16, (4 + 6) * 16))
    assert planned_before & set(ds.here), "no row of an earlier batch ran in this process"


# -------------------------------------------------------------- parent death
def test_workers_exit_when_the_loaders_process_is_killed(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        import numpy as np
        from asyncfeed import AsyncLoader

        class DS:
            def __len__(self): return 10_000
            def __getitem__(self, i): return np.zeros(4), i

        al = AsyncLoader(DS(), batch_size=8, execution="processes")
        it = iter(al)
        next(it)
        print(" ".join(map(str, al._exec.stage.pids())), flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [q for q in pids if psutil.pid_exists(q)
                     and psutil.Process(q).status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.1)
        assert not alive, f"workers outlived the killed loader: {alive}"
        left = glob.glob(f"/dev/shm/asyncfeed-{p.pid}-*")
        assert not left, f"the killed loader's shared memory outlived its workers: {left}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_new_stage_removes_the_shared_memory_of_dead_loaders():
    """A loader killed with its workers (no one left to unlink its files): the next
    stage started on the machine removes them; live loaders' files stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/asyncfeed-{dead.pid}-0123abcd-0"
    alive = f"/dev/shm/asyncfeed-{os.getppid()}-0123abcd-0"  # pytest's parent lives
    for path in (stale, alive):
        with open(path, "wb") as f:
            f.write(b"x" * 64)
    try:
        with AsyncLoader(TupleFixed(32), batch_size=8, execution="processes") as al:
            list(al)
        assert not os.path.exists(stale), "a dead loader's file survived a new stage"
        assert os.path.exists(alive), "a live process's file was removed"
    finally:
        for path in (stale, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_a_held_lease_keeps_a_loaders_files_whatever_its_pid_reads():
    """A loader in another PID namespace (a container sharing ``/dev/shm``) has a
    PID this process cannot see: its held lease keeps its files; released (the
    loader gone), the next stage removes them."""
    import fcntl
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    group = f"/dev/shm/asyncfeed-{dead.pid}-89abcdef"
    files = [f"{group}-0", f"{group}-{shm.LEASE}"]
    for path in files:
        with open(path, "wb") as f:
            f.write(b"x" * 64)
    held = os.open(files[1], os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with AsyncLoader(TupleFixed(32), batch_size=8, execution="processes") as al:
            list(al)
        assert all(os.path.exists(p) for p in files), "a live loader's files were removed"
        os.close(held)
        held = -1
        with AsyncLoader(TupleFixed(32), batch_size=8, execution="processes") as al:
            list(al)
        assert not any(os.path.exists(p) for p in files), "a gone loader's files survived"
    finally:
        if held >= 0:
            os.close(held)
        for path in files:
            if os.path.exists(path):
                os.unlink(path)


def test_a_loaders_lease_is_held_while_it_lives_and_gone_after_close():
    with AsyncLoader(TupleFixed(32), batch_size=8, execution="processes") as al:
        it = iter(al)
        next(it)
        leases = glob.glob(f"/dev/shm/asyncfeed-{os.getpid()}-*-{shm.LEASE}")
        assert len(leases) == 1 and not shm._lease_free(leases[0])
        shm.remove_segments()  # a sweep by another stage spares it
        assert os.path.exists(leases[0])
        assert len(list(it)) == 3
    assert not os.path.exists(leases[0])


# ------------------------------------------------------------ inline rows
class _Noop:
    """Rows that cost nothing: a preallocated array and the index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.row = np.arange(12, dtype=np.int32).reshape(3, 4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.row, i


def test_inline_rows_are_loaded_by_the_waiting_consumer():
    """``execution="inline"``: every row of every pass runs in the consumer's thread
    (``num_workers=0``), and the batches are DataLoader's."""
    ds = _Noop(3000)
    ran_in: set[str] = set()
    real = _Noop.__getitem__

    def spy(self, i):
        ran_in.add(threading.current_thread().name)
        return real(self, i)

    g = torch_generator(3)
    with AsyncLoader(ds, batch_size=64, shuffle=True, generator=torch_generator(3),
                     execution="inline") as al:
        _Noop.__getitem__ = spy  # type: ignore[method-assign]
        try:
            for _ in range(2):
                assert_same_batches(list(al), list(DataLoader(ds, batch_size=64, shuffle=True,
                                                              generator=g)))
        finally:
            _Noop.__getitem__ = real  # type: ignore[method-assign]
        why = al.stats().execution
    assert why.mode is Mode.INLINE and why.reason.value == "fixed", str(why)
    assert ran_in == {threading.current_thread().name}, ran_in


def test_run_one_runs_a_queued_task_in_the_calling_thread():
    pool = TaskPool(1, "asyncfeed-test-runone", gate=Gate(0))  # its thread runs nothing
    try:
        got: list[str] = []
        pool.submit(lambda: got.append(threading.current_thread().name))
        assert pool.run_one() is True
        assert got == [threading.current_thread().name]
        assert pool.run_one() is False  # nothing queued
    finally:
        pool.shutdown(wait=True)


def torch_generator(seed: int):
    import torch
    return torch.Generator().manual_seed(seed)


class _SlowOnce(_Tiny):
    """As :class:`_Tiny`, and the triggering sample then takes 0.6 s (in the loader's
    process): the stage cannot fork while it runs."""

    def __getitem__(self, i: int):
        out = super().__getitem__(i)
        if i == self.trigger and os.getpid() == _PARENT and self.loader is not None:
            time.sleep(0.6)
        return out


def test_the_fork_waits_for_running_tasks_and_tries_again_later(monkeypatch, caplog):
    import logging
    monkeypatch.setattr(stage_mod, "QUIET_S", 0.1)
    monkeypatch.setattr(execution, "QUIET_RETRY_S", 0.2)
    ds = _SlowOnce(320, trigger=16 * 2 + 3)
    with caplog.at_level(logging.DEBUG, logger="asyncfeed"):
        with AsyncLoader(ds, batch_size=16, num_threads=1, prefetch=4) as al:
            ds.loader = al
            got = []
            for batch in al:  # a slow consumer: the thread runs ahead, and batch 1
                got.append(batch)  # is taken (and batch 5 planned) while the slow task
                # runs: from about 0.07 s to 0.67 s (later on a loaded machine; a
                # consumer sleeping 50 ms after every batch took batch 1 before the
                # slow row began on a loaded CI run, and never tried to fork in it)
                time.sleep(0.3 if len(got) == 1 else 0.01)
            why = al.stats().execution
    ds.loader = None
    assert "did not go quiet" in caplog.text
    assert (why.mode, why.count) == (Mode.PROCESSES, 2), str(why)
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))


def test_queued_batches_go_to_the_stage_whole_and_into_shared_memory(monkeypatch):
    """Batches queued for the threads when the stage takes over go to the workers
    in the stage's task sizes, written into shared memory (not one thread-sized
    task at a time, each woken in a thread and pickled back)."""
    from support.datasets import SwitchAtRow
    sent: list[tuple[int, int, int, str | None]] = []
    moved: list[int] = []
    real_submit, real_take = processes.ProcessStage.submit, handover.take_over_queued

    def spy(self, p, b, lo, hi, path):
        ok = real_submit(self, p, b, lo, hi, path)
        if ok:
            sent.append((b.k, lo, hi, path))
        return ok

    def spy_take(p, stage):
        n = real_take(p, stage)
        moved.append(n)
        return n

    monkeypatch.setattr(processes.ProcessStage, "submit", spy)
    monkeypatch.setattr(handover, "take_over_queued", spy_take)
    bs = 8
    ds = SwitchAtRow(12 * bs, trigger=bs + 2)  # in batch 1: batches 2-4 are queued then
    with AsyncLoader(ds, batch_size=bs, num_threads=1, prefetch=4,
                     multiprocessing_context="spawn") as al:
        ds.loader = al
        got = list(al)
        ex = al.stats().execution
        assert (ex.mode, ex.count) == (Mode.PROCESSES, 2), str(ex)
    ds.loader = None
    assert_same_batches(got, list(DataLoader(ds, batch_size=bs)))
    assert moved == [3 * bs], moved  # batches 2, 3 and 4, none of them started
    ks = sorted({k for k, _, _, _ in sent})
    assert ks == list(range(2, 12)), ks  # batch 1 stays with its thread
    assert all(path is not None for *_, path in sent), sent  # all in shared memory
    for k in ks:  # each batch in runs that cover it once
        spans = sorted((lo, hi) for kk, lo, hi, _ in sent if kk == k)
        assert spans[0][0] == 0 and spans[-1][1] == bs
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (k, spans)


def test_a_stage_started_in_the_first_batch_gets_the_next_batches_at_once(monkeypatch):
    """Once the stage runs and the layout is known, the batches after the first are
    planned before the first is taken (the workers do not wait for the consumer
    to take it), and they go to shared memory."""
    from support.datasets import SwitchAtRow
    sent: list[tuple[int, int, str | None]] = []   # (batch, batches taken then, path)
    real = processes.ProcessStage.submit

    def spy(self, p, b, lo, hi, path):
        ok = real(self, p, b, lo, hi, path)
        if ok:
            sent.append((b.k, p.taken, path))
        return ok

    monkeypatch.setattr(processes.ProcessStage, "submit", spy)
    planned: dict[int, tuple[int, bool]] = {}  # batch -> (batches taken then, stage running)
    real_plan = Pipeline._submit

    def plan_spy(self, b):
        planned[b.k] = (self.taken, self.stage is not None)
        return real_plan(self, b)

    monkeypatch.setattr(Pipeline, "_submit", plan_spy)
    bs = 8
    ds = SwitchAtRow(10 * bs, trigger=4)  # in batch 0, after its first rows
    # two threads: one-row tasks, so the layout is known from the first row on
    with AsyncLoader(ds, batch_size=bs, num_threads=2, prefetch=4,
                     multiprocessing_context="spawn") as al:
        ds.loader = al
        got = list(al)
    ds.loader = None
    assert_same_batches(got, list(DataLoader(ds, batch_size=bs)))
    # batch 0's rows still queued for the threads when the stage started go to it
    # too (taken over, pickled: that batch's buffers are not in shared memory)
    assert all(path is None for k, _, path in sent if k == 0), sent
    # prefetch 4: batch 0 and three more planned before the first is taken (the layout
    # is known from the first row), under the threads or the stage, whichever ran then
    assert [k for k, (taken, _) in sorted(planned.items()) if taken == 0] == [0, 1, 2, 3], planned
    # batches planned with the stage running go to shared memory
    assert any(running for _, running in planned.values()), planned
    assert all(path is not None for k, _, path in sent if k >= 1 and planned[k][1]), sent
