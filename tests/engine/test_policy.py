"""The execution policy: a pure function from recorded window readings to a decision.

Every test builds a record of windows (candidate, rows, seconds) and asks
``policy.decide``; nothing is timed.  The rates model what a kind of per-sample
function does under each candidate, on 1, 2, 16 and 96 cores, with the spread
between like windows that a noisy machine shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable

import pytest

from asyncfeed._engine.chooser import Chooser
from asyncfeed._engine.policy import (INLINE, Candidate, Decision, Handoff, Mode, PolicyConfig,
                                      Reason, Record, Space, Window, decide, drifted, judge,
                                      processes, threads)

CFG = PolicyConfig()


def space(cores: int, pool: int | None = None, workers: int | None = None,
          inline: bool = True, with_processes: bool = True) -> Space:
    pool = pool if pool is not None else cores + min(2, cores)
    return Space(ladder=Space.thread_ladder(cores, pool), start=threads(min(cores, pool)),
                 cores=cores, inline=inline,
                 process=processes(workers or cores) if with_processes else None)


def run(sp: Space, rate, noise: float = 0.0, seed: int = 0, limit: int = 400,
        record: Record | None = None,
        core_rate: float | Callable[[Candidate], float] = 0.0, other_cores: float = 0.0,
        cpu_skew: float = 0.0, worker_cores: Callable[[Candidate], float] | None = None,
        loader_cores: float = 0.0) -> tuple[Record, list[Candidate]]:
    """Drive ``decide`` as the chooser does: each window runs the candidate it asks
    for, at ``rate(candidate)`` rows/s times a noise factor, until settled.  With
    ``core_rate`` (rows/s, or a function of the candidate), thread and inline
    windows read the CPU their rows took at that many rows per CPU second; with
    ``other_cores`` too, the whole process took
    that many cores more (the consumer's own work).  ``cpu_skew``: a thread candidate's
    windows read their rows' CPU that much high, then low, in turn (some windows
    draw the dearer samples).  ``worker_cores``: the cores a process candidate's
    workers keep busy (their windows read that CPU per second); ``loader_cores``:
    the cores the loader's own process keeps busy meanwhile."""
    rnd = random.Random(seed)
    rec = record if record is not None else Record()
    ran = []
    for _ in range(limit):
        d = decide(rec, sp)
        if d.settled:
            return rec, ran
        c = d.run
        ran.append(c)
        r = rate(c) * (1 + rnd.uniform(-noise, noise))
        # the consumer waits for what the loader does not deliver at its own pace
        pace = getattr(rate, "consumer", None)
        waited = 0.1 * (1 - r / pace) if pace and r < pace else (0.0 if pace else 0.05)
        rows = max(1, round(r * 0.1))
        per_core = core_rate(c) if callable(core_rate) else core_rate
        cpu = rows / per_core if per_core and c.mode is not Mode.PROCESSES else 0.0
        nth = sum(w.candidate == c for w in rec.windows)
        cpu *= 1 + (-cpu_skew if nth % 2 else cpu_skew)
        pcpu = cpu + other_cores * 0.1 if cpu and other_cores else 0.0
        wcpu = worker_cores(c) * 0.1 if worker_cores and c.mode is Mode.PROCESSES else 0.0
        if c.mode is Mode.PROCESSES and loader_cores:
            pcpu = loader_cores * 0.1
        rec.windows.append(Window(c, rows, 0.1, waited, cpu, pcpu, wcpu))
    raise AssertionError(f"not settled after {limit} windows: {ran[-12:]}")


# per-sample functions, as rows/s per candidate (c: cores)
def gil_free(c: int):
    """GIL-free decoding: threads scale to the cores; processes as well, less IPC."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 900.0
        if x.mode is Mode.THREADS:
            return 1000.0 * min(x.count, c) * 0.97
        return 1000.0 * min(x.count, c) * 0.93
    return rate


def gil_bound(c: int):
    """Pure Python: one thread's worth however many threads; processes scale."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 1020.0
        if x.mode is Mode.THREADS:
            return 1000.0 - 30.0 * (x.count - 1)
        return 1000.0 * min(x.count, c) * 0.9
    return rate


def _contended(inline: float, one_thread: float, procs: float):
    """Rows whose threads contend: ``n`` threads read one thread's rate over
    ``1 + 0.2 (n - 1)``; inline and processes read as given."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return inline
        if x.mode is Mode.THREADS:
            return one_thread / (1 + 0.2 * (x.count - 1))
        return procs
    return rate


def tiny(c: int):
    """Rows of tens of microseconds: every hand-off costs more than the row."""
    return _contended(12_000.0, 9_000.0, 7_000.0)


def consumer_bound(c: int):
    """The training step takes the time: every candidate but inline keeps up;
    inline adds its loading to the step."""
    def rate(x: Candidate) -> float:
        return 800.0 if x.mode is Mode.INLINE else 1000.0
    rate.consumer = 1000.0  # type: ignore[attr-defined]
    return rate


def io_bound(c: int):
    """Rows that wait on storage: more threads keep more reads in flight."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 200.0
        if x.mode is Mode.THREADS:
            return 200.0 * x.count
        return 200.0 * x.count
    return rate


def humped(x: Candidate) -> float:
    """Rows that scale to four threads, then slow down (contention); processes
    slower still."""
    if x.mode is Mode.INLINE:
        return 900.0
    if x.mode is Mode.THREADS:
        return {1: 1000.0, 2: 1500.0, 4: 1900.0}.get(x.count, 1200.0)
    return 800.0


# ------------------------------------------------------------------ outcomes
@pytest.mark.parametrize("cores", [2, 16, 96])
@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_gil_free_rows_stay_on_threads_at_the_cores(cores, noise):
    rec, _ = run(space(cores), gil_free(cores), noise)
    d = decide(rec, space(cores))
    assert d.choice == threads(cores), d
    assert d.processes_skipped is Reason.NO_ROOM  # the bound: no fork to find out


@pytest.mark.parametrize("cores", [2, 16, 96])
@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_gil_bound_rows_go_to_processes(cores, noise):
    rec, _ = run(space(cores), gil_bound(cores), noise)
    d = decide(rec, space(cores))
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_tiny_rows_are_loaded_inline(cores):
    rec, _ = run(space(cores), tiny(cores))
    assert decide(rec, space(cores)).choice == INLINE


@pytest.mark.parametrize("cores", [2, 16])
def test_a_consumer_that_is_the_bottleneck_gets_the_cheapest_candidate_that_keeps_up(cores):
    rec, _ = run(space(cores), consumer_bound(cores))
    d = decide(rec, space(cores))
    assert d.choice == threads(1) and d.reason is Reason.FASTER, d  # it beat inline
    assert not any(w.candidate.mode is Mode.PROCESSES for w in rec.windows)
    assert d.processes_skipped is Reason.CONSUMER


# ------------------------------------------------------------------ the order of the search
def _first_processes(ran: list[Candidate]) -> int:
    return next(i for i, c in enumerate(ran) if c.mode is Mode.PROCESSES)


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_threads_that_ran_the_rows_one_at_a_time_duel_processes_first(cores):
    """Pure Python whose windows show it: the start's threads took one core between
    them while the process was busy.  Processes are dueled before one thread runs
    a window, and win; the old order's choice, in fewer windows."""
    sp = space(cores)
    # the rows' CPU plus the rest of the process (the GIL's hand-offs, the consumer):
    # one core or a little more, however many threads
    other = 1.05 - gil_bound(cores)(sp.start) / 1000.0 + 0.05
    rec, ran = run(sp, gil_bound(cores), 0.02, core_rate=1000.0, other_cores=other)
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d
    assert threads(1) not in ran[:_first_processes(ran)], ran
    assert (d.duels[0].cheap, d.duels[0].dear) == (threads(cores), processes(cores))
    assert d.inline_skipped is Reason.NO_ROOM and d.processes_first
    # the same readings without the CPU: the search in its usual order gets there too
    rec2, ran2 = run(sp, gil_bound(cores), 0.02)
    assert decide(rec2, sp).choice == processes(cores) and not decide(rec2, sp).processes_first
    assert threads(1) in ran2[:_first_processes(ran2)] and len(ran) < len(ran2)


def tiny_serialised(x: Candidate) -> float:
    """Rows of tens of microseconds with a Python collate: threads take turns at the
    GIL (one core between them, each row dearer for the turns), worker processes
    pay the hand-off, inline pays neither."""
    if x.mode is Mode.INLINE:
        return 16_000.0
    return 4_800.0 if x.mode is Mode.THREADS else 7_000.0


@pytest.mark.parametrize("worker_rows_per_cpu_s", [16_000.0, 3_500.0])
def test_inline_is_skipped_by_the_one_core_bound_only_where_workers_read_it_too(
        worker_rows_per_cpu_s):
    """Processes win against threads that ran the rows one at a time.  Threads that
    took turns at the GIL read each row's CPU high; a worker runs its rows alone.
    Where the workers read 16,000 rows per CPU second, processes' 7,000 rows/s are
    within one core's rate: inline is dueled, and wins.  Where the workers read
    3,500 (the rows are that dear), processes run beyond one core: inline is
    skipped."""
    sp = space(2)
    rec, ran = run(sp, tiny_serialised, core_rate=4_800.0, other_cores=0.05,
                   worker_cores=lambda x: 7_000.0 / worker_rows_per_cpu_s)
    d = decide(rec, sp)
    assert d.processes_first, d
    if worker_rows_per_cpu_s > 7_000.0:
        assert INLINE in ran and d.choice == INLINE and d.inline_skipped is None, d
    else:
        assert INLINE not in ran and d.inline_skipped is Reason.NO_ROOM, d
        assert d.choice.mode is Mode.PROCESSES, d


@pytest.mark.parametrize("pickle_s", [0.0, 150e-6])
def test_the_one_core_bound_leaves_out_the_pickling_of_the_rows_workers_send_back(pickle_s):
    """Workers that send their rows back pickled (a custom ``collate_fn``) spend CPU
    on each row that inline never does: ``Record.handoff``, measured on the pass's
    rows.  Here the workers read 3,500 rows per CPU second; with rows written in
    place that is the rows' own cost, so processes' 7,000 rows/s are beyond one
    core and inline is skipped.  Where 150 us of each row's 286 us is pickling, the
    rows' own cost is 136 us (7,350 rows per CPU second): processes are within one
    core's rate of them, so inline is dueled, and wins."""
    sp = space(2)
    rec, ran = run(sp, tiny_serialised, core_rate=4_800.0, other_cores=0.05,
                   worker_cores=lambda x: 7_000.0 / 3_500.0,
                   record=Record(handoff=Handoff(pickle_s, 1e-6)))
    d = decide(rec, sp)
    assert d.processes_first, d
    if pickle_s:
        assert INLINE in ran and d.choice == INLINE and d.inline_skipped is None, d
    else:
        assert INLINE not in ran and d.inline_skipped is Reason.NO_ROOM, d
        assert d.choice.mode is Mode.PROCESSES, d


@pytest.mark.parametrize("cores", [2, 16])
def test_threads_that_used_their_cores_keep_the_order(cores):
    """GIL-free rows: the start's threads took every core; one thread's duel comes
    first, and processes are never forked (their bound)."""
    sp = space(cores)
    rec, ran = run(sp, gil_free(cores), 0.02, core_rate=1000.0, other_cores=0.1)
    assert ran[:2] == [threads(cores), threads(1)], ran
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.processes_skipped is Reason.NO_ROOM, d
    assert not d.processes_first


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_threads_side_by_side_that_take_every_core_leave_processes_no_room(cores):
    """GIL-free rows whose cores slow each other (shared caches and memory): one
    thread alone runs 1,000 rows/s at a core, the threads at the cores 0.8 of that
    per core, and take every core.  One thread's rate times the cores would leave
    processes room; the rows' rate per core side by side does not: no fork, and
    no more threads."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 900.0
        if x.mode is Mode.THREADS:
            return 1000.0 if x.count == 1 else 800.0 * min(x.count, cores)
        return 780.0 * cores
    def per_core(x: Candidate) -> float:
        return 1000.0 if x.count == 1 else 800.0
    sp = space(cores)
    rec, ran = run(sp, rate, core_rate=per_core, other_cores=0.02)
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.processes_skipped is Reason.NO_ROOM, d
    assert d.threads_skipped is Reason.NO_ROOM, d
    assert all(c.mode is Mode.THREADS and c.count <= cores for c in ran), ran
    # the same rates where the threads' rows read one core's rate each: room, and
    # the processes duel runs (and loses)
    rec, ran = run(sp, rate, core_rate=lambda x: 1000.0 * min(x.count, cores) / x.count
                   if x.count > 1 else 1000.0, other_cores=0.02)
    d = decide(rec, sp)
    assert processes(cores) in ran and d.choice == threads(cores), (d, ran)


def test_rows_that_wait_keep_the_order():
    """Rows that wait on storage use little CPU, and so does the whole process: not
    threads that ran one at a time, whatever the rows' own CPU reads."""
    sp = space(2, pool=4)
    rec, ran = run(sp, io_bound(2), 0.0, core_rate=20_000.0, other_cores=0.01)
    assert ran[:2] == [threads(2), threads(1)], ran
    assert decide(rec, sp).choice == threads(4)


def partly_gil(c: int, procs: float | None = None):
    """Rows that hold the GIL about half their time (a GIL-free decode, then Python):
    two threads or more read 1.4x one thread, those past the cores a little less;
    processes scale with the cores (or read ``procs``: their hand-off costs)."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 290.0
        if x.mode is Mode.THREADS:
            return (420.0 if x.count > 1 else 300.0) - 5.0 * max(0, x.count - c)
        return procs if procs is not None else 300.0 * min(x.count, c) * 0.95
    return rate


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_rows_one_thread_ran_without_waiting_duel_processes_before_more_threads(cores):
    """One thread's rows took a core (they never waited), and threads past the
    start cannot be more than the cores: processes are dueled before more threads
    than the cores run a window, and win.  On more cores, where the start's threads
    read far short of their count times one thread, processes come earlier still:
    before fewer threads."""
    sp = space(cores)
    rec, ran = run(sp, partly_gil(cores), core_rate=300.0)
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d
    assert (d.processes_before_up, d.processes_before_down) == (cores == 2, cores > 2), d
    assert not d.processes_first, d
    assert all(c.count <= cores for c in ran if c.mode is Mode.THREADS), ran


def gil_overlapped(c: int):
    """Pure Python whose threads overlap only the hand-offs: any count of two or
    more reads 1.2x one thread (a real 16-core run read 634 rows/s on one thread,
    582 to 788 on 2 to 16); processes scale with the cores."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 650.0
        if x.mode is Mode.THREADS:
            return 760.0 if x.count > 1 else 640.0
        return 640.0 * min(x.count, c) * 0.9
    return rate


@pytest.mark.parametrize("cores", [4, 16, 96])
@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_threads_that_beat_one_thread_short_of_their_count_duel_processes_before_fewer(
        cores, noise):
    """The start beat one thread, but by far less than its count of threads: fewer
    threads could only match it at a lower cost, processes could go faster, so they
    are dueled before the walk down the ladder, and win; no count between one
    thread and the start runs a window."""
    sp = space(cores)
    rec, ran = run(sp, gil_overlapped(cores), noise, core_rate=640.0)
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d
    assert d.processes_before_down and not d.processes_before_up, d
    assert {c.count for c in ran if c.mode is Mode.THREADS} == {1, cores}, ran
    assert "processes tried before fewer threads" in str(_report_of(rec, sp))


def test_threads_that_scale_to_their_count_walk_down_before_processes():
    """Threads that beat one thread by their count keep the order: a walk down
    (which finds the cheapest count as fast) comes before processes."""
    sp = space(16)
    rec, ran = run(sp, gil_free(16), 0.02, core_rate=1000.0)
    d = decide(rec, sp)
    assert not d.processes_before_down and d.choice == threads(16), d
    assert threads(8) in ran, ran


def test_processes_that_lose_before_fewer_threads_leave_the_walk_down_to_go_on():
    """Threads that peak at four (contention past them): the start beat one thread
    short of its count, processes are dueled first and lose, and the walk down
    still finds four threads."""
    sp = space(16, pool=18)
    rec, ran = run(sp, humped, 0.02, core_rate=1000.0)
    d = decide(rec, sp)
    assert d.choice == threads(4) and d.processes_before_down, d
    assert _first_processes(ran) < ran.index(threads(8)), ran


def barely_scaling(procs: float):
    """Rows whose threads read a little above one thread, whatever their count, their
    windows 10% apart in turn (1,120 and 1,020 rows/s; one thread 1,000): a lead
    inside twice their margin, so the bottom duel cannot tell the two apart in one
    round, nor in more; processes read ``procs``; inline reads 800, clearly behind
    one thread in its one round."""
    turns: dict[Candidate, int] = {}

    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 800.0
        if x.mode is Mode.THREADS and x.count > 1:
            turns[x] = turns.get(x, 0) + 1
            return 1120.0 if turns[x] % 2 else 1020.0
        return 1000.0 if x.mode is Mode.THREADS else procs
    return rate


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_an_open_bottom_duel_of_threads_short_of_scaling_waits_for_processes(cores):
    """The start reads a little above one thread, in the band where the bottom duel
    would run another round: neither reading lets the threads scale, so processes
    are dueled after the first round, and win; one thread runs no more than that
    round's windows."""
    sp = space(cores)
    rec, ran = run(sp, barely_scaling(900.0 * cores))
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d
    assert d.processes_before_down, d
    assert ran.count(threads(1)) == CFG.like_windows, ran
    assert _first_processes(ran) == 2 * CFG.like_windows, ran


def test_an_open_bottom_duel_goes_on_where_processes_lose():
    """The same rows where processes read below the threads: the bottom duel goes
    on from the windows it had, for the rounds it had left, and is judged on all
    of them, as without processes between its rounds: one thread stays."""
    sp = space(2)
    rec, ran = run(sp, barely_scaling(900.0))
    d = decide(rec, sp)
    bottom = next(u for u in d.duels if {u.cheap, u.dear} == {threads(1), threads(2)})
    assert d.duels.index(bottom) == 1 and d.duels[0].dear == processes(2), d.duels
    assert bottom.winner == threads(1) and bottom.dear_rate == 1070.0, bottom
    assert ran.count(threads(1)) == CFG.like_windows * CFG.max_rounds, ran
    assert _first_processes(ran) == 2 * CFG.like_windows, ran


def recorded_on_2_cores(windows: list[tuple[int, int, float, float, float, float]]
                        ) -> tuple[Space, Record]:
    """The default space on 2 cores, and a record of thread windows read off a live
    run: (threads, rows, seconds, waited, rows' CPU, the process's CPU)."""
    sp = Space(ladder=(threads(1), threads(2), threads(4)), start=threads(2), cores=2,
               process=processes(2), more_processes=processes(4))
    return sp, Record(windows=[Window(threads(n), rows, secs, waited, cpu, whole)
                               for n, rows, secs, waited, cpu, whole in windows])


def test_an_open_bottom_duels_slow_window_does_not_skip_processes_by_its_margin():
    """The first four windows of a recorded run (64x64 PNGs decoded by Pillow and
    rotated, 2 cores): one thread's second window read two thirds of its first, so
    the bottom duel's margin read 0.41 and the duel stayed open.  Two threads fell
    short of scaling: processes next.  Their bound from the two threads' rows per
    CPU second (2,972 rows/s) is within that margin of the threads' 2,247 rows/s,
    but not within the two threads' own spread (0.14): the margin the open duel
    reads again is not the one the bound is beaten by, and processes are dueled
    (runs beside it on two workers read 3,500-4,600 rows/s)."""
    sp, rec = recorded_on_2_cores([
        (2, 53, 0.02203, 0.02043, 0.03022, 0.03160), (1, 48, 0.02178, 0.02178, 0.02030, 0.02380),
        (2, 48, 0.02299, 0.02299, 0.03283, 0.03805), (1, 36, 0.02477, 0.02433, 0.02316, 0.02448)])
    d = decide(rec, sp)
    assert d.run == processes(2) and d.processes_skipped is None, d
    assert d.processes_before_down and not d.settled, d


def test_one_threads_only_window_that_waited_does_not_bound_processes_alone():
    """A recorded run (the same PNG rows, 2 cores): one thread lost the bottom duel
    after one window, read while the pass's first rows ran (its rows took 0.78 of a
    core, the process 0.83: it waited, as no worker would), and four threads lost.
    Processes' bound from that window (1.96 cores x 1,217 rows/s) was within the
    margin of two threads' 2,520, and they were skipped; the pass ran two threads
    at 2,300-2,400 rows/s where runs beside it on two workers read 3,500-4,600.
    One more window of one thread is read first; one at a core's speed (its rows a
    core busy) leaves processes room, and they are dueled."""
    sp, rec = recorded_on_2_cores([
        (2, 45, 0.02031, 0.02031, 0.03016, 0.02987), (1, 30, 0.02465, 0.02024, 0.01919, 0.02045),
        (2, 57, 0.02474, 0.02449, 0.03570, 0.03629), (2, 52, 0.02021, 0.01949, 0.02768, 0.02879),
        (4, 58, 0.02527, 0.02252, 0.03408, 0.03266), (2, 50, 0.02027, 0.01968, 0.02769, 0.02857)])
    d = decide(rec, sp)
    assert d.run == threads(1) and d.processes_skipped is None and not d.settled, d
    rec.windows.append(Window(threads(1), 40, 0.02500, 0.02400, 0.02450, 0.02500))
    d = decide(rec, sp)
    assert d.run == processes(2) and d.processes_skipped is None, d


def test_one_threads_windows_that_waited_alike_bound_processes():
    """Rows that wait on storage: each of two windows of one thread took a
    twentieth of a core (the rows' own waits, which a worker waits through too):
    two workers cannot beat four threads by running at twice one thread's rate,
    and are skipped after the second window."""
    sp = space(2)
    rec, ran = run(sp, lambda c: 240.0 * c.count if c.mode is Mode.THREADS else
                   (230.0 if c.mode is Mode.INLINE else 480.0), core_rate=5000.0)
    d = decide(rec, sp)
    assert d.choice == threads(4) and d.processes_skipped is Reason.NO_ROOM, d
    assert Mode.PROCESSES not in {c.mode for c in ran} and ran.count(threads(1)) >= 2, ran


def recorded_on_16_cores(windows: list[tuple[int, int, float, float, float, float]]
                         ) -> tuple[Space, Record]:
    """The default space on 16 cores, and a record of thread windows read off a
    live run, as :func:`recorded_on_2_cores`."""
    sp = Space(ladder=tuple(threads(n) for n in (1, 2, 4, 8, 16, 18)), start=threads(16),
               cores=16, process=processes(16), more_processes=processes(32))
    return sp, Record(windows=[Window(threads(n), rows, secs, waited, cpu, whole)
                               for n, rows, secs, waited, cpu, whole in windows])


def test_one_thread_beating_the_start_on_16_cores_duels_processes_before_the_climb():
    """The first four windows of a recorded run on 16 cores (64x64 PNGs decoded by
    Pillow, rotated and flipped): sixteen threads read 1,800 rows/s, one thread
    2,100-2,300.  Threads do not scale past one here; the climb from one thread
    could gain a little (two threads read 1.3x it), processes the cores: they are
    dueled next.  In the usual order the climb took eight more windows first, and
    sixteen workers then read 25,800 rows/s."""
    sp, rec = recorded_on_16_cores([
        (16, 110, 0.06123, 0.06123, 0.08944, 0.09221), (1, 43, 0.02005, 0.01984, 0.01869, 0.01986),
        (16, 140, 0.07923, 0.07527, 0.11066, 0.11215), (1, 41, 0.02004, 0.01977, 0.01848, 0.01980)])
    d = decide(rec, sp)
    assert d.run == processes(16) and d.choice == threads(1) and not d.settled, d
    assert d.processes_before_up and not d.processes_before_down, d


def test_threads_whose_rows_cpu_reads_past_the_process_cpu_ran_them_one_at_a_time():
    """The first window of a recorded run on 16 cores (pure Python rows): sixteen
    threads' tasks that ended in it read 1.08 cores of CPU, beyond one core by more
    than ``min_margin``, while the whole process took 1.02 cores over the window:
    the tasks straddling its ends were counted whole.  The process's own reading
    shows the rows ran one at a time, and processes are dueled first (one thread
    and sixteen workers then read 568 and 8,700 rows/s)."""
    sp, rec = recorded_on_16_cores([(16, 128, 0.19159, 0.19159, 0.20758, 0.19616)])
    d = decide(rec, sp)
    assert d.run == processes(16) and d.processes_first and not d.settled, d


def contended_past_two(c: int, procs: float | None = None):
    """Rows that hold the GIL part of the time, and whose threads contend past two:
    two threads read 1.3x one thread, more read less (sixteen below one thread);
    processes scale with the cores (or read ``procs``: their hand-off costs)."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 280.0
        if x.mode is Mode.THREADS:
            return 300.0 if x.count == 1 else 390.0 / (1 + 0.1 * (x.count - 2))
        return procs if procs is not None else 300.0 * min(x.count, c) * 0.9
    return rate


@pytest.mark.parametrize("cores", [16, 96])
def test_where_one_thread_beats_the_start_processes_come_before_the_climb(cores):
    """One thread beat the start: processes are dueled before the climb from one
    thread, and win; the climb from the one thread they beat is then out of reach
    (two threads at most twice one thread's rows per CPU second), and no thread
    count but the start and one thread runs a window."""
    sp = space(cores)
    rec, ran = run(sp, contended_past_two(cores), core_rate=300.0)
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d
    assert d.processes_before_up and d.threads_skipped is Reason.NO_ROOM, d
    assert {c for c in ran if c.mode is Mode.THREADS} == {threads(1), threads(cores)}, ran
    assert "processes tried before more threads" in str(_report_of(rec, sp))


@pytest.mark.parametrize("procs", [350.0, 250.0])
def test_where_processes_before_the_climb_win_narrowly_or_lose_the_climb_follows(procs):
    """The order changed, not the choice: processes that beat one thread but not
    two threads (350 rows/s: their hand-off) are followed by two threads dueled
    against them, which win, then four, which lose; processes slower than one
    thread (250) are followed by the climb from one thread.  Two threads, as the
    usual order chooses, on 16 cores."""
    sp = space(16)
    rec, ran = run(sp, contended_past_two(16, procs=procs), core_rate=300.0)
    d = decide(rec, sp)
    assert d.choice == threads(2) and d.processes_before_up, d
    assert _first_processes(ran) < ran.index(threads(2)) < ran.index(threads(4)), ran
    assert threads(8) not in ran, ran


def test_a_recheck_of_processes_chosen_before_the_climb_steps_from_processes():
    """Processes won before the climb, and the climb from one thread lost to them
    (these windows know no CPU: no bound skips it).  A re-check steps one rung from
    the choice itself, as any re-check: no thread count is dueled again."""
    sp = space(16)
    rec, ran = run(sp, contended_past_two(16))
    assert decide(rec, sp).choice == processes(16) and threads(2) in ran, ran
    rec.recheck_at.append(len(rec.windows))
    rec, again = run(sp, contended_past_two(16), record=rec)
    assert decide(rec, sp).choice == processes(16), again
    assert not {c for c in again if c.mode is Mode.THREADS}, again


def _report_of(rec: Record, sp: Space):
    ch = Chooser.__new__(Chooser)
    ch.record, ch.decision, ch.detail, ch.thread_bound = rec, decide(rec, sp), "", None
    ch.current = ch.decision.choice
    return ch.report()


def test_processes_skipped_by_their_bound_are_not_reported_tried_before_more_threads():
    """GIL-free rows, one thread at a core: the order changes, but the bound of one
    thread's rate skips processes in their turn; the decision does not say they
    were tried first."""
    sp = space(2)
    rec, ran = run(sp, gil_free(2), core_rate=1000.0)
    d = decide(rec, sp)
    assert d.choice == threads(2) and d.processes_skipped is Reason.NO_ROOM, d
    assert not d.processes_before_up and Mode.PROCESSES not in {c.mode for c in ran}


def test_where_processes_lose_more_threads_than_the_cores_follow():
    """The order changed, not the duels: processes slower than two threads (their
    hand-off), then four threads on two cores are dueled, and lose."""
    sp = space(2)
    rec, ran = run(sp, partly_gil(2, procs=380.0), core_rate=300.0)
    d = decide(rec, sp)
    assert d.processes_before_up and d.choice == threads(2), d
    assert _first_processes(ran) < ran.index(threads(4)), ran


def test_rows_one_thread_ran_with_waits_keep_the_order():
    """The same rates, but one thread's rows took half a core (they waited): more
    threads than the cores may overlap the waits, and are dueled before processes.
    (On more cores these rates walk the ladder down to two threads, and no count
    past the cores is left to duel.)"""
    sp = space(2)
    rec, ran = run(sp, partly_gil(2), core_rate=600.0)
    assert ran.index(threads(4)) < _first_processes(ran), ran
    assert not decide(rec, sp).processes_before_up
    # nor without the CPU readings
    rec, ran = run(sp, partly_gil(2))
    assert ran.index(threads(4)) < _first_processes(ran), ran


def test_threads_held_back_with_the_process_busy_duel_processes_before_more():
    """One thread's rows read 0.8 of a core (a window of the pass's first rows
    waits), but the two threads at the start beat it by far less than twice while
    the process kept 1.3 cores busy: what held them back is something they share
    (the GIL), not storage, whose waits leave the process idle.  Processes are
    dueled before more threads than the cores, and win; four threads never run."""
    sp = space(2)

    def core_rate(c: Candidate) -> float:
        return 300.0 / 0.8 if c == threads(1) else 420.0 / 1.3

    rec, ran = run(sp, partly_gil(2), core_rate=core_rate, other_cores=0.05)
    d = decide(rec, sp)
    assert d.processes_before_up and d.choice == processes(2), d
    assert threads(4) not in ran, ran
    # the same rates with the two threads' process idle below a core: storage
    # waits, which more threads overlap, and the order stays
    rec, ran = run(sp, partly_gil(2), core_rate=lambda c: 300.0 / 0.8 if c == threads(1)
                   else 420.0 / 0.7, other_cores=0.05)
    assert not decide(rec, sp).processes_before_up
    assert ran.index(threads(4)) < _first_processes(ran), ran


def test_one_thread_waiting_only_for_the_consumers_python_duels_processes_before_more():
    """One thread's rows took 0.9 of a core while the consumer's own Python (its
    collation, the loop) took the rest of it: the thread waited for the GIL, not for
    storage, and the process kept a core busy.  More threads than the cores would
    overlap no wait: processes are dueled before them, and win."""
    sp = space(2)
    rec, ran = run(sp, partly_gil(2), core_rate=300.0 / 0.9, other_cores=0.1)
    d = decide(rec, sp)
    assert d.processes_before_up and d.choice == processes(2), d
    assert threads(4) not in ran, ran
    # the same rows beside a consumer that took no more: the thread waited, half a
    # core idle in the process (storage), and more threads come first
    rec, ran = run(sp, partly_gil(2), core_rate=600.0, other_cores=0.1)
    assert not decide(rec, sp).processes_before_up
    assert ran.index(threads(4)) < _first_processes(ran), ran


def test_a_process_that_leaves_processes_no_second_core_keeps_the_order():
    """Threads that ran one at a time beside a consumer that keeps a whole core
    busy: processes would have one core, which one thread has too; they are not
    dueled first, inline is (the rows ran one at a time), and it stays; then the
    rows' rate per core under inline (no hand-off: a worker's row costs no less)
    times the one core left skips processes, with no solo windows of one thread."""
    sp = space(2)
    rec, ran = run(sp, gil_bound(2), 0.0, core_rate=1000.0, other_cores=1.0)
    assert ran[:2] == [threads(2), INLINE], ran
    assert not any(c.mode is Mode.PROCESSES for c in ran), ran
    assert threads(1) not in ran, ran
    d = decide(rec, sp)
    assert d.choice == INLINE and d.processes_skipped is Reason.NO_ROOM, d


@pytest.mark.parametrize("cores", [2, 16])
def test_processes_that_lose_when_dueled_first_leave_the_search_to_go_on(cores):
    """Serialised threads, but processes slower still (each row's trip costs more
    than it saves): the start stays, and inline is dueled next, before the thread
    ladder (fewer threads, one at a time too, could only tie the start); it wins,
    and no thread count is walked.  Where the windows do not know their CPU (no
    sign of the rows running one at a time), the usual order reaches it too."""
    sp = space(cores)
    rate = _contended(1100.0, 1000.0, 200.0)
    rec, ran = run(sp, rate, 0.0, core_rate=1000.0, other_cores=0.8)
    assert ran[_first_processes(ran) - 1].mode is Mode.THREADS
    d = decide(rec, sp)
    assert d.duels[0].dear == processes(cores) and d.duels[0].winner == threads(cores), d
    assert d.duels[1].cheap == INLINE and d.duels[1].dear == threads(cores), d
    assert d.choice == INLINE and threads(1) not in ran, (d, ran)
    assert d.processes_first and d.inline_before_threads, d
    rec2, ran2 = run(sp, rate, 0.0)
    d2 = decide(rec2, sp)
    assert d2.choice == INLINE and threads(1) in ran2 and not d2.inline_before_threads


def test_rows_that_wait_get_more_threads_than_cores():
    rec, _ = run(space(2, pool=4), io_bound(2))
    assert decide(rec, space(2, pool=4)).choice == threads(4)


def test_on_one_core_gil_free_work_never_goes_to_processes():
    sp = space(1, pool=3)
    for rate in (gil_free(1), gil_bound(1), tiny(1)):
        rec, ran = run(sp, rate, noise=0.03)
        assert not any(c.mode is Mode.PROCESSES for c in ran), ran
        assert decide(rec, sp).processes_skipped is Reason.NO_ROOM


# --------------------------------------------------------------- the margin
def _duel(a: Candidate, ra: list[float], b: Candidate, rb: list[float]):
    """Windows of a loader that is the bottleneck: the consumer waited throughout."""
    return judge([Window(a, round(r * 10), 10.0, 10.0) for r in ra],
                 [Window(b, round(r * 10), 10.0, 10.0) for r in rb], CFG)


def test_a_cheaper_side_that_keeps_up_with_the_consumer_stays():
    """The consumer never waited for the cheaper side (its pace is the cheaper side's
    rate): the dearer one reading 8% faster is noise, not a gain."""
    cheap = [Window(threads(1), 1000, 4.0, 0.0), Window(threads(1), 1000, 4.0, 0.0)]
    dear = [Window(threads(2), 1080, 4.0, 0.0), Window(threads(2), 1080, 4.0, 0.0)]
    assert judge(cheap, dear, CFG).winner == threads(1)


def test_the_dearer_must_beat_the_cheaper_by_more_than_the_spread_of_like_windows():
    tight = _duel(threads(1), [1000, 1000], threads(2), [1200, 1200])
    assert tight.margin == CFG.min_margin and tight.winner == threads(2)
    # the same means, but like windows 30% apart: 20% is inside the noise
    noisy = _duel(threads(1), [850, 1150], threads(2), [1200, 1200])
    assert noisy.margin == pytest.approx(0.3) and noisy.winner == threads(1)
    # the spread of either side counts
    assert _duel(threads(1), [1000, 1000], threads(2), [900, 1500]).winner == threads(1)


def test_the_floor_keeps_a_few_percent_from_moving_anything():
    d = _duel(INLINE, [1000, 1000], threads(1), [1040, 1040])
    assert d.winner == INLINE and d.margin == CFG.min_margin


def test_one_window_that_lost_its_cores_decides_nothing():
    """A shared machine's noise is heavy-tailed: one window at a quarter of the
    others must not hide a dearer candidate twice as fast, nor widen the margin."""
    d = _duel(threads(1), [1000, 1010, 250, 990], threads(2), [1900, 1950, 1880, 1920])
    assert d.winner == threads(2) and d.cheap_rate == pytest.approx(995)


def test_a_duel_judges_alternating_windows():
    # the pass slows down as it goes (A B A B): both sides see the drift
    d = _duel(threads(2), [1000, 800], processes(2), [1100, 880])
    assert d.cheap == threads(2) and d.dear == processes(2)
    assert d.winner == threads(2)  # 10% better, inside a 22% spread


def test_windows_alternate_between_the_two_candidates_of_a_duel():
    sp = space(2)
    rec = Record()
    seen = []
    for _ in range(4):
        c = decide(rec, sp).run
        seen.append(c)
        rec.windows.append(Window(c, 100, 0.1))
    assert seen == [threads(2), threads(1), threads(2), threads(1)]


# ------------------------------------------------------------- the ladder
@pytest.mark.parametrize("cores,pool,want", [
    (1, 3, [1, 3]),
    (2, 4, [1, 2, 4]),
    (16, 18, [1, 2, 4, 8, 16, 18]),
    (96, 98, [1, 2, 4, 8, 16, 32, 64, 96, 98]),
    (4, 2, [1, 2]),
])
def test_the_thread_ladder_doubles_to_the_cores_then_the_pool(cores, pool, want):
    assert [c.count for c in Space.thread_ladder(cores, pool)] == want


@pytest.mark.parametrize("cores,pool,most,want", [
    (2, 4, 64, [1, 2, 4, 8, 16, 32, 64]),
    (2, 4, 63, [1, 2, 4, 8, 16, 32]),
    (2, 4, 7, [1, 2, 4]),
    (16, 18, 96, [1, 2, 4, 8, 16, 18, 36, 72]),
    (1, 3, 2, [1, 3]),
])
def test_past_the_pool_the_ladder_doubles_up_to_the_rows_in_flight(cores, pool, most, want):
    assert [c.count for c in Space.thread_ladder(cores, pool, most)] == want


def waiting(wait_s: float, cpu_s: float, cores: int):
    """Rows that wait ``wait_s`` off the GIL and a core, then run ``cpu_s`` holding
    the GIL: n threads overlap the waits, up to one GIL's worth of rows."""
    def rate(c: Candidate) -> float:
        n = max(c.count, 1)
        if c.mode is Mode.PROCESSES:
            return min(n / (wait_s + cpu_s), n / cpu_s, cores / cpu_s)
        return min(n / (wait_s + cpu_s), 1 / cpu_s)
    return rate


def test_rows_that_wait_climb_past_the_pool_while_each_rung_wins():
    """Rows waiting 10 ms with 1 ms of Python: 4 threads (the pool) run 364 rows/s, 8
    run 727, 16 can run at most one GIL's 1,000: the search climbs to 16 and no
    further (32 threads read the same 1,000)."""
    sp = Space(ladder=Space.thread_ladder(2, 4, 64), start=threads(2), cores=2,
               process=processes(2))
    rec, ran = run(sp, waiting(0.010, 0.001, 2), core_rate=1000.0)
    assert decide(rec, sp).choice == threads(16), ran
    assert threads(32) in ran and threads(64) not in ran, ran


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_rows_that_wait_leap_up_the_ladder_and_search_the_rungs_leapt_over(cores):
    """Rows that wait 20 ms with 0.05 ms of Python (one GIL: at most 20,000 rows/s,
    reached from 401 threads): the climb leaps from the threads that just won to
    the rung whose reach meets the cores, then searches the rungs leapt over for
    the cheapest that ties it; it finds the count a rung-by-rung climb finds in
    fewer duels, and never runs a rung that could not tie the leap."""
    sp = Space(ladder=Space.thread_ladder(cores, cores + 2, 2048), start=threads(cores),
               cores=cores, process=processes(cores))
    rate = waiting(0.020, 0.00005, cores)
    rec, ran = run(sp, rate, core_rate=20_000.0)
    d = decide(rec, sp)
    # the cheapest rung within the margin of the plateau
    best = max(rate(c) for c in sp.ladder)
    want = min((c for c in sp.ladder if rate(c) * (1 + CFG.min_margin) >= best),
               key=lambda c: c.count)
    assert d.choice == want, (d.choice, ran)
    thread_duels = [du for du in d.duels if du.dear.mode is Mode.THREADS
                    and du.cheap.mode is Mode.THREADS]
    assert any(sp.ladder.index(du.dear) > sp.ladder.index(du.cheap) + 1
               for du in thread_duels), thread_duels
    # one rung at a time, the climb duels every rung from the start to the choice,
    # and the one above, which ties it
    climb = [c for c in sp.ladder if sp.start.count < c.count <= want.count]
    assert len([du for du in thread_duels if du.dear.count > sp.start.count]) \
        < len(climb) + 1, thread_duels
    leap = max(du.dear_rate for du in thread_duels if du.cheap == sp.start)
    start_rate = rate(sp.start)
    for c in sp.ladder:
        if sp.start.count < c.count and c.count / sp.start.count * start_rate * 1.2 < leap:
            assert c not in ran, (c, ran)


def test_a_leap_that_loses_climbs_one_rung_at_a_time():
    """Rows that wait behind a pool of four connections: four threads read twice
    two, more read what one thread does (they queue).  The leap from two threads
    loses; the climb then steps to four, which wins, and no further."""
    sp = Space(ladder=Space.thread_ladder(2, 4, 256), start=threads(2), cores=2,
               process=processes(2))

    def rate(c: Candidate) -> float:
        if c.mode is Mode.THREADS:
            return 100.0 * c.count if c.count <= 4 else 100.0
        return 100.0 * c.count if c.mode is Mode.PROCESSES else 100.0
    rec, ran = run(sp, rate, core_rate=5000.0)
    d = decide(rec, sp)
    assert d.choice == threads(4), (d, ran)
    dears = [du.dear for du in d.duels if du.cheap == threads(2)]
    assert dears[0].count > 4 and threads(4) in dears, d.duels


def test_a_recheck_does_not_leap():
    """A re-check duels the choice with its neighbours, one rung each way."""
    sp = Space(ladder=Space.thread_ladder(2, 4, 2048), start=threads(2), cores=2,
               process=processes(2))
    rate = waiting(0.050, 0.0005, 2)
    rec, _ = run(sp, rate, core_rate=2000.0)
    first = decide(rec, sp).choice
    rec.recheck_at.append(len(rec.windows))
    rec2, ran = run(sp, rate, core_rate=2000.0, record=rec)
    counts = sorted({c.count for c in ran if c.mode is Mode.THREADS})
    i = sp.ladder.index(first)
    assert set(counts) <= {sp.ladder[i - 1].count, first.count, sp.ladder[i + 1].count, 1}, \
        (first, counts)


def test_the_search_is_bounded_by_the_ladder_not_the_cores():
    """On 96 cores the search measures a few rungs, not 96 counts."""
    _, ran = run(space(96), gil_free(96))
    assert len(set(ran)) <= 5 and len(ran) <= 16, ran


@pytest.mark.parametrize("cores", [16, 96])
@pytest.mark.parametrize("kind", [gil_bound, tiny])
def test_rows_whose_threads_do_not_scale_skip_the_rungs_between(cores, kind):
    """One duel against one thread shows that threads do not scale; the search then
    reaches processes and inline in as many windows on 96 cores as on 16."""
    _, ran = run(space(cores), kind(cores), 0.02)
    assert len(ran) <= 12, ran
    counts = {c.count for c in ran if c.mode is Mode.THREADS}
    assert counts == {1, 2, cores}, counts


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_a_thread_count_between_one_and_the_cores_is_still_found(cores):
    """Rows that scale to a few threads and then slow down (contention): the top
    beats one thread, and the walk down finds the best rung."""
    rec, _ = run(space(cores, pool=cores + 2), humped, 0.02)
    assert decide(rec, space(cores, pool=cores + 2)).choice == threads(4)


def test_the_open_duel_names_its_rival_and_the_most_threads_it_runs():
    """Tasks are cut for the duel's sides, not the pool: a duel of inline and
    processes runs at most one thread's tasks."""
    sp = space(16)
    d = decide(Record(), sp)
    assert (d.choice, d.rival, d.most_threads()) == (threads(16), threads(1), 16)
    rec, _ = run(sp, gil_bound(16))
    settled = decide(rec, sp)
    assert settled.rival is None and settled.most_threads() == 1  # processes
    # the duels on the way, replayed window by window
    seen = set()
    for k in range(len(rec.windows)):
        dk = decide(Record(rec.windows[:k]), sp)
        seen.add((dk.choice, dk.rival, dk.most_threads()))
    # one thread beat the start: processes came before the climb, won, and the climb
    # duels two threads against them (these windows know no CPU: no bound skips it)
    assert (processes(16), threads(2), 2) in seen
    assert (processes(16), INLINE, 1) in seen


def threads_ahead_of_one(c: int):
    """Tiny rows where one thread's windows read low (the hand-off per task, or a
    slow stretch of the machine) and two threads beat it; inline, which hands
    nothing off, runs ahead of both."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.INLINE:
            return 44_000.0
        if x.mode is Mode.THREADS:
            return 30_000.0 if x.count == 1 else 38_000.0 / (1 + 0.3 * (x.count - 2))
        return 15_000.0
    return rate


@pytest.mark.parametrize("cores", [2, 16])
def test_inline_is_dueled_against_threads_that_beat_one_thread(cores):
    """One thread losing to two says nothing of inline: rows at 50,000 per CPU
    second leave two threads' 38,000 below one core's rate, so inline is dueled,
    and wins."""
    sp = space(cores)
    rec, ran = run(sp, threads_ahead_of_one(cores), 0.02, core_rate=50_000.0)
    d = decide(rec, sp)
    assert INLINE in ran and d.choice == INLINE and d.inline_skipped is None, d


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_inline_is_not_dueled_where_threads_run_the_rows_beyond_one_core(cores):
    """GIL-free rows at 1,000 rows per CPU second: threads at the cores read 0.97 of
    every core's rate, which inline, on one thread, cannot reach.  Without CPU
    readings nothing bounds inline, and it is dueled (and loses)."""
    sp = space(cores)
    rec, ran = run(sp, gil_free(cores), 0.02, core_rate=1000.0)
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.inline_skipped is Reason.NO_ROOM, d
    assert INLINE not in ran, ran
    rec, ran = run(sp, gil_free(cores), 0.02)
    assert INLINE in ran and decide(rec, sp).choice == threads(cores)


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_inline_is_not_dueled_where_processes_beat_one_core(cores):
    """Pure Python rows at 1,000 rows per CPU second: processes at the cores'
    rate leave inline, one thread's worth at best, no room."""
    rec, ran = run(space(cores), gil_bound(cores), 0.02, core_rate=1050.0)
    d = decide(rec, space(cores))
    assert d.choice == processes(cores) and INLINE not in ran, ran
    assert d.inline_skipped is Reason.NO_ROOM


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_more_threads_are_not_dueled_where_the_rows_run_at_every_cores_rate(cores):
    """GIL-free rows at 1,000 rows per CPU second: the cores' threads read 97% of
    the cores' rate, so no count above the cores can win by the margin."""
    sp = space(cores)
    rec, ran = run(sp, gil_free(cores), 0.0, core_rate=1000.0)
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.threads_skipped is Reason.NO_ROOM, d
    assert not any(c.mode is Mode.THREADS and c.count > cores for c in ran), ran
    # without CPU readings nothing bounds them: the next rung is measured
    rec, ran = run(sp, gil_free(cores), 0.0)
    assert decide(rec, sp).threads_skipped is None
    assert any(c.mode is Mode.THREADS and c.count > cores for c in ran), ran


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_the_more_threads_bound_reads_the_thread_windows_together(cores):
    """Window by window the rows' CPU reads 30% high, then 30% low (some windows
    draw the dearer samples): the most of those readings would put one core at
    1,430 rows per CPU second and the bound out of reach; over the thread
    windows together it is the 1,000 the rows run at, and no count above the
    cores is measured."""
    sp = space(cores)
    rec, ran = run(sp, gil_free(cores), 0.0, core_rate=1000.0, cpu_skew=0.3)
    assert max(w.core_rate for w in rec.windows) > 1400
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.threads_skipped is Reason.NO_ROOM, d
    assert not any(c.mode is Mode.THREADS and c.count > cores for c in ran), ran


@pytest.mark.parametrize("cores", [2, 16])
def test_the_more_threads_bound_leaves_the_consumer_its_cores(cores):
    """The consumer keeps half a core busy in the loader's process: the cores'
    threads run the rows on the rest, at 98% of that; more threads would share the
    same cores, and are not measured.  Not knowing the process's CPU, the bound is
    every core, and the next rung is measured."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.THREADS:
            return 1000.0 * min(x.count, cores - 0.5) * 0.98
        return {Mode.INLINE: 450.0}.get(x.mode, 1000.0 * (cores - 0.5) * 0.9)
    sp = space(cores)
    rec, ran = run(sp, rate, 0.0, core_rate=1000.0, other_cores=0.5)
    d = decide(rec, sp)
    assert d.choice == threads(cores) and d.threads_skipped is Reason.NO_ROOM, d
    assert not any(c.mode is Mode.THREADS and c.count > cores for c in ran), ran
    rec, ran = run(sp, rate, 0.0, core_rate=1000.0)
    assert decide(rec, sp).threads_skipped is None
    assert any(c.mode is Mode.THREADS and c.count > cores for c in ran), ran


def _scripted(sp: Space, script: dict[Candidate, list[float]], steps: int) -> Decision:
    """Drive ``decide`` for ``steps`` windows (see :func:`_scripted_record`)."""
    return decide(Record(_scripted_record(sp, script, steps)), sp)


def _scripted_record(sp: Space, script: dict[Candidate, list[float]], steps: int
                     ) -> list[Window]:
    """Drive ``decide`` for ``steps`` windows, each of the candidate it runs; returns
    them.  Each candidate's k-th window reads ``script[c][k]`` rows/s (its last
    entry thereafter), 0.1 s long."""
    rec = Record()
    for _ in range(steps):
        c = decide(rec, sp).run
        rates = script[c]
        seen = sum(w.candidate == c for w in rec.windows)
        rec.windows.append(Window(c, round(rates[min(seen, len(rates) - 1)] * 0.1), 0.1, 0.05))
    return rec.windows


def test_a_lead_of_less_than_two_margins_must_hold_over_another_round():
    """Four threads lead two by 8% over one round, where the margin is 5% (like
    windows read alike): noise gives such a lead to about one duel in six, so the
    duel goes on; over the next rounds they read level, and two threads stay."""
    sp = space(2, pool=4, inline=False)  # the thread duels alone
    script = {threads(1): [500.0], threads(2): [1000.0], threads(4): [1080.0, 1080.0, 1000.0]}
    d = _scripted(sp, script, 7)  # the bottom duel, then one round of 2 against 4
    assert not d.settled and d.choice == threads(2) and d.rival == threads(4), d
    assert d.window_scale == 2  # the second round's windows last twice as long
    d = _scripted(sp, script, 40)
    assert d.settled and d.choice == threads(2) and d.reason is Reason.CHEAPER, d
    assert d.duels[-1].dear == threads(4) and d.duels[-1].winner == threads(2)


def test_a_lead_inside_the_margin_is_not_measured_again():
    """Four threads read 3% above two, inside the 5% margin: the cheaper stays
    after one round of the duel, not after three."""
    sp = space(2, pool=4, inline=False)  # the thread duels alone
    script = {threads(1): [500.0], threads(2): [1000.0], threads(4): [1030.0]}
    d = _scripted(sp, script, 7)  # the bottom duel, then one round of 2 against 4
    assert d.settled and d.choice == threads(2) and d.reason is Reason.CHEAPER, d


@pytest.mark.parametrize("slow", [600.0, 500.0], ids=["ahead", "level"])
def test_a_lead_inside_a_margin_that_one_slow_window_set_is_measured_again(slow):
    """Processes' first window reads ``slow`` rows/s (a start still under way,
    another process's burst), their second 1,100: a 13% lead over two threads
    inside a 59% margin (600), or a median level with them and a 67% margin
    (500, the 5% floor beaten by the noise beyond it).  The slow window set the
    margin, and its side's median: the duel goes on, the next windows read
    alike, and processes win on the margin of all their windows."""
    sp = space(2, pool=4, inline=False)
    script = {threads(1): [500.0], threads(2): [750.0], threads(4): [600.0],
              processes(2): [slow, 1100.0 if slow == 600.0 else 1000.0,
                             950.0, 980.0, 960.0, 970.0]}
    d = _scripted(sp, script, 40)
    assert d.settled and d.choice == processes(2) and d.reason is Reason.FASTER, d
    last = d.duels[-1]
    assert (last.cheap, last.dear) == (threads(2), processes(2)) and last.margin < 0.1, last


def test_a_dearer_side_behind_beyond_the_noise_is_not_measured_again():
    """Processes read 600 and 700 rows/s against two threads' 1,000 and 1,010: even
    the noise their windows showed leaves them short of the floor's lead, so the
    duel ends after one round."""
    sp = space(2, pool=4, inline=False)
    script = {threads(1): [600.0], threads(2): [1000.0, 1010.0], threads(4): [600.0],
              processes(2): [600.0, 700.0, 2000.0]}
    d = _scripted(sp, script, 40)
    assert d.settled and d.choice == threads(2), d
    duel = next(x for x in d.duels if x.dear == processes(2))
    assert duel.winner == threads(2), duel
    assert sum(w.candidate == processes(2) for w in _scripted_record(sp, script, 40)) == 2


def test_a_lead_of_more_than_two_margins_wins_after_one_round():
    sp = space(2, pool=4, inline=False)  # the thread duels alone
    script = {threads(1): [500.0], threads(2): [1000.0], threads(4): [1150.0, 1150.0, 1000.0]}
    d = _scripted(sp, script, 40)
    assert d.choice == threads(4) and d.reason is Reason.FASTER, d
    assert d.duels[-1].dear == threads(4) and d.duels[-1].winner == threads(4)


def test_rows_that_wait_use_little_cpu_and_still_get_more_threads():
    """Rows that wait on storage at 20,000 rows per CPU second: the bound is far
    above what they read, and the dearer rungs are measured (and win)."""
    sp = space(2, pool=4)
    rec, ran = run(sp, io_bound(2), 0.0, core_rate=20_000.0)
    d = decide(rec, sp)
    assert d.choice == threads(4) and d.threads_skipped is None, d


def _busy_consumer(x: Candidate) -> float:
    """GIL-free rows on 2 cores whose consumer keeps half a core busy: two
    threads read 1.5 times one; processes, sharing the same cores, no more."""
    return {Mode.INLINE: 500.0, Mode.THREADS: 1000.0 * min(x.count, 1.5)}.get(
        x.mode, 1500.0)


def test_processes_are_bounded_by_the_cores_the_process_leaves_them():
    """The consumer's own CPU stays in the loader's process under processes too:
    with half a core busy besides the rows, two workers have 1.5 cores, and two
    threads at 1.5 times one thread leave them no room."""
    sp = space(2)
    rec, ran = run(sp, _busy_consumer, 0.0, core_rate=1050.0, other_cores=0.5)
    d = decide(rec, sp)
    assert d.choice == threads(2) and d.processes_skipped is Reason.NO_ROOM, d
    assert not any(c.mode is Mode.PROCESSES for c in ran), ran
    # not knowing the process's CPU, the bound is the cores: processes are measured
    rec, ran = run(sp, _busy_consumer, 0.0, core_rate=1050.0)
    assert any(c.mode is Mode.PROCESSES for c in ran), ran
    assert decide(rec, sp).choice == threads(2)


def pickled_dicts(c: int):
    """Dict rows of 20 us under a custom collate: a worker sends each back pickled,
    and the hand-off, not the row, limits processes."""
    return _contended(44_000.0, 40_000.0, 18_000.0)


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_rows_that_travel_dearer_than_their_share_of_the_cores_skip_processes(cores):
    """Each row costs its own 20 us of CPU and, under processes, 9 us to pickle in
    a worker and 9 us to unpickle here: on the cores left (2 less half a core)
    that is at most about 39,000 rows/s, below what one thread delivered; 16 or
    96 cores leave the unpickling itself, on one thread at a time (the GIL), to
    bound them: at 30 us a row, below one thread's rate.  No fork to find out."""
    cost = Handoff(9e-6, 9e-6) if cores == 2 else Handoff(9e-6, 30e-6)
    sp = space(cores)
    rec, ran = run(sp, pickled_dicts(cores), 0.02, record=Record(handoff=cost),
                   core_rate=50_000.0, other_cores=0.5)
    d = decide(rec, sp)
    assert d.choice == INLINE and d.processes_skipped is Reason.HANDOFF, d
    assert not any(c.mode is Mode.PROCESSES for c in ran), ran
    # not knowing the hand-off, or rows written in place: processes are measured
    for known in (None, Handoff.IN_PLACE):
        rec, ran = run(sp, pickled_dicts(cores), 0.02, record=Record(handoff=known),
                       core_rate=50_000.0, other_cores=0.5)
        assert any(c.mode is Mode.PROCESSES for c in ran), (known, ran)
        assert decide(rec, sp).choice == INLINE


def test_a_recheck_bounds_processes_by_the_hand_off_before_its_own_windows():
    """A re-check of inline opens with the processes duel, before any window of its
    own knows the rows' CPU: the readings of the search before bound them."""
    sp = space(2)
    rec, _ = run(sp, pickled_dicts(2), 0.02, record=Record(handoff=Handoff(9e-6, 9e-6)),
                 core_rate=50_000.0, other_cores=0.5)
    assert decide(rec, sp).choice == INLINE
    rec.recheck_at.append(len(rec.windows))
    rec, ran = run(sp, pickled_dicts(2), 0.02, record=rec, core_rate=50_000.0,
                   other_cores=0.5)
    d = decide(rec, sp)
    assert d.choice == INLINE and d.processes_skipped is Reason.HANDOFF, d
    assert not any(c.mode is Mode.PROCESSES for c in ran), ran


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_a_hand_off_cheap_beside_the_row_leaves_processes_to_be_measured(cores):
    """Rows of a millisecond of pure Python that travel in 20 us: the hand-off
    leaves processes room, and they win."""
    sp = space(cores)
    rec, _ = run(sp, gil_bound(cores), 0.02, record=Record(handoff=Handoff(10e-6, 10e-6)),
                 core_rate=1000.0, other_cores=0.1)
    d = decide(rec, sp)
    assert d.choice == processes(cores) and d.reason is Reason.FASTER, d


def test_the_hand_off_travels_with_the_record():
    rec = Record(handoff=Handoff(1e-5, 2.5e-5))
    assert Record.from_dict(rec.to_dict()).handoff == Handoff(1e-5, 2.5e-5)
    old = rec.to_dict()
    del old["handoff"]  # traces recorded before it was read
    assert Record.from_dict(old).handoff is None


def test_the_chooser_reads_the_hand_off_once_before_its_first_window():
    """The record replays from its start with the hand-off it holds: read before
    the first window, never changed after it."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(pickled_dicts(2), clock)
    ctl.core_rate, ctl.other_cores, ctl.travel = 50_000.0, 0.5, Handoff(9e-6, 9e-6)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 3)
    assert ch.record.windows and ch.record.handoff == Handoff(9e-6, 9e-6)
    ctl.travel = Handoff.IN_PLACE
    _ticks(ch, ctl, 400)
    assert ch.record.handoff == Handoff(9e-6, 9e-6)
    assert ch.current == INLINE and ch.report().processes_skipped is Reason.HANDOFF


def test_passes_keep_rows_for_the_hand_off_only_until_the_first_window():
    ch = Chooser(space(2))
    assert ch.wants_handoff()
    ch.record.windows.append(Window(threads(2), 100, 0.1))
    assert not ch.wants_handoff()
    assert not Chooser(None, fixed_choice=INLINE).wants_handoff()


def test_the_chooser_reads_the_whole_process_cpu_into_its_windows():
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(_busy_consumer, clock)
    ctl.core_rate, ctl.other_cores = 1050.0, 0.5
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 400)
    threads_w = [w for w in ch.record.windows if w.candidate.mode is Mode.THREADS]
    assert threads_w and all(w.other_cores == pytest.approx(0.5, rel=0.05) for w in threads_w)
    assert ch.current == threads(2) and ch.report().processes_skipped is Reason.NO_ROOM


def test_the_chooser_reads_the_workers_cpu_into_process_windows():
    """Process windows carry the CPU their workers took: workers that had half the
    cores read so, and twice the workers are measured."""
    clock = [0.0]
    ch = Chooser(_with_more(space(2)), clock=lambda: clock[0])
    ctl = _Control(shared(2, 1), clock)
    ctl.core_rate, ctl.other_cores = 1000.0, 0.05
    ctl.worker_cores = lambda c: _share(2, 1, c.count)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 600)
    procs = [w for w in ch.record.windows if w.candidate == processes(2)]
    assert procs and all(w.workers_cpu / w.seconds == pytest.approx(_share(2, 1, 2), rel=0.05)
                         for w in procs)
    assert processes(4) in [w.candidate for w in ch.record.windows]
    assert ch.current == processes(4), ch.report()


def test_twice_the_workers_that_cannot_start_leave_the_workers_below_available():
    """Twice the workers fail to start (a fork more, their memory): they leave the
    space, the failed start is not counted against processes, and the search goes
    on (two workers won, and stay); the record replays to the same decision."""
    clock = [0.0]
    ch = Chooser(_with_more(space(2)), clock=lambda: clock[0])
    ctl = _Control(lambda c: 10 * shared(2, 1)(c), clock)  # rows a tick in tens
    ctl.core_rate, ctl.other_cores = 10_000.0, 0.05
    ctl.worker_cores = lambda c: _share(2, 1, c.count)
    ctl.refused = {processes(4)}
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 600)
    assert processes(4) in ctl.asked and processes(4) not in ctl.applied
    assert ch.record.failed_starts == 0
    assert ch.space is not None and ch.space.more_processes is None
    assert ch.decision.settled and ch.current == processes(2), ch.report()
    assert decide(ch.record, ch.space) == ch.decision


def test_inline_is_dueled_where_the_cpu_is_not_known_or_processes_are_close():
    # no CPU readings: nothing bounds inline
    rec, ran = run(space(2), gil_bound(2), 0.02)
    assert INLINE in ran and decide(rec, space(2)).inline_skipped is None
    # processes ahead of one thread, but not beyond a core's rate of the rows
    def close(x: Candidate) -> float:
        return {Mode.INLINE: 1000.0, Mode.THREADS: 900.0}.get(x.mode, 1300.0)
    rec, ran = run(space(2), close, 0.0, core_rate=1250.0)
    d = decide(rec, space(2))
    assert INLINE in ran and d.inline_skipped is None, d


def test_the_chooser_reads_the_cpu_of_the_rows_into_its_windows():
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_bound(2), clock)
    ctl.core_rate = 1050.0
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 400)
    threads_w = [w for w in ch.record.windows if w.candidate.mode is Mode.THREADS]
    assert threads_w and all(w.cpu == pytest.approx(w.rows / 1050.0, rel=0.05)
                             for w in threads_w)
    assert all(w.cpu == 0.0 for w in ch.record.windows if w.candidate.mode is Mode.PROCESSES)
    assert ch.current == processes(2) and ch.report().inline_skipped is Reason.NO_ROOM
    assert "inline not tried" in str(ch.report())


# -------------------------------------------------------- processes' start
def test_processes_that_cannot_start_count_out_after_the_attempts():
    sp = space(2)
    rec, _ = run(sp, gil_bound(2), record=Record(failed_starts=CFG.start_attempts))
    d = decide(rec, sp)
    assert d.choice.mode is not Mode.PROCESSES
    assert d.processes_skipped is Reason.UNAVAILABLE


def test_no_process_candidate_no_processes():
    sp = space(2, with_processes=False)
    rec, ran = run(sp, gil_bound(2))
    assert all(c.mode is not Mode.PROCESSES for c in ran)


def test_without_inline_the_ladder_starts_at_one_thread():
    sp = space(2, inline=False)
    rec, ran = run(sp, tiny(2))
    assert INLINE not in ran and decide(rec, sp).choice == threads(1)


# ---------------------------------------------------------------- purity
def test_decide_is_a_pure_function_of_the_record():
    rec, _ = run(space(2), gil_bound(2), noise=0.05, seed=3)
    a, b = decide(rec, space(2)), decide(Record.from_dict(rec.to_dict()), space(2))
    assert a == b


def test_every_prefix_of_a_record_replays_to_the_run_it_asked_for():
    rec, ran = run(space(16), gil_bound(16), noise=0.05, seed=7)
    for k in range(len(rec.windows)):
        assert decide(Record(rec.windows[:k]), space(16)).run == rec.windows[k].candidate


# ------------------------------------------------------------- re-checks
def test_a_drift_outside_twice_the_margin_is_seen_inside_it_is_not():
    assert not drifted(1000.0, [990, 1010, 1005, 995], 0.05)
    assert not drifted(1000.0, [1000, 900], 0.05)            # too few readings
    assert drifted(1000.0, [700, 720, 690, 710], 0.05)
    assert not drifted(1000.0, [700, 720, 690, 710], 0.2)    # a noisy duel: a wide band


def test_a_recheck_duels_the_neighbours_and_can_move_the_choice():
    sp = space(2)
    rec, _ = run(sp, gil_free(2))
    assert decide(rec, sp).choice == threads(2)
    rec.recheck_at.append(len(rec.windows))  # the rate drifted: the rows became GIL-bound
    rec, ran = run(sp, gil_bound(2), record=rec)
    d = decide(rec, sp)
    assert d.choice == processes(2), d
    assert ran[0] == threads(2)  # the incumbent is measured again first


def _share(c: int, others: int, n: int) -> float:
    """The cores ``n`` worker processes get beside ``others`` busy processes on ``c``
    cores, each process a fair share."""
    return n * min(1.0, c / (n + others))


def shared(c: int, others: int):
    """Pure Python on ``c`` cores beside ``others`` busy processes: the loader's
    threads (one GIL) run one core's share, ``n`` workers ``n`` shares, at one core's
    rate of the rows each (IPC: 10%)."""
    def rate(x: Candidate) -> float:
        if x.mode is Mode.PROCESSES:
            return 1000.0 * _share(c, others, x.count) * 0.9
        return 1000.0 * min(1.0, c / (1 + others)) - 30.0 * max(0, x.count - 1)
    return rate


def _with_more(sp: Space) -> Space:
    assert sp.process is not None
    return dataclasses.replace(sp, more_processes=processes(2 * sp.process.count))


@pytest.mark.parametrize("cores", [2, 16])
def test_workers_that_do_not_get_their_cores_duel_twice_the_workers(cores):
    """Beside busy processes the workers get a share of the cores (their CPU per
    second below their count): twice the workers are dueled and win by their larger
    share, as a DataLoader user's ``num_workers`` above the cores does."""
    sp = _with_more(space(cores))
    others = cores // 2
    rec, ran = run(sp, shared(cores, others), 0.02, core_rate=1000.0,
                   worker_cores=lambda x: _share(cores, others, x.count))
    d = decide(rec, sp)
    assert d.choice == processes(2 * cores) and d.reason is Reason.FASTER, d
    assert (processes(cores), processes(2 * cores)) in [(x.cheap, x.dear) for x in d.duels]
    assert d.more_processes_skipped is None
    # without the rung (num_workers given: the user's count) the workers stay
    rec2, ran2 = run(space(cores), shared(cores, others), 0.02, core_rate=1000.0,
                     worker_cores=lambda x: _share(cores, others, x.count))
    assert decide(rec2, space(cores)).choice == processes(cores)
    assert processes(2 * cores) not in ran2


def test_workers_that_lost_without_their_cores_still_duel_twice_the_workers():
    """Workers that read level with the threads, having had half the cores, lose
    their duel (the cheaper stays); twice the workers are measured against the
    threads all the same, and win."""
    sp = _with_more(space(2))

    def rate(x: Candidate) -> float:
        if x.mode is Mode.PROCESSES:
            return 1000.0 * x.count / 2 * 0.9 + 100.0
        return 1000.0 - 30.0 * max(0, x.count - 1)
    rec, ran = run(sp, rate, 0.02, core_rate=1000.0, worker_cores=lambda x: x.count / 2)
    d = decide(rec, sp)
    first = next(x for x in d.duels if x.dear == processes(2))
    assert first.winner != processes(2), d
    assert d.choice == processes(4), d


@pytest.mark.parametrize("cores", [2, 16, 96])
def test_workers_that_keep_their_cores_busy_leave_no_room_for_more(cores):
    """Workers that kept busy every core they could have (their CPU per second at
    their count): twice the workers have nothing to gain, and are not forked."""
    sp = _with_more(space(cores))
    rec, ran = run(sp, gil_bound(cores), 0.02, core_rate=1000.0,
                   worker_cores=lambda x: float(x.count))
    d = decide(rec, sp)
    assert d.choice == processes(cores), d
    assert processes(2 * cores) not in ran
    assert d.more_processes_skipped is Reason.NO_ROOM


def test_workers_waiting_on_a_busy_loader_process_leave_no_room_for_more():
    """Sixteen workers half idle because the loader's process, one GIL, takes their
    rows no faster (it is busy a whole core): twice the workers would wait as
    much, and are not forked.  With that process mostly idle the same workers'
    idle half is room, and twice the workers are measured."""
    sp = _with_more(space(16))

    def rate(x: Candidate) -> float:
        return 8000.0 if x.mode is Mode.PROCESSES else 1000.0
    rec, ran = run(sp, rate, 0.02, core_rate=1000.0, worker_cores=lambda x: 8.0,
                   loader_cores=1.0)
    d = decide(rec, sp)
    assert d.choice == processes(16) and processes(32) not in ran, d
    assert d.more_processes_skipped is Reason.NO_ROOM
    rec2, ran2 = run(sp, rate, 0.02, core_rate=1000.0, worker_cores=lambda x: 8.0,
                     loader_cores=0.1)
    assert processes(32) in ran2


def test_a_recheck_of_twice_the_workers_duels_the_workers_below():
    """A choice of twice the workers is re-checked against the rung below, which
    wins once the other load is gone (the same rate, fewer processes)."""
    sp = _with_more(space(2))
    rec, _ = run(sp, shared(2, others=1), 0.02, core_rate=1000.0,
                 worker_cores=lambda x: _share(2, 1, x.count))
    assert decide(rec, sp).choice == processes(4)
    rec.recheck_at.append(len(rec.windows))  # the rate drifted: the others stopped
    rec, ran = run(sp, shared(2, others=0), 0.02, core_rate=1000.0, record=rec,
                   worker_cores=lambda x: _share(2, 0, x.count))
    d = decide(rec, sp)
    assert processes(2) in ran and d.choice == processes(2), d


def test_a_recheck_that_finds_nothing_better_keeps_the_choice():
    sp = space(16)
    rec, first = run(sp, gil_free(16))
    rec.recheck_at.append(len(rec.windows))
    rec, ran = run(sp, gil_free(16), record=rec)
    assert decide(rec, sp).choice == threads(16)
    assert len(ran) < len(first)  # one rung each way, not the whole search


class _Control:
    """A pass for the chooser: rows complete at ``rate`` of what runs, on a clock."""

    def __init__(self, rate, clock: list[float]) -> None:
        self.rate, self.clock = rate, clock
        self.rows, self.events, self.last = 0, 0, 0.0
        self.runs: Candidate | None = None
        self.applied: list[Candidate] = []
        self.primed = True
        self.drain_until = 0.0
        self.cpu = 0.0
        self.core_rate = 0.0  # rows per CPU second in threads (0: not counted)
        self.pcpu = 0.0       # the whole process's CPU
        self.other_cores = 0.0  # cores the process keeps busy besides the rows
        self.tasks_running = 0  # what running() answers
        self.travel: Handoff | None = None  # what handoff() answers
        self.worker_cores: Callable[[Candidate], float] | None = None  # workers' cores busy
        self.refused: set[Candidate] = set()  # candidates that cannot start
        self.asked: list[Candidate] = []      # every candidate apply() was asked for
        self.wcpu = 0.0
        self.collections = 0  # what full_collections() answers

    def waited(self) -> float:
        return self.clock[0]  # the consumer only waits: the loader is the bottleneck

    def completed(self):
        return self.rows, self.events, self.last

    def draining(self) -> bool:
        return self.drain_until > self.clock[0]

    def running(self) -> int:
        return self.tasks_running

    def handoff(self, budget_s: float) -> Handoff | None:
        return self.travel

    def rows_cpu(self) -> float:
        return self.cpu

    def full_collections(self) -> int:
        return self.collections

    def process_cpu(self) -> float:
        return self.pcpu

    def workers_cpu(self) -> float:
        return self.wcpu

    def apply(self, c: Candidate) -> bool:
        self.asked.append(c)
        if c in self.refused:
            return False
        self.runs = c
        self.applied.append(c)
        return True

    def call_waiting(self, fn) -> None:
        fn()

    def advance(self, seconds: float, chunks: int = 10) -> None:
        for _ in range(chunks):
            self.clock[0] += seconds / chunks
            assert self.runs is not None
            n = round(self.rate(self.runs) * seconds / chunks)
            self.rows += n
            if self.core_rate and self.runs.mode is not Mode.PROCESSES:
                self.cpu += n / self.core_rate
                self.pcpu += n / self.core_rate
            self.pcpu += self.other_cores * seconds / chunks
            if self.worker_cores is not None and self.runs.mode is Mode.PROCESSES:
                self.wcpu += self.worker_cores(self.runs) * seconds / chunks
            self.events += 1
            self.last = self.clock[0]


def _ticks(ch: Chooser, ctl: _Control, n: int) -> None:
    """Let ``n`` ticks of 20 ms pass on ``ctl``'s clock, the chooser ticking after each."""
    for _ in range(n):
        ctl.advance(0.02)
        ch.tick()


def test_a_window_after_a_switch_leaves_out_the_tasks_started_before_it():
    """From two threads to one, both threads' tasks still run: the window of one
    thread opens once two completions came in, so the second thread's last task
    is not counted as one thread's; with one task running it opens at the first."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    while ch.current != threads(1):
        ctl.tasks_running = 2
        ctl.advance(0.02)
        ch.tick()
    switched_at = ctl.events
    ctl.tasks_running = 1
    ctl.clock[0] += 0.001
    ctl.events += 1              # the first of the two tasks ends
    ctl.last = ctl.clock[0]
    ch.tick()
    assert ch._w0 is None        # not yet: the other task started under two threads
    ctl.clock[0] += 0.001
    ctl.events += 1              # the second ends: the window opens here
    ctl.last = ctl.clock[0]
    ch.tick()
    assert ch._w0 is not None and ch._w0.events == switched_at + 2
    # a switch with one task running opens at the first completion
    ch._switch(threads(2))
    ctl.tasks_running = 1
    ch._switch(threads(1))
    ctl.events += 1
    ctl.clock[0] += 0.001
    ctl.last = ctl.clock[0]
    ch.tick()
    assert ch._w0 is not None and ch._w0.events == ctl.events


def test_the_chooser_reads_a_window_as_long_as_the_decision_asks():
    """A duel's later rounds read longer windows (``Decision.window_scale``): the
    chooser closes the window only once it lasted that many least windows."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 3)
    assert ch.exploring and ch.record.windows
    assert all(w.seconds < 0.04 for w in ch.record.windows)
    n = len(ch.record.windows)
    ch.decision = dataclasses.replace(ch.decision, window_scale=3)
    while len(ch.record.windows) == n:
        _ticks(ch, ctl, 1)
    assert ch.record.windows[n].seconds == pytest.approx(0.06)


def test_the_window_not_used_after_a_switch_lasts_the_least_window_in_any_round():
    """The window after a switch waits out the switch (threads waking, a fork and
    its first replies), which takes as long in a duel's later rounds as in its
    first: it lasts the least window, not ``window_scale`` of them, and the
    reading after it lasts the round's length."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 3)
    n = len(ch.record.windows)
    ch.decision = dataclasses.replace(ch.decision, window_scale=4)
    ch._switch(processes(2))
    switched = clock[0]
    while ch._warmup:
        _ticks(ch, ctl, 1)
    assert clock[0] - switched == pytest.approx(0.04)  # opens at a completion, then 20 ms
    while len(ch.record.windows) == n:
        _ticks(ch, ctl, 1)
    assert ch.record.windows[n].candidate == processes(2)
    assert ch.record.windows[n].seconds == pytest.approx(0.08)


def _complete_until(ch: Chooser, ctl: _Control, windows: int) -> None:
    """One completion every 20 ms on ``ctl``'s clock, the chooser ticking after each,
    until its record holds ``windows`` windows."""
    while len(ch.record.windows) < windows:
        ctl.advance(0.02, chunks=1)
        ch.tick()


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_a_window_sees_its_completions_for_each_task_running_at_once(cores):
    """Rows arrive in chunks, a task's (or a worker's reply) at a time: a window cut at
    one task's completion counts the chunks the others are partway through at its
    ends, up to one each, or none of them; ``window_events`` completions for each
    task the candidate runs at once keep that within about one part in
    ``window_events`` on any core count.  Here one completion every 20 ms: the
    start's threads (one per core) read a window of ``4 x cores`` of them."""
    clock = [0.0]
    ch = Chooser(space(cores), clock=lambda: clock[0])
    ctl = _Control(gil_free(cores), clock)
    ch.begin_pass(ctl)
    _complete_until(ch, ctl, windows=1)
    w = ch.record.windows[0]
    assert w.candidate == threads(cores)
    assert w.seconds == pytest.approx(0.02 * PolicyConfig().window_events * cores)


@pytest.mark.parametrize("cores", [2, 16])
def test_the_window_not_used_sees_one_completion_per_task(cores):
    """The pass's first window is not used (threads waking): it lasts until each of
    the start's threads could have completed a task once, ``cores`` completions,
    not a reading's ``window_events`` each (64 tasks on 16 cores, each a GIL-bound
    row's worth).  One completion every 20 ms: the first reading closes at the
    completion after the first, plus ``cores``, plus its own ``4 x cores``.  The
    same after a switch to processes (on 16 cores a task is a batch: 64 replies
    were most of a short epoch)."""
    clock = [0.0]
    ch = Chooser(space(cores), clock=lambda: clock[0])
    ctl = _Control(gil_free(cores), clock)
    ch.begin_pass(ctl)
    _complete_until(ch, ctl, windows=1)
    events = PolicyConfig().window_events * cores
    assert ch.record.windows[0].seconds == pytest.approx(0.02 * events)
    assert clock[0] == pytest.approx(0.02 * (1 + cores + events))
    # after a switch to processes, likewise: each worker could have replied once
    ch._switch(processes(cores))
    switched = clock[0]
    _complete_until(ch, ctl, windows=2)
    assert ch.record.windows[1].candidate == processes(cores)
    assert ch.record.windows[1].seconds == pytest.approx(0.02 * events)
    assert clock[0] - switched == pytest.approx(0.02 * (1 + cores + events))


def test_a_window_a_full_collection_stalled_is_read_again_once():
    """A collection of the oldest generation stops every thread and lands in one
    window: that window is not a reading, the candidate's next is.  Where the
    window before saw one too (collections as frequent as windows), it counts."""
    clock = [0.0]
    ch = Chooser(space(16), clock=lambda: clock[0])
    ctl = _Control(gil_free(16), clock)
    ch.begin_pass(ctl)
    _complete_until(ch, ctl, windows=1)

    def close_one(collections: int) -> bool:
        """Run until the open window closes, ``collections`` full collections in
        it; whether it was recorded."""
        while ch._w0 is None:   # after a switch, the window opens at a completion
            ctl.advance(0.02, chunks=1)
            ch.tick()
        assert ch.exploring and ch._warmup == 0 and ch.current.mode is Mode.THREADS
        opened, n = ch._w0, len(ch.record.windows)
        ctl.collections += collections
        while ch._w0 is opened:
            ctl.advance(0.02, chunks=1)
            ch.tick()
        return len(ch.record.windows) > n

    assert close_one(0) is True
    assert close_one(1) is False and ch._stalled      # read again
    assert close_one(0) is True and not ch._stalled
    assert close_one(2) is False                      # read again
    assert close_one(1) is True                       # the one before stalled too
    assert close_one(0) is True


def test_a_full_collection_counted_by_the_pipeline_is_the_oldest_generations():
    """``gcpauses.count`` counts collections of generation 2, ``gc.collect()``'s
    included, not the young generations'."""
    import gc

    from asyncfeed._engine import gcpauses
    before = gcpauses.count()
    gc.collect(0)
    gc.collect(1)
    assert gcpauses.count() == before
    gc.collect()
    assert gcpauses.count() == before + 1


def test_the_chooser_settles_carries_over_and_rechecks_a_drift_at_a_bounded_cost():
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 200)
    assert not ch.exploring and ch.current == threads(2)
    ch.end_pass(ctl)
    # the next pass starts where it settled, measuring nothing new
    ctl2 = _Control(gil_free(2), clock)
    windows = len(ch.record.windows)
    ch.begin_pass(ctl2)
    assert ctl2.applied == [threads(2)]
    _ticks(ch, ctl2, 100)
    assert len(ch.record.windows) == windows and ctl2.applied == [threads(2)]
    # the rows turn GIL-bound: the rate drifts, a re-check moves to processes
    ctl2.rate = gil_bound(2)
    _ticks(ch, ctl2, 400)
    assert ch.current == processes(2) and ch.record.recheck_at, ch.record.recheck_at
    rechecks = len(ch.record.recheck_at)
    _ticks(ch, ctl2, 2000)  # steady: no more re-checks
    assert len(ch.record.recheck_at) == rechecks


def test_a_short_dip_of_a_settled_rate_is_not_a_drift():
    """Another process's burst: a dozen windows at half the rate, then back. The
    median of the last recheck_windows windows does not move: nothing is re-checked
    (and no worker process forked to find that out)."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    dip = {"on": False}
    ctl = _Control(lambda c: gil_free(2)(c) * (0.5 if dip["on"] else 1.0), clock)
    ch.begin_pass(ctl)
    _ticks(ch, ctl, 400)
    assert not ch.exploring and ch.current == threads(2)
    dip["on"] = True
    _ticks(ch, ctl, 12)
    dip["on"] = False
    _ticks(ch, ctl, 400)
    assert ch.record.recheck_at == [] and ch.current == threads(2)


def test_a_rate_that_rises_as_the_process_warms_up_is_not_a_drift():
    """The settled choice's first windows read 12% below what it reads from then on
    (the process still warming: its allocator, its caches).  The rate it is judged
    against is the median of as many settled windows as the drift, so a handful of
    early windows does not set it: nothing is re-checked."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    warm = {"factor": 1 / 1.12}
    ctl = _Control(lambda c: gil_free(2)(c) * warm["factor"], clock)
    ch.begin_pass(ctl)
    while ch.exploring:
        _ticks(ch, ctl, 1)
    _ticks(ch, ctl, 5)
    warm["factor"] = 1.0
    _ticks(ch, ctl, 600)
    assert ch.record.recheck_at == [] and ch.current == threads(2)


def test_no_window_opens_while_a_stage_that_was_left_still_runs_rows():
    """Leaving processes, the workers finish the rows they hold and their replies
    compete with the candidate now running: its windows start once they are in."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    ctl.drain_until = 0.5
    for _ in range(24):  # to 0.48 s
        _ticks(ch, ctl, 1)
        assert ch._w0 is None
    assert ch.record.windows == []
    _ticks(ch, ctl, 10)
    assert ch.record.windows  # (the first window after the drain is the warm-up)
    assert all(w.seconds < 0.2 for w in ch.record.windows)


def test_rechecks_back_off_on_a_rate_that_keeps_moving():
    """A rate that halves and recovers every 60 ms: the settled choice may drift
    again and again, and each re-check waits longer than the last (the settled
    windows it waits for double), so a handful run in 6000 ticks."""
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    flip = itertools.cycle([gil_free(2)] * 30 + [lambda c: gil_free(2)(c) * 0.5] * 30)
    ctl = _Control(lambda c: next(flip)(c), clock)
    ch.begin_pass(ctl)
    starts: list[int] = []  # the tick at which each re-check began
    for tick in range(6000):
        _ticks(ch, ctl, 1)
        if len(ch.record.recheck_at) > len(starts):
            starts.append(tick)
    assert len(starts) <= 8, starts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps), starts


def test_a_requested_candidate_runs_and_nothing_is_measured_after():
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ctl = _Control(gil_free(2), clock)
    ch.begin_pass(ctl)
    ch.request(processes(2))
    assert ctl.runs == processes(2) and ch.report().reason is Reason.FIXED
    n = len(ch.record.windows)
    _ticks(ch, ctl, 50)
    assert len(ch.record.windows) == n


def test_the_report_is_data_and_its_str_a_sentence():
    rec, _ = run(space(2), gil_bound(2))
    clock = [0.0]
    ch = Chooser(space(2), clock=lambda: clock[0])
    ch.record = rec
    ch.decision = decide(rec, space(2))
    ch.current = ch.decision.choice
    r = ch.report()
    assert (r.mode, r.count, r.reason) == (Mode.PROCESSES, 2, Reason.FASTER)
    assert {m.candidate for m in r.candidates} >= {threads(1), threads(2), processes(2)}
    text = str(r)
    assert text.startswith("processes: 2 worker processes (measured faster"), text
    assert "2 worker processes: 1,800 rows/s" in text, text
    assert not r.processes_first and "tried first" not in text
    # readings that show the threads serialised: the report says processes came first
    rec, _ = run(space(2), gil_bound(2), core_rate=1000.0, other_cores=0.1)
    ch.record, ch.decision = rec, decide(rec, space(2))
    ch.current = ch.decision.choice
    r = ch.report()
    assert r.processes_first and r.mode is Mode.PROCESSES, r
    assert "processes tried first: the threads ran the rows one at a time" in str(r)
    assert not r.processes_before_up and "before more threads" not in str(r)
    # one thread's rows that never waited: processes came before more threads
    rec, _ = run(space(2), partly_gil(2), core_rate=300.0)
    ch.record, ch.decision = rec, decide(rec, space(2))
    ch.current = ch.decision.choice
    r = ch.report()
    assert r.processes_before_up and not r.processes_first and r.mode is Mode.PROCESSES, r
    assert "processes tried before more threads: one thread beat the threads at the " \
           "cores, or its rows never waited" in str(r)


# ------------------------------------------------------- what exploring costs
def test_a_block_duel_starts_with_the_rival_when_the_choice_was_just_measured():
    """After the thread duel (A B A B), the choice's windows of that duel are its
    first block against processes: the next window runs processes.  (Windows in
    which the consumer only waited: the loader is the bottleneck.)"""
    sp = space(2)
    rec = Record([Window(c, 100, 0.1, 0.1) for c in (threads(2), threads(1)) * 2])
    d = decide(rec, sp)
    assert d.choice == threads(1) and d.run == processes(2), d
    rec.windows += [Window(processes(2), 190, 0.1, 0.1), Window(processes(2), 192, 0.1, 0.1)]
    d = decide(rec, sp)  # processes won: the inline duel starts with inline
    assert d.choice == processes(2) and d.run == INLINE, d


def test_a_block_duel_measures_the_choice_first_when_its_windows_are_old():
    """At a re-check the choice's windows of the first search are old: the re-check
    measures the incumbent again before its rival (the pass may have changed)."""
    sp = space(2)
    rec, _ = run(sp, gil_bound(2))
    assert decide(rec, sp).choice == processes(2)
    rec.recheck_at.append(len(rec.windows))
    assert decide(rec, sp).run == processes(2)


def _serialised_start() -> Window:
    """The start's first window of two threads that ran the rows one at a time (one
    core between them, the process a little more), the consumer waiting throughout."""
    return Window(threads(2), 100, 0.1, 0.1, 0.1, 0.105)


def test_processes_dueled_first_run_next_and_a_clear_lead_ends_the_duel():
    """The start's one window is the threads' block, begun: processes run next, and
    where both their windows read above it by more than twice their margin they
    win without the threads' second window."""
    sp = space(2)
    rec = Record([_serialised_start()])
    d = decide(rec, sp)
    assert d.processes_first and d.run == processes(2), d
    rec.windows += [Window(processes(2), 195, 0.1, 0.1), Window(processes(2), 200, 0.1, 0.1)]
    d = decide(rec, sp)
    assert d.choice == processes(2) and d.reason is Reason.FASTER, d
    assert d.run != threads(2) and sum(w.candidate == threads(2) for w in rec.windows) == 1
    assert (d.duels[0].cheap, d.duels[0].cheap_rate) == (threads(2), 1000.0)


def test_without_a_clear_lead_the_choice_completes_its_block_and_the_next_round_turns():
    """A lead within twice the margin: the threads complete their block after the
    processes' (A B B A); the duel is unsure, and its second round starts with the
    side that ran last (B B A A ... then A A B B), one switch fewer."""
    sp = space(2)
    rec = Record([_serialised_start(), Window(processes(2), 108, 0.1, 0.1),
                  Window(processes(2), 112, 0.1, 0.1)])
    d = decide(rec, sp)
    assert not d.settled and d.run == threads(2), d
    rec.windows.append(Window(threads(2), 100, 0.1, 0.1))
    d = decide(rec, sp)  # 10% ahead, the margin 5%: another round
    assert not d.settled and not d.duels and d.run == threads(2), d
    rec.windows += [Window(threads(2), 100, 0.1, 0.1)] * 2
    assert decide(rec, sp).run == processes(2)


def test_a_dearer_rivals_window_far_below_the_choice_ends_its_duel_at_once():
    """Four threads' first window reads below both of two threads' by more than
    their spread: the cheaper choice stays without the rival's second window."""
    sp = space(2, pool=4, inline=False, with_processes=False)
    rec = Record([Window(c, r, 0.1, 0.1) for c, r in
                  ((threads(2), 100), (threads(1), 50), (threads(2), 101), (threads(1), 51),
                   (threads(2), 100), (threads(4), 60), (threads(2), 101))])
    d = decide(rec, sp)
    assert d.settled and d.choice == threads(2) and d.reason is Reason.CHEAPER, d
    assert d.duels[-1].dear == threads(4) and d.duels[-1].winner == threads(2)
    assert sum(w.candidate == threads(4) for w in rec.windows) == 1


def _cheaper_rival_after(cheap: Candidate, slow: float) -> tuple[Space, Record]:
    """A duel whose cheaper rival ``cheap`` read one window of ``slow`` rows:
    inline, dueled last, against processes (175 and 192 rows); or one thread in
    the bottom duel, against two threads (100 and 90)."""
    if cheap == INLINE:
        windows = [Window(c, 100, 0.1, 0.1) for c in (threads(2), threads(1)) * 2] \
            + [Window(processes(2), 175, 0.1, 0.1), Window(processes(2), 192, 0.1, 0.1),
               Window(INLINE, slow, 0.1, 0.1)]
    else:
        windows = [Window(threads(2), 100, 0.1, 0.1), Window(threads(1), slow, 0.1, 0.1),
                   Window(threads(2), 90, 0.1, 0.1)]
    return space(2), Record(windows)


@pytest.mark.parametrize("cheap,slow,level", [(INLINE, 150, 183), (threads(1), 80, 95)],
                         ids=["inline", "one-thread"])
def test_a_cheaper_rivals_one_slow_window_decides_nothing(cheap, slow, level):
    """A cheaper rival's first window below every window of the dearer choice by
    more than their spread, but by less than twice it (another process's burst),
    does not hand the choice the duel: one window shows no spread of its own.  The
    rival runs on, and where its windows then read level, it stays."""
    sp, rec = _cheaper_rival_after(cheap, slow)
    d = decide(rec, sp)
    assert not d.settled and d.run == cheap, d
    while not d.settled:
        rec.windows.append(Window(d.run, level, 0.1, 0.1))
        d = decide(rec, sp)
    duel = next(u for u in d.duels if u.cheap == cheap)
    assert duel.winner == cheap and d.choice != duel.dear, d


@pytest.mark.parametrize("cheap,slow", [(INLINE, 120), (threads(1), 60)],
                         ids=["inline", "one-thread"])
def test_a_cheaper_rivals_window_beyond_twice_the_spread_below_ends_its_duel(cheap, slow):
    """The same duels where the cheaper rival's window reads below the choice's by
    more than twice their spread (the lead that decides a duel in one round): it
    loses without its second window."""
    sp, rec = _cheaper_rival_after(cheap, slow)
    d = decide(rec, sp)
    duel = next(u for u in d.duels if u.cheap == cheap)
    assert duel.winner == duel.dear and d.run != cheap, d
    assert sum(w.candidate == cheap for w in rec.windows[-3:]) == 1


def test_a_first_processes_window_far_below_the_threads_does_not_end_its_duel():
    """Processes may still be starting in their first counted window."""
    sp = space(2)
    rec = Record([Window(c, 100, 0.1, 0.1) for c in (threads(2), threads(1)) * 2]
                 + [Window(processes(2), 20, 0.1, 0.1)])
    d = decide(rec, sp)
    assert not d.settled and d.run == processes(2), d


def test_a_window_spans_four_of_the_interpreters_gil_switch_intervals(monkeypatch):
    import sys
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.002)
    assert PolicyConfig().window_seconds() == pytest.approx(0.008)
    assert PolicyConfig(window_s=0.05).window_seconds() == 0.05


def test_the_workers_rows_per_cpu_second_leave_out_what_a_row_costs_to_send_back():
    """Two windows of 100 rows, each on 0.3 CPU seconds of the workers: 333 rows per
    CPU second; 1 ms a row left out (the pickling), 200 rows on 0.4 s: 500; a cost
    that would leave no CPU (3 ms a row) is not left out; no CPU known, no rate."""
    from asyncfeed._engine.bounds import workers_core_rate
    ws = [Window(processes(2), 100, 0.1, 0.0, 0.0, 0.0, 0.3) for _ in range(2)]
    assert workers_core_rate(ws) == pytest.approx(100 / 0.3)
    assert workers_core_rate(ws, 1e-3) == pytest.approx(100 / 0.2)
    assert workers_core_rate(ws, 3e-3) == pytest.approx(100 / 0.3)
    assert workers_core_rate([Window(processes(2), 100, 0.1)], 1e-3) == 0.0
