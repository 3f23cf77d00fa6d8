"""Starting the process stage mid-pass: when, how fast, and safely.

The tuner's one-window rules (``Tuner.sized`` then ``record``) decide; the
consumer starts the stage as soon as it waits (``call_waiting``); row tasks
queued for the threads move to the stage; the fork happens with no decode
thread inside user code (``TaskPool.quiet``); a forked child never runs its
parent's exit hooks; a worker whose loader's process is killed exits.
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
import pytest
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader
from asyncfeed._engine import processes
from asyncfeed._engine.autotune import MIN_TASKS, WINDOW_S, Gate, Tuner, read_machine_idle
from asyncfeed._engine.exithooks import OpenSet
from asyncfeed._engine.pipeline import SIZING_TASKS, TINY_ROW_CPU_S, Pipeline
from asyncfeed._engine.taskpool import TaskPool
from support.datasets import Spin
from support.oracle import TupleFixed, assert_same_batches


# ------------------------------------------------------------- the tuner's rules
_T0 = 0.0  # set per test: after any change start_with makes (it reads the real clock)


@pytest.fixture(autouse=True)
def _clock_base():
    global _T0
    _T0 = time.perf_counter() + 100.0


#: a task's wall time in the one-window tests: a window opens where its first task
#: began, so one task of exactly WINDOW_S spans WINDOW_S, which rounding can make
#: shorter (then no window closes)
_W = WINDOW_S * 1.005


def _clock() -> list[float]:
    return [0.0, 0.0]  # (machine idle, machine total)


def _feed(t: Tuner, windows: int, rows: int, wall: float, cpu: float, tasks: int,
          delay: list[float] | None = None, queued: float = 0.0,
          waits: list[float] | None = None, wait_share: float = 0.0,
          machine: list[float] | None = None, idle_cores: float = 0.0,
          cores: int = 2) -> None:
    """``windows`` windows, each of ``tasks`` tasks side by side lasting ``wall`` with
    ``cpu`` each; the readings the tuner takes move as told (run-queue delay per
    task, the consumer's waiting share, the machine's idle cores).  At least one
    window must close (else the rules were never asked: a test that cannot fail)."""
    closed: list[int] = []
    decide = t._decide

    def spy(*args: object) -> None:
        closed.append(1)
        decide(*args)  # type: ignore[arg-type]

    t._decide = spy  # type: ignore[method-assign]
    clock = _T0 + 1.0
    step = WINDOW_S * 1.01
    for _ in range(windows):
        clock += step
        for _ in range(tasks):
            if delay is not None:
                delay[0] += queued * step
            t.record(rows, wall, cpu, now=clock)
        if waits is not None:
            waits[0] += wait_share * step
        if machine is not None:
            machine[0] += idle_cores * step
            machine[1] += cores * step
    del t._decide
    assert closed, "no window closed"


def _tuner(machine: list[float]) -> Tuner:
    return Tuner(size=4, cores=2, adaptive=True,
                 machine_idle=lambda: (machine[0], machine[1]))


def test_gil_now_decides_from_one_window_after_the_rows_were_measured_alone():
    machine, delay = _clock(), [0.0]
    t = _tuner(machine)
    t.gate_for_pass(run_delay=lambda: delay[0])
    t.sized(4e-3, 0.98, now=_T0 + 1.0)
    # four threads, 1.2 cores busy, 70% of their time neither on a core nor queued
    _feed(t, 1, rows=2, wall=_W, cpu=0.3 * _W, tasks=4, delay=delay,
          machine=machine, idle_cores=0.8)
    assert t.processes_why is not None and "waiting for the GIL" in t.processes_why
    assert "with 4 threads" in t.processes_why


@pytest.mark.parametrize("case", ["gil-free", "io-alone", "queued-for-cores", "cheap",
                                  "not-sized"])
def test_gil_now_is_not_fooled(case):
    """One window (the probe-based rules need two and more): only the one-window
    rule could decide, and here it must not."""
    machine, delay = _clock(), [0.0]
    t = _tuner(machine)
    t.gate_for_pass(run_delay=lambda: delay[0])
    if case != "not-sized":
        t.sized(5e-5 if case == "cheap" else 4e-3, 0.3 if case == "io-alone" else 0.98,
                now=_T0 + 1.0)
    cpu, queued = 0.3 * _W, 0.0                  # the GIL's figures...
    if case == "gil-free":                        # ... but two cores busy
        cpu, queued = 0.5 * _W, 0.5
    elif case == "queued-for-cores":              # ... but off-core time is run queue
        queued = 0.7
    # unsized, a pass's first window warms up and only the second counts
    _feed(t, 2 if case == "not-sized" else 1, rows=2, wall=_W, cpu=cpu, tasks=4,
          delay=delay, queued=queued, machine=machine, idle_cores=0.8)
    assert t.processes_why is None, t.processes_why


@pytest.mark.parametrize("used,gil,held,expect", [
    (0.65, 0.20, 0.30, True),    # workload (c): few cores busy, both signs weak but there
    (1.10, 0.00, 0.43, True),    # (c) with a wait share that read nothing
    (1.49, 0.16, 0.29, False),   # workload (a): GIL-free decoder, 1.5 cores busy
    (1.31, 0.14, 0.06, False),   # workload (g): a little over the cores share
    (0.90, 0.10, 0.10, False),   # few cores busy, yet neither sign: not the GIL
    # GIL-free decoding in a fresh process beside other load (bench runs, 2026-12-02):
    # the threads off a core, but the probe found the GIL free
    (0.87, 0.26, 0.12, False),   # workload (a)
    (1.16, 0.41, 0.13, False),   # workload (g)
])
def test_gil_now_from_low_use_and_both_signs(used, gil, held, expect):
    """Four CPU-bound threads on two cores: the third one-window rule reads the
    cores they keep busy with the sum of the GIL wait share and the probe's."""
    machine, delay, probe = _clock(), [0.0], [0, 0]
    t = _tuner(machine)
    t.gate_for_pass(run_delay=lambda: delay[0], gil_held=lambda: (probe[0], probe[1]))
    t.sized(4e-3, 0.98, now=_T0 + 1.0)
    probe[:] = [round(held * 20), 20]
    # the window closes at its MIN_TASKS-th task and spans the first one's wall
    # time; its run-queue reading starts at the first task: the others' delay counts
    k, step = MIN_TASKS, WINDOW_S * 1.01
    cpu = used * _W / k
    queued = k * (_W - cpu - gil * _W) / ((k - 1) * step)
    _feed(t, 1, rows=2, wall=_W, cpu=cpu, tasks=k, delay=delay, queued=queued,
          machine=machine, idle_cores=0.8)
    assert (t.processes_why is not None) is expect, t.processes_why
    if expect:
        assert f"{used:.2f} cores busy" in t.processes_why
        assert "GIL held" in t.processes_why and "waiting for the GIL" in t.processes_why


@pytest.mark.parametrize("row_cpu,wait_share,idle_cores,expect", [
    (3e-5, 0.9, 1.0, True),     # CIFAR-like: the consumer waits, a core is idle
    (3e-5, 0.1, 1.0, False),    # the model is slower than one thread: stay
    (3e-5, 0.9, 0.2, False),    # no idle core to run a worker on
    (2e-6, 0.9, 1.0, False),    # a no-op sample: collecting it would cost more
])
def test_tiny_rows_go_to_processes_only_where_workers_can_win(row_cpu, wait_share,
                                                               idle_cores, expect):
    machine, waits = _clock(), [0.0]
    t = _tuner(machine)
    t.gate_for_pass(run_delay=lambda: 0.0, consumer_wait=lambda: waits[0])
    t.start_with(1, "tiny: the test starts on one", hold=16)
    t.sized(row_cpu, 1.0, now=_T0 + 1.0)
    _feed(t, 3, rows=100, wall=WINDOW_S / 3, cpu=0.9 * WINDOW_S / 3, tasks=3,
          waits=waits, wait_share=wait_share, machine=machine, idle_cores=idle_cores)
    assert (t.processes_why is not None) is expect, t.processes_why
    if expect:
        assert t.processes_why.startswith("tiny rows:")


# ------------------------------------------------------------ quiet, at-fork
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
    there) marks the tuner as the GIL rule would."""

    def __init__(self, n: int, trigger: int) -> None:
        self.n, self.trigger = n, trigger
        self.loader: AsyncLoader | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if os.getpid() == _PARENT and self.loader is not None:
            if i == self.trigger:
                self.loader._tuner.processes_why = "gil: set by the test"
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
        assert al.stats().execution.startswith("processes: 2 workers (gil: set by the test")
    ds.loader = None
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))
    assert None in sent, "no queued row task went to the stage (pickled back)"
    assert any(p is not None for p in sent), "later batches did not use shared memory"


def test_tiny_rows_switch_to_processes_by_themselves_with_dataloaders_batches():
    """A CIFAR-like set (rows of tens of microseconds, the GIL held) and a consumer
    that only waits: the default loader moves to worker processes on its own,
    and its batches are DataLoader's."""

    class Cifar:
        def __init__(self, n: int) -> None:
            self.x = np.random.default_rng(0).integers(0, 256, (n, 32, 32, 3), np.uint8)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):
            img = np.pad(self.x[i], ((4, 4), (4, 4), (0, 0)))
            for _ in range(3):  # ~ a numpy augmentation's cost, deterministic
                img = np.ascontiguousarray(img[::-1])
            return np.ascontiguousarray(img[i % 9:i % 9 + 32, :32].transpose(2, 0, 1)), i % 10

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: worker processes cannot win")
    ds = Cifar(30_000)
    machine0, mine0, t0 = read_machine_idle(), _own_cpu(), time.monotonic()
    with AsyncLoader(ds, batch_size=128) as al:
        got = list(al)
        why = al.stats().execution
    machine1, mine1, elapsed = read_machine_idle(), _own_cpu(), time.monotonic() - t0
    assert_same_batches(got, list(DataLoader(ds, batch_size=128)))
    # where other processes kept the cores busy during the run, the idle-core rule
    # rightly keeps it on threads: their CPU is the machine's busy time less ours
    others = None
    if machine0 is not None and machine1 is not None:
        idle, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        cores = os.cpu_count() or 1
        others = (1 - idle / total) * cores - (mine1 - mine0) / elapsed
    # the tiny-row rule decides, or, where the first rows, cold, cost more than
    # PROCESS_MIN_ROW_S measured alone, a GIL verdict (they hold it): the pair
    # measure's, or, where the pair could not ask the GIL probe, a window's
    assert why.startswith(("processes: 2 workers (tiny rows:",
                           "processes: 2 workers (gil: ")) or \
        (others is not None and others > 0.3), (why, others)


def _own_cpu() -> float:
    """CPU seconds of this process and its reaped children."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


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
    files = [f"{group}-0", f"{group}-{processes.LEASE}"]
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
        leases = glob.glob(f"/dev/shm/asyncfeed-{os.getpid()}-*-{processes.LEASE}")
        assert len(leases) == 1 and not processes._lease_free(leases[0])
        processes.remove_segments()  # a sweep by another stage spares it
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


def test_rows_that_cost_nothing_are_loaded_by_the_waiting_consumer():
    ds = _Noop(3000)
    ran_in: set[str] = set()
    real = _Noop.__getitem__

    def spy(self, i):
        ran_in.add(threading.current_thread().name)
        return real(self, i)

    with AsyncLoader(ds, batch_size=64, shuffle=True,
                     generator=torch_generator(3)) as al:
        _Noop.__getitem__ = spy  # type: ignore[method-assign]
        try:
            first = list(al)
            ran_in.clear()
            second = list(al)  # the next pass starts inline
        finally:
            _Noop.__getitem__ = real  # type: ignore[method-assign]
        why = al.stats().execution
    assert why.startswith("threads: none running, the consumer loads while it waits"), why
    assert ran_in == {threading.current_thread().name}, ran_in
    g = torch_generator(3)
    want = list(DataLoader(ds, batch_size=64, shuffle=True, generator=g))
    assert_same_batches(first, want)
    assert_same_batches(second, list(DataLoader(ds, batch_size=64, shuffle=True, generator=g)))


def _sizing_reads(monkeypatch, ds, batch_size: int) -> list[int]:
    """The rows of each task the first pass of a fresh loader over ``ds`` counted
    in its sizing (``Pipeline.sized`` while the sizing is open)."""
    rows: list[int] = []
    real = Pipeline.sized

    def sized(self, n, wall, cpu):
        if self.sizing is not None:
            rows.append(n)
        return real(self, n, wall, cpu)

    monkeypatch.setattr(Pipeline, "sized", sized)
    with AsyncLoader(ds, batch_size=batch_size) as al:
        assert_same_batches(list(al), list(DataLoader(ds, batch_size=batch_size)))
    return rows


def test_cheap_rows_are_sized_by_a_task_of_many_rows_too(monkeypatch):
    """Two one-row tasks read mostly cold code on cheap rows (a no-op row 5-8 us,
    2 us once warm): their sizing waits for the next task, of many rows."""
    rows = _sizing_reads(monkeypatch, _Noop(640), 64)
    assert rows[:SIZING_TASKS] == [1] * SIZING_TASKS and len(rows) == SIZING_TASKS + 1, rows
    assert rows[-1] > 1, rows


def test_dear_rows_are_sized_by_their_one_row_tasks(monkeypatch):
    """Rows dearer than ``TINY_ROW_CPU_S`` (here 2 ms): two one-row tasks decide, no
    row-heavy task runs alone before the threads go."""
    assert TINY_ROW_CPU_S < 2e-3
    rows = _sizing_reads(monkeypatch, Spin(64, 2000), 16)
    assert rows == [1] * SIZING_TASKS, rows


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
    monkeypatch.setattr(processes, "QUIET_S", 0.1)
    monkeypatch.setattr(processes, "QUIET_RETRY_S", 0.2)
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
    assert why.startswith("processes: 2 workers (gil: set by the test"), why
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))


def test_the_gil_probe_wakes_often_only_while_the_first_windows_may_decide():
    from asyncfeed._engine.gilprobe import FAST_FOR_S
    ds = _Noop(256)
    with AsyncLoader(ds, batch_size=32) as fresh, \
            AsyncLoader(ds, batch_size=32, num_threads=2) as pinned:
        it = iter(fresh)
        assert it._p.acct.probe.fast_for == FAST_FOR_S
        list(it)  # decides: these rows cost nothing (the consumer loads them)
        again = iter(fresh)
        assert again._p.acct.probe.fast_for == 0.0
        list(again)
        it2 = iter(pinned)
        assert it2._p.acct.probe.fast_for == 0.0
        list(it2)


def test_queued_batches_go_to_the_stage_whole_and_into_shared_memory(monkeypatch):
    """Batches queued for the threads when the stage takes over go to the workers
    in the stage's task sizes, written into shared memory (not one thread-sized
    task at a time, each woken in a thread and pickled back)."""
    from support.datasets import SwitchAtRow
    sent: list[tuple[int, int, int, str | None]] = []
    moved: list[int] = []
    real_submit, real_take = processes.ProcessStage.submit, processes.take_over_queued

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
    monkeypatch.setattr(processes, "take_over_queued", spy_take)
    bs = 8
    ds = SwitchAtRow(12 * bs, trigger=bs + 2)  # in batch 1: batches 2-4 are queued then
    with AsyncLoader(ds, batch_size=bs, num_threads=1, prefetch=4,
                     multiprocessing_context="spawn") as al:
        ds.loader = al
        got = list(al)
        assert al.stats().execution.startswith("processes: 2 workers (gil: set by the test")
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
    early = sorted({k for k, taken, _ in sent if taken == 0 and k > 0})
    assert early == [1, 2, 3], sent   # prefetch 4: batch 0 and three more
    assert all(path is not None for k, _, path in sent if k >= 1), sent
