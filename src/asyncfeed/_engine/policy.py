"""Where a map-style pass's samples run, chosen by the measured outcome.

``docs/architecture.md`` ("Choosing the execution") gives the rule in a page and
what was measured; this docstring states each step exactly, as :func:`decide`
replays it.

The candidates are what a ``DataLoader`` user picks by hand, and ours:

* ``inline``: the consumer's thread loads the rows while it waits for a batch
  (``num_workers=0``);
* ``threads(n)``: ``n`` decode threads run the rows;
* ``processes(n)``: ``n`` worker processes run them and write into shared memory.

Each candidate runs on the real pass for short *windows*; a window's reading is
the rows the pass completed per second of wall time.  That rate is what the
training loop gets: when the loader is the bottleneck it is the loader's
speed, and when the consumer is, every candidate that keeps up reads the
consumer's rate, so the cheaper one stays.

Two candidates are compared in a *duel*: their windows alternate (A B A B; in
blocks where processes or inline are one side, A A B B then B B A A) so that a
drift of the pass's speed falls on both.  A block duel whose choice was read
just before (the duel before, or the start's window that ordered the search)
takes those windows as (the start of) the choice's first block and starts with
the rival's; a dearer rival whose block leads them by more than twice its
margin wins without the rest of the choice's block.  The *noise margin* is the
spread between like windows of the same duel (the larger of the two
candidates' relative spreads, at least ``PolicyConfig.min_margin``).  The
dearer candidate (order: inline, then threads by count, then processes) wins
only where its median rate beats the cheaper one's by more than that margin;
otherwise the cheaper one stays.  Where the dearer one led by more than
``min_margin`` less the noise beyond it, but by less than twice the margin
(noise alone gives a lead of one margin in about one duel of six; a margin read
from one round is one difference between two windows, which one slow window
sets alone, dragging its side's median too: ``duel.unsure``), the duel goes on
for another round, judged on all its windows (up to ``max_rounds``), each
window twice as long as the last round's (the noise of a machine's scheduler
averages out over a window's length, as it does not over more windows); a rival
whose first window reads below every window of the choice by more than their
spread (twice it for a cheaper rival: ``duel.hopeless``) loses at once, unless it
is processes, which may still be starting.  A cheaper side that keeps up with the
consumer (its rate within the margin of the consumer's pace) stays whatever the
dearer reads: the consumer takes no more.  Signals (the GIL probe, a row's CPU
time) explain the choice in ``stats()``; they never decide.

The search, replayed from the record by :func:`decide` (a pure function):

1. *bottom*: duel the start candidate (threads at the cores) against one
   thread, the bottom of the ladder.  Where one thread stays, threads do not
   scale past it (the GIL, or contention): the rungs between are not walked,
   and the search climbs from one thread instead (step 3).  This keeps the
   search to a few duels however many cores there are, where rows that hold
   the GIL would otherwise walk every rung of a long ladder before reaching
   processes;
2. *down*: where the start won, duel the next cheaper thread count of the
   ladder (half the threads, ...) while the cheaper one stays;
3. *up*: if no cheaper count won, duel the next dearer one while it wins --
   unless the choice already runs the rows at the cores' rate: one process's
   threads use at most ``min(threads, cores left)`` cores (the cores less what
   the consumer and the hand-offs keep busy, as in step 4), each at most at the
   rows per CPU second the choice's windows read (cores side by side share
   caches, memory and their siblings' pipelines: each runs a row slower than
   one core alone, and more threads beside them would too), so where the
   choice's rate is within the margin of that bound, more threads cannot win.
   Where the choice just beat fewer threads, the climb *leaps*: its rival is the
   first rung whose threads, each adding the choice's rate per thread, would
   meet that bound (or the top rung) -- the next rung for rows that use the
   cores they have, many rungs up for rows that wait (on storage, a device, the
   network), which leave the process idle.  After a leap that wins, the rungs
   leapt over that could still tie it (their count times the rate per thread of
   the rung below them that was measured, within the margin of the choice) are
   searched by halves, each dueled against the choice (the cheaper stays on a
   tie); after one that loses, the climb steps a rung at a time.  So the climb
   takes a few duels however long the ladder, where a rung at a time costs one
   for each doubling of the threads;
4. *processes*: duel the best so far against the process candidate, unless the
   measured rates leave processes no room: ``min(cores left, workers)``
   processes cannot go faster than that many times one thread's measured rate
   (one thread alone runs the per-sample function at a core's speed), nor than
   that many cores at the rows per CPU second the choice's threads read side by
   side (processes side by side share the cores' caches and memory as much),
   where the cores left are the cores less what this process kept busy besides
   the rows under the choice (the consumer's own work goes on under processes
   too); where the best rate is already within the margin of either bound the
   duel is skipped.
   One thread's rate is measured for this where no duel did, and read again
   where the few windows read kept the process less than a core busy (a window of
   the pass's first rows waits as no worker would), up to ``like_windows`` of
   them; the bound takes the fastest.  Where workers
   would send each row back pickled (a custom ``collate_fn``: rows are not
   written in place), the loader's process reads each one back, holding the
   GIL: ``1 / unpickle_s`` rows a second at most, and each row costs its own
   CPU, its pickling and its unpickling on the cores left (``Record.handoff``,
   measured on the pass's own rows before its first window: a row's share of a
   batch where the workers collate whole batches); a choice within the margin
   of that bound skips the duel too.
   Where the worker count is the loader's own (no ``num_workers``), once the
   processes were measured (won or lost), duel twice the workers against the
   choice (*4b*), unless the choice's rate is within twice the margin of what
   they could deliver: the rows per CPU second the workers read (their CPU comes
   back with each task) times the cores, less what this process took meanwhile,
   and at most the rows per CPU second of this process's own (its share of a row
   runs under one GIL) -- a bound read from the same few windows: within one
   margin of it is noise -- or within the margin of the hand-off's bound.
   Workers below that did not get the cores -- other processes share them, and
   more workers take a larger share, as a ``DataLoader`` user gives more
   workers than cores -- or waited, and more workers overlap the waits.  One
   rung only: each worker is a process, with its memory.
5. *inline*: duel inline (the consumer loads the rows itself) against
   whatever won -- unless it won at a rate beyond one core's rate of the rows
   (the most rows per CPU second of a thread window, or of the workers' windows
   pooled less the pickling of the rows they send back, plus the margin; each
   reading counts CPU inline does not spend, so the bound reads low): inline
   runs them on one thread, so it cannot win.  Not inferred from one thread's
   duel: inline pays no task hand-off, so for tiny rows it runs far ahead of
   one thread, and may beat threads that beat one thread.  Processes
   come before inline so that rows whose threads do not scale reach processes
   after one duel.

Signals order the search, never decide it: where the start's first window
shows its threads ran the rows one at a time (together they took no more than
one core, within ``min_margin``, or the whole process took no more -- the rows'
CPU counts the tasks that ended in the window, whole -- while the whole process
was busy on one core or more: the GIL, held by the rows or the consumer's own
Python, serialised them),
step 4 comes first, without one thread's solo windows for its bound -- fewer
threads cannot beat threads that already ran one at a time, and processes are
the one candidate that can (rows that wait on storage leave the process idle
instead, and keep the order) -- and step 5 comes next, before step 1: fewer
threads could only tie the start, and inline, cheaper than any thread count and
paying no hand-off, ends the search where it stays (step 4 against an inline
choice is bounded by inline's rows per CPU second).  Where processes won, inline
meets the one-core bound; where inline lost, the search goes on from step 1.  Likewise,
where the start won step 1 and one thread's rows never waited (its windows
kept the process a core busy, within ``min_margin``: the rows, or the rows and
the consumer's Python that took the GIL between them), step 4 comes before
step 3 where step 3 would run more threads than the cores: threads past the
cores gain only by overlapping a wait, and rows that hold the GIL part of the
time (two threads beat one, but not by the cores) would spend step 3's duel
there before reaching processes.  So too, whatever one thread's windows read
(the pass's first rows may have waited), where the start won step 1 short of
its reach from one thread's rate (``min(threads, cores left)`` times it,
beyond the margin) while the process kept a core busy under it: what held the
threads back is something they share (the GIL, the cores' caches), not
storage, whose waits leave the process idle.  Where processes won, step 3 has
no thread choice to climb from; where they lost, it follows.  Where one thread won step 1
(the start's threads do not scale past one: the GIL, or contention) and step 3
has a rung to climb to, step 4 comes before step 3 too: the climb can gain what
a few threads overlap, processes the cores.  Where processes won, the climb then
starts from the one thread they beat, each rung dueled against them while it
wins (a rung whose reach, as in step 3, cannot beat them by the margin is not
dueled); where they lost, it follows as usual.  And where the start won step
1 by less than its threads could (its rate short of ``min(threads, cores left)``
times one thread's, beyond the margin: the GIL or contention stopped them
scaling), step 4 comes before step 2: fewer threads could only match the start
at a lower cost, processes may go faster (on many cores each rung of the walk
down is a duel of its own first).
Where step 1's first round leaves it open (the start led by more than
``min_margin`` but within twice the margin: ``duel.unsure``) and the start's
rate is short of that reach all the same, step 4 comes then, against the start:
more rounds would only choose between thread counts that processes may beat,
and they are what a short epoch of rows that hold the GIL part of the time
spends exploring.  Step 4's bounds are then beaten by the start's own spread,
not by that round's margin: the margin is what the open duel reads again (one
slow window sets it alone).  Where processes lose, step 1 goes on from its
windows for the rounds it had left, and the search from there.

Then the choice is *settled*: later windows, and later passes of the same
loader, run it without exploring.  Where the median of the last
``recheck_windows`` settled windows (as many as the wait below) leaves the
median of its first as many settled windows by more than twice the duel's margin
(:func:`drifted`, read by the chooser), the choice is *re-checked* with its
neighbours (one rung each way, processes, inline): a dip shorter than half
those windows does not move their median.  Re-checks wait ``recheck_windows``
windows after the last and double that wait (and the windows judged) each
time, so their cost stays bounded.

Nothing here depends on the core count: the ladder is derived from it, the
bound scales with it, the margin is measured.
"""

from __future__ import annotations

from .bounds import workers_bound
from .decision import Decision, fixed
from .duel import Duel, PolicyConfig, clear_lead, drifted, hopeless, judge, spread, unsure
from .readings import (INLINE, Candidate, Handoff, Mode, Reason, Record, Space, Window,
                       processes, threads)
from .searchorder import SearchOrder

__all__ = ["INLINE", "Candidate", "Decision", "Duel", "Handoff", "Mode", "PolicyConfig",
           "Reason", "Record", "Space", "Window", "decide", "drifted", "fixed", "judge",
           "processes", "threads"]


class _Replay(SearchOrder):
    """The search of the module docstring, stepped window by window."""

    def __init__(self, space: Space, config: PolicyConfig, unavailable: bool,
                 handoff: Handoff | None = None) -> None:
        self.space = space
        self.config = config
        self.handoff = handoff
        self.rungs = space.ladder  # threads only: inline has a phase of its own
        self.choice = space.start
        self.reason = Reason.ONLY
        self.duels: list[Duel] = []
        self.margin = 0.0
        self.choice_rate: float | None = None   # the choice's mean rate in its last duel
        self.process = None if unavailable else space.process
        self.more = None if unavailable else space.more_processes
        self.more_skipped: Reason | None = None
        self.skipped: Reason | None = Reason.UNAVAILABLE \
            if unavailable and space.process is not None else None
        self.inline_skipped: Reason | None = None
        self.threads_skipped: Reason | None = None
        self.solo: list[Window] = []   # one thread's windows (the processes bound)
        self.seen: list[Window] = []   # every window so far
        self.fresh: list[Window] = []  # the windows of this search (since a re-check)
        self.phases = ["bottom", "down", "up", "processes", "inline"]
        self.single_step = False       # a re-check: one duel a phase
        self.tried: set[Candidate] = set()
        self.moved = False             # the current phase moved the choice
        self.rival: Candidate | None = None
        self.soloing = False
        # the start's threads ran the rows one at a time, so processes were dueled
        # first, and inline before the thread ladder
        self.processes_first = False
        self.inline_before_threads = False
        self.processes_before_up = False  # processes came before the climb (step 3)
        self.processes_before_down = False  # the start's threads fell short of scaling
        # the thread choice that processes were dueled against before the climb (step
        # 3): where they won, the climb starts from it
        self.climb_from: Candidate | None = None
        # the bottom duel left open for processes: its windows and next round
        self.deferred: tuple[list[Window], list[Window], int] | None = None
        self.mine: list[Window] = []
        self.theirs: list[Window] = []
        self.block_side: Candidate = self.choice  # a block duel's side that ran last
        # after a leap of the climb that won: the rung it leapt from (or the last
        # leapt-over rung that lost to the choice) and its rate
        self.leap_base: tuple[Candidate, float] | None = None
        self._advance()

    def _rival_in(self, phase: str) -> Candidate | None:
        """The next duel of ``phase`` (None: the phase is over)."""
        i = self._rung(self.choice)
        if phase in ("up", "processes") and self._keeps_up():
            self.skipped = self.skipped or Reason.CONSUMER
            return None
        if phase == "bottom":
            one = threads(1)
            if self.single_step or one not in self.rungs or one in self.tried or i <= 0:
                return None
            return one
        if phase in ("down", "up"):
            if phase == "up" and self.choice == self.process and self.climb_from is not None:
                i = self._rung(self.climb_from)  # processes came first and won
            if i < 0 or (self.single_step and self.moved):
                return None
            if phase == "down" and self.leap_base is not None:
                return self._leap_probe()
            j = i - 1 if phase == "down" else i + 1
            if 0 <= j < len(self.rungs) and self.rungs[j] not in self.tried:
                if phase == "up" and self._beyond_reach(self.rungs[j], self.rungs[i]):
                    self.threads_skipped = Reason.NO_ROOM
                    return None
                return self.rungs[self._leap(i)] if phase == "up" else self.rungs[j]
            return None
        if phase == "inline":
            # the cheapest, dueled last: whatever won, unless it runs the rows beyond
            # the one core inline has (one thread losing says nothing of inline,
            # which pays no task hand-off: for tiny rows it runs far ahead of it)
            if not self.space.inline or INLINE in self.tried or self.choice == INLINE \
                    or (self.single_step and self.moved):
                return None
            if self._beyond_one_core():
                self.inline_skipped = Reason.NO_ROOM
                return None
            return INLINE
        p = self.process
        if p is not None and (p in self.tried or self.choice == p):
            return self._more_processes(p)
        if p is None:
            return None
        if self._reaches(self._handoff_bound()):
            self.skipped = Reason.HANDOFF
            return None
        per_core = self._core_rate(self.choice)
        if per_core and self._reaches(min(self._cores_left(), p.count) * per_core):
            self.skipped = Reason.NO_ROOM
            return None
        if threads(1) in self.rungs:
            # one thread's fastest window: a window of the pass's first rows reads
            # below a core's speed; where the few read waited, one more is read
            solo = max((w.rate for w in self.solo), default=None)
            if solo is None or (len(self.solo) < self.config.like_windows
                                and self._solo_never_waited() is False):
                if self.processes_first:
                    return p  # threads ran one at a time: no bound to measure first
                self.soloing = True
                return None
            if self._reaches(min(self._cores_left(), p.count) * solo):
                self.skipped = Reason.NO_ROOM
                return None
        return p

    def _more_processes(self, p: Candidate) -> Candidate | None:
        """Twice the workers of ``p``, measured (won or lost), if worth a duel against
        the choice (step 4b of the module docstring): not where the choice is within
        twice the margin of what they could deliver, the rows per CPU second ``p``'s
        workers read times the cores (less what this process took meanwhile), or
        of what this process can take, the rows per CPU second of its own (its
        share of a row -- the results read, the batch assembled, the consumer's
        own work -- runs under one GIL: one core's worth at most), nor within the
        margin of the hand-off's bound.  Workers that read below that did not get
        the cores (other processes share them: more workers take a larger share)
        or waited (more overlap the waits).  Twice the margin: the
        bound is read from the same few windows, the workers' CPU reported a task
        at a time, and twice the workers must then beat the choice by the margin
        again; a fork of twice the workers is not spent on less."""
        more = self.more
        if more is None or more in self.tried or more == self.choice \
                or (self.single_step and self.moved):
            return None
        for windows in (self.fresh, self.seen):
            bound = workers_bound([w for w in windows if w.candidate == p], more.count,
                                  self.space.cores)
            if bound is not None:
                break
        else:
            return None
        if (self.choice_rate or 0.0) * (1 + 2 * self._margin()) >= bound \
                or self._reaches(self._handoff_bound()):
            self.more_skipped = Reason.NO_ROOM
            return None
        return more

    def _advance(self) -> None:
        """Open the next duel (or one thread's solo windows), or settle."""
        self.mine, self.theirs = [], []
        self.round = 1
        while self.phases:
            rival = self._rival_in(self.phases[0])
            if self.soloing:
                self.rival = None
                return
            if rival is not None:
                self.rival = rival
                self.mine = self._recent_of(self.choice) if self._in_blocks() else []
                self.block_side = self.rival if self.mine else self.choice
                if self.phases[0] == "bottom" and self.deferred is not None:
                    self.mine, self.theirs, self.round = self.deferred  # it goes on
                    self.deferred = None
                return
            self.phases.pop(0)
            self.moved = False
        self.rival = None

    def _in_blocks(self) -> bool:
        return bool({Mode.PROCESSES, Mode.INLINE} & {self.choice.mode, self.rival.mode}) \
            if self.rival is not None else False

    def _recent_of(self, c: Candidate) -> list[Window]:
        """The choice's first block of a block duel, or its start: its last windows
        of this search, up to ``like_windows``, among the last ``3 * like_windows``
        (the duel just ended, or the one before; the start's window that ordered
        the search): read moments ago, as a fresh block would read.  Older windows
        are not used (the pass may have changed)."""
        n = self.config.like_windows
        return [w for w in self.fresh[-3 * n:] if w.candidate == c][-n:]

    @property
    def settled(self) -> bool:
        return self.rival is None and not self.soloing

    def next_run(self) -> Candidate:
        """Which candidate the next window runs: alternating within a duel, window by
        window between thread counts (a switch takes effect at the next task); in
        blocks where processes or inline are one side, each until it has its round's
        windows, a round starting with the side that ran last.  The chooser does not
        count the window after such a switch (the workers' pipeline refills, or the
        consumer first takes the ready batches): one window a block."""
        if self.soloing:
            return threads(1)
        if self.rival is None:
            return self.choice
        if self._in_blocks():
            n = self.config.like_windows * self.round
            side = self.block_side
            ran = len(self.mine) if side == self.choice else len(self.theirs)
            if ran >= n:
                return self.rival if side == self.choice else self.choice
            return side
        return self.choice if len(self.mine) <= len(self.theirs) else self.rival

    def feed(self, w: Window) -> None:
        self.seen.append(w)
        self.fresh.append(w)
        if w.candidate == threads(1):
            self.solo.append(w)
        if self.soloing:
            if len(self.solo) >= self.config.like_windows:
                self.soloing = False
                self._advance()
            return
        rival = self.rival
        if rival is None:
            return
        if w.candidate == self.choice:
            self.mine.append(w)
        elif w.candidate == self.rival:
            self.theirs.append(w)
        else:
            return
        self.block_side = w.candidate
        if self._order_processes_first():
            return
        n = self.config.like_windows * self.round
        if len(self.mine) < n or len(self.theirs) < n:
            if not self._hopeless() and not self._clear_lead():
                return
        duel = judge(self.mine, self.theirs, self.config)
        if len(self.theirs) >= n and self.round < self.config.max_rounds \
                and unsure(duel, self.config):
            if not self._defer_bottom(duel):
                self.round += 1  # the dearer read faster, not clearly beyond the noise
            return
        self.duels.append(duel)
        self.tried.update((rival, self.choice))
        self.margin = duel.margin
        won = duel.winner
        if won != self.choice:
            self.moved = True
        self.choice = won
        self.reason = Reason.FASTER if won == duel.dear else Reason.CHEAPER
        self.choice_rate = duel.dear_rate if won == duel.dear else duel.cheap_rate
        phase = self.phases[0]
        if phase == "bottom":
            self.phases.pop(0)  # one duel
            if won == duel.cheap:
                # one thread stayed: no count below the start can win; climb from one
                self.phases.remove("down")
                self._order_processes_before_up()
            elif not self._order_processes_before_down():
                self._order_processes_before_up()
            self.moved = False
        elif phase == "up" and self._leapt(duel):
            if won == rival:
                # the rungs leapt over are searched from the rung that won, while
                # any could still tie it (:meth:`_leap_probe`)
                self.leap_base = (duel.cheap, duel.cheap_rate)
                self.phases.insert(0, "down")
            # where the leap lost, the climb goes on one rung at a time
        elif phase == "down" and self.leap_base is not None and won != rival:
            self.leap_base = (duel.cheap, duel.cheap_rate)  # the rungs above it are left
        elif phase in ("down", "up") and won != rival:
            # the walk goes on while the rung it tries wins (in the climb after
            # processes, the rung is dueled against them)
            self.phases.pop(0)
            self.moved = False
            self.leap_base = None
        self._advance()

    def _leap(self, i: int) -> int:
        """The rung the climb duels next from rung ``i`` (the choice, which just beat
        fewer threads): the first rung whose threads, each adding the choice's
        rate per thread, would reach the cores' bound (the cores left at the
        choice's rows per CPU second, as in :meth:`_beyond_reach`), or the top
        rung; the next one where that is no further.  Rows that use the cores
        they have meet the bound at the next rung; rows that wait (on storage, a
        device, the network) leave the process idle and meet it many rungs up.
        The rungs leapt over are searched after a leap that wins, while any could
        still tie it (:meth:`_leap_probe`); after one that loses, the climb steps
        one rung at a time.  So rows that wait reach their thread count in a few
        duels however long the ladder, where a rung at a time costs a duel for
        each doubling; a leap that loses costs one duel."""
        step = i + 1
        if self.single_step or self.choice.mode is not Mode.THREADS \
                or self.choice != self.rungs[i]:
            return step
        last = self.duels[-1] if self.duels else None
        if last is None or last.winner != self.choice or last.dear != self.choice \
                or last.cheap.mode is not Mode.THREADS or not self.choice_rate:
            return step
        per_core = self._core_rate(self.choice)
        if not per_core:
            return step
        needed = self.choice.count * self._cores_left() * per_core / self.choice_rate
        k = next((k for k in range(step, len(self.rungs)) if self.rungs[k].count >= needed),
                 len(self.rungs) - 1)
        return k if self.rungs[k] not in self.tried else step

    def _leapt(self, duel: Duel) -> bool:
        """Whether ``duel`` was a leap of the climb: its dearer side more than one
        rung above its cheaper."""
        return duel.cheap.mode is Mode.THREADS and duel.dear.mode is Mode.THREADS \
            and self._rung(duel.dear) > self._rung(duel.cheap) + 1

    def _leap_probe(self) -> Candidate | None:
        """After a leap of the climb that won, the next rung leapt over to duel against
        the choice: of those above the rung the leap started from (or the last
        such rung that lost) that could still tie the choice -- that rung's rate
        scaled by their counts (as far as threads that each add their rate go)
        within the margin of the choice's -- the middle one (the lower of two).
        Where it stays (the cheaper, as good), the search goes on below it; where
        it loses, above it: a few duels for many rungs.  None where no rung is
        left (the walk is over)."""
        assert self.leap_base is not None
        base, base_rate = self.leap_base
        left = [c for c in self.rungs[self._rung(base) + 1:self._rung(self.choice)]
                if c not in self.tried and c.count / base.count * base_rate
                * (1 + self._margin()) >= (self.choice_rate or 0.0)]
        if not left:
            self.leap_base = None
            return None
        return left[(len(left) - 1) // 2]

    def _hopeless(self) -> bool:
        """The rival lost before its second window (``duel.hopeless``, by twice the
        lead where it is the cheaper); not for a rival that is processes, whose
        first windows may still be starting up."""
        return self.round == 1 and self.rival is not None \
            and self.rival.mode is not Mode.PROCESSES \
            and hopeless(self.mine, self.theirs, self.config,
                         cheaper=self.rival.cost < self.choice.cost)

    def _clear_lead(self) -> bool:
        """The rival, the dearer, won a block duel before the choice's block was
        complete (``duel.clear_lead``)."""
        return self.round == 1 and self._in_blocks() and self.rival is not None \
            and self.rival.cost > self.choice.cost \
            and clear_lead(self.mine, self.theirs, self.config)

    def start_recheck(self) -> None:
        """Duel the choice with its neighbours again (see the module docstring)."""
        self.tried = set()
        self.single_step = True
        self.moved = False
        self.skipped = Reason.UNAVAILABLE if self.skipped is Reason.UNAVAILABLE else None
        self.inline_skipped = None
        self.threads_skipped = None
        self.more_skipped = None
        self.climb_from = None  # a re-check steps one rung from the choice itself
        self.leap_base = None
        self.fresh = []
        self.phases = ["down", "up", "processes", "inline"]
        self._advance()


def decide(record: Record, space: Space, config: PolicyConfig = PolicyConfig()) -> Decision:
    """What runs next, replayed from ``record`` (pure: the same record, space and
    config always give the same decision)."""
    r = _Replay(space, config, record.failed_starts >= config.start_attempts,
                record.handoff)
    rechecks = set(record.recheck_at)
    for i, w in enumerate(record.windows):
        if i in rechecks and r.settled:
            r.start_recheck()
        r.feed(w)
    if len(record.windows) in rechecks and r.settled:
        r.start_recheck()
    return Decision(run=r.next_run(), choice=r.choice, settled=r.settled,
                    reason=r.reason if r.settled else Reason.EXPLORING,
                    duels=tuple(r.duels), margin=r.margin, choice_rate=r.choice_rate,
                    processes_skipped=r.skipped,
                    rival=threads(1) if r.soloing else r.rival,
                    inline_skipped=r.inline_skipped, threads_skipped=r.threads_skipped,
                    processes_first=r.processes_first,
                    inline_before_threads=r.inline_before_threads and INLINE in r.tried,
                    # reordered, but skipped by a bound in their turn: not tried
                    processes_before_up=r.processes_before_up and r.skipped is None,
                    processes_before_down=r.processes_before_down and r.skipped is None,
                    window_scale=2 ** (r.round - 1) if r.rival is not None else 1,
                    more_processes_skipped=r.more_skipped)
