"""The execution policy replayed on readings recorded from real passes.

Each file in ``traces/`` is one run of ``bench/record_choice.py``: a data set
written as users write them, a fresh process, a default ``AsyncLoader`` on this
project's 2-core machine, alone or beside a busy-looping process started for
the run (``neighbour``; ``load1`` says how busy the machine was, other work
included), until its choice settled.  The file holds the chooser's record (every window:
candidate, rows, seconds, the consumer's wait, the rows' CPU in this process, and in the
workers in traces recorded since it is read; the cost of a row's trip back from a worker
process, in traces recorded since it is read), its space, the choice the live run made,
and ``expect``: what the readings show, checked by hand when the trace was recorded
(the execution, and its count where it says one).

Replaying a record through ``policy.decide`` must give the live run's choice
(the driver applied every decision as ``decide`` made it), and that choice
must be the expected one.  A rule change that would decide one of these runs
otherwise fails here; re-record (and re-check ``expect``) when that is the
intent.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from asyncfeed._engine.policy import (Candidate, Mode, PolicyConfig, Record, Space, decide,
                                      judge, threads)

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json"))


def _load(path: Path) -> tuple[dict, Record, Space]:
    d = json.loads(path.read_text())
    return d, Record.from_dict(d["record"]), Space.from_dict(d["space"])


def _decided():
    """Each trace replayed: (its name, record, space, decision)."""
    for path in TRACES:
        _, rec, sp = _load(path)
        yield path.stem, rec, sp, decide(rec, sp)


def _skipping(skip: str):
    """The replayed traces whose decision skipped a duel (``skip``: the decision's
    ``inline_skipped`` or ``threads_skipped``): (name, record, space, decision)."""
    return [t for t in _decided() if getattr(t[3], skip) is not None]


def _core_rate(rec: Record) -> float:
    """The most rows per CPU second a thread window of ``rec`` read."""
    return max(w.rows / w.cpu for w in rec.windows
               if w.candidate.mode is Mode.THREADS and w.cpu > 0)


def _choice_core_rate(rec: Record, choice: Candidate) -> float:
    """Rows per CPU second over the windows of ``rec`` that ran ``choice`` (threads),
    together."""
    ws = [w for w in rec.windows if w.candidate == choice and w.cpu > 0]
    return sum(w.rows for w in ws) / sum(w.cpu for w in ws)


def test_there_are_traces_of_every_kind_quiet_and_beside_other_load():
    kinds = {"gil", "sha", "mixed", "jpeg", "augment", "noop", "dicts", "tokens", "cifar", "sleepy",
             "spectro", "pngs", "reads"}
    quiet = {p.name.split("-")[0] for p in TRACES if not json.loads(p.read_text())["neighbour"]}
    busy = {p.name.split("-")[0] for p in TRACES if json.loads(p.read_text())["neighbour"]}
    assert kinds <= quiet and kinds <= busy, (quiet, busy)


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_a_recorded_run_replays_to_its_own_choice(path):
    d, rec, sp = _load(path)
    got = decide(rec, sp)
    assert got.settled == d["settled"]
    assert [got.choice.mode.value, got.choice.count] == d["choice"], got
    exp = d["expect"]
    assert got.choice.mode.value in exp["modes"], (got, exp)
    if "count" in exp:
        assert got.choice.count == exp["count"], (got, exp)


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_every_duel_of_a_recorded_run_follows_the_rule(path):
    """Judged again from the windows alone: the dearer side won exactly where its
    mean beat the cheaper side's by more than the spread of like windows."""
    _, rec, sp = _load(path)
    for duel in decide(rec, sp).duels:
        dear_won = duel.winner == duel.dear
        assert dear_won == (duel.dear_rate > duel.cheap_rate * (1 + duel.margin)), duel
        assert duel.margin >= PolicyConfig().min_margin


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_no_window_of_a_recorded_run_is_lost_or_foreign(path):
    """Every window ran a candidate of the space, and the replay asks, prefix by
    prefix, for the candidate the next window ran (where the live run did not
    switch for another reason: a start that failed, a request)."""
    d, rec, sp = _load(path)
    allowed = set(sp.rungs()) | {c for c in (sp.process, sp.more_processes) if c is not None}
    assert {w.candidate for w in rec.windows} <= allowed
    if rec.failed_starts == 0:
        for k in range(len(rec.windows)):
            prefix = Record(rec.windows[:k], rec.recheck_at, handoff=rec.handoff)
            assert decide(prefix, sp).run == rec.windows[k].candidate, k


def test_twice_the_workers_are_forked_beside_busy_processes_not_on_a_quiet_machine():
    """Recorded with the process rung above: beside a busy loop, runs whose workers
    had part of their cores measured twice the workers, which won; quiet runs
    whose workers kept their cores busy did not fork them."""
    crowded = quiet = 0
    for path in TRACES:
        d, rec, sp = _load(path)
        if sp.more_processes is None:
            continue
        got = decide(rec, sp)
        ran = {w.candidate for w in rec.windows}
        if d["neighbour"]:
            crowded += got.choice == sp.more_processes
        elif got.choice == sp.process:
            assert sp.more_processes not in ran and got.more_processes_skipped is not None, path
            quiet += 1
    assert crowded >= 2 and quiet >= 3, (crowded, quiet)


def test_a_duel_is_symmetric_in_its_arguments():
    path = next(p for p in TRACES if p.name.startswith("gil"))
    _, rec, _ = _load(path)
    by: dict[Candidate, list] = {}
    for w in rec.windows:
        by.setdefault(w.candidate, []).append(w)
    a, b = [ws for ws in by.values() if len(ws) >= 2][:2]
    assert judge(a, b, PolicyConfig()) == judge(b, a, PolicyConfig())
    assert statistics.fmean(w.rate for w in a) > 0
    assert Mode.THREADS in {w.candidate.mode for w in rec.windows}


def test_inline_is_skipped_only_where_the_choice_read_beyond_one_core():
    """Where a recorded run skipped inline, its choice's rate (processes, or threads
    that scale) was above the most rows per CPU second any of its thread windows
    read; at least one quiet run with pure Python rows and one with GIL-free rows
    skipped it."""
    skipped = _skipping("inline_skipped")
    for stem, rec, sp, d in skipped:
        assert d.choice.mode is not Mode.INLINE and d.choice_rate is not None
        assert d.choice_rate > _core_rate(rec) * (1 + PolicyConfig().min_margin), stem
    assert {"gil-quiet-0", "sha-quiet-0"} <= {t[0] for t in skipped}, skipped


def test_more_threads_are_skipped_only_where_the_rows_ran_at_every_cores_rate():
    """Where a recorded run did not measure more threads, its choice's rate was
    within the margin of the cores left to the rows (the cores less what the
    process spent besides them, under the choice) times the rows per CPU second
    of the choice's windows together; the quiet runs of GIL-free hashing and
    decoding skipped them."""
    skipped = _skipping("threads_skipped")
    for stem, rec, sp, d in skipped:
        assert d.choice.mode is Mode.THREADS and d.choice_rate is not None
        other = statistics.median(w.other_cores for w in rec.windows
                                  if w.candidate == d.choice and w.other_cores > 0)
        bound = max(1.0, sp.cores - other) * _choice_core_rate(rec, d.choice)
        assert d.choice_rate * (1 + d.margin) >= bound, stem
        assert not any(w.candidate.mode is Mode.THREADS and w.candidate.count > d.choice.count
                       for w in rec.windows), stem
    assert {"sha-quiet-0", "jpeg-quiet-0"} <= {t[0] for t in skipped}, skipped


def test_rows_that_wait_leap_over_the_rungs_that_could_not_tie_the_rung_leapt_to():
    """Rows that wait on a long ladder (1 to 64 threads): the climb leaps from two
    threads to the rung that could meet the cores, and the rungs between whose
    reach from two threads' rate (their counts over two, times it) falls short
    of the leap's rate by the margin never run; a run of the rung-by-rung climb
    would have measured four threads."""
    leapt = 0
    for path in TRACES:
        if not path.name.startswith("reads"):
            continue
        _, rec, sp = _load(path)
        got = decide(rec, sp)
        leap = next(du for du in got.duels if du.cheap == threads(2) and du.dear.count > 4)
        assert leap.winner == leap.dear, leap
        ran = {w.candidate for w in rec.windows}
        for c in sp.ladder:
            if 2 < c.count < leap.dear.count \
                    and c.count / 2 * leap.cheap_rate * (1 + leap.margin) < leap.dear_rate:
                assert c not in ran, (path.stem, c)
        assert threads(4) not in ran, path.stem
        leapt += 1
    assert leapt == 2
