"""What the windows show of how threads ran the rows orders a search: the
parts of the policy's replay (``policy._Replay``) that move processes or inline
ahead of the thread ladder, or processes ahead of the walk down or the climb,
where the readings show the thread ladder cannot win what they can.  Each
reorders what is tried; the duels still decide (see :mod:`.policy`).
"""

from __future__ import annotations

from .duel import Duel, spread
from .readings import Candidate, Mode, Window
from .searchbounds import SearchBounds

__all__ = ["SearchOrder"]


class SearchOrder(SearchBounds):
    """The reorderings of the policy's module docstring, over a search's state (set
    by the replay that subclasses it)."""

    phases: list[str]
    mine: list[Window]
    theirs: list[Window]
    round: int
    rungs: tuple[Candidate, ...]
    single_step: bool
    process: Candidate | None
    processes_first: bool
    inline_before_threads: bool
    processes_before_up: bool
    processes_before_down: bool
    climb_from: Candidate | None
    deferred: tuple[list[Window], list[Window], int] | None
    tried: set[Candidate]

    def _advance(self) -> None:
        raise NotImplementedError

    def _rung(self, c: Candidate) -> int:
        return self.rungs.index(c) if c in self.rungs else -1

    def _order_processes_first(self) -> bool:
        """After the start's first window of the first search: where its threads ran
        the rows one at a time (:meth:`_serialised`), inline comes before the thread
        ladder, and processes before both where they could win; open the first of
        them now (see the module docstring).  True where the order changed."""
        if self.phases[:1] != ["bottom"] or self.single_step or self.processes_first \
                or self.inline_before_threads \
                or self.theirs or len(self.mine) != 1 or self.choice != self.space.start \
                or self.choice.mode is not Mode.THREADS or self.choice.count < 2 \
                or not self._serialised(self.mine):
            return False
        # fewer threads run the rows one at a time too, so they can only tie the
        # start; inline, cheaper than any, pays no hand-off: where it stays, no
        # thread count can beat it by the margin, and the ladder is not walked
        moved = self.space.inline and "inline" in self.phases
        if moved:
            self.inline_before_threads = True
            self.phases.remove("inline")
            self.phases.insert(0, "inline")
        if self._processes_go_first():
            moved = self.processes_first = True
            self.phases.remove("processes")
            self.phases.insert(0, "processes")
        if moved:
            self._advance()
        return moved

    def _processes_go_first(self) -> bool:
        """Whether processes, where the start's threads ran the rows one at a time,
        are dueled first: not where they could be skipped in their own phase (the
        consumer already takes no more; the hand-off bounds them below one core's
        rate of the rows, what fewer threads or inline may still reach; or the
        process leaves them no more than a core)."""
        if self.process is None or "processes" not in self.phases:
            return False
        first, m = self.mine[0], self._margin()
        return not (first.ceiling <= first.rate * (1 + m)
                    or self._core_rate() * (1 + m) >= self._handoff_bound()
                    or min(self._cores_left(), self.process.count) <= 1 + m)

    def _order_processes_before_down(self) -> bool:
        """After the bottom duel that the start won: where the start's threads ran
        the rows short of their reach from one thread's rate (``min(threads, cores
        left)`` times it, beyond the margin) and fewer threads are left to walk
        down, processes come before them (see the module docstring); True where
        they do."""
        i = self._rung(self.choice)
        if self.single_step or self.process is None or "down" not in self.phases \
                or "processes" not in self.phases or i < 1 \
                or self.rungs[i - 1] in self.tried or not self._short_of_reach():
            return False
        self.processes_before_down = True
        self.phases.remove("processes")
        self.phases.insert(self.phases.index("down"), "processes")
        return True

    def _defer_bottom(self, duel: Duel) -> bool:
        """After a round of the bottom duel that leaves it open (``unsure``): where
        neither side's reading lets the start's threads scale (the start's rate
        short of ``min(threads, cores left)`` times one thread's, beyond the
        margin), processes are dueled against the start now, and the bottom duel
        goes on after them only if they lose (see the module docstring); True
        where they are."""
        if self.phases[:1] != ["bottom"] or self.single_step or self.process is None \
                or "processes" not in self.phases or self.deferred is not None:
            return False
        if self._scales(duel.dear_rate, duel.dear.count, duel.cheap_rate, duel.margin):
            return False
        self.deferred = (self.mine, self.theirs, self.round + 1)
        # the duel's margin is what ``unsure`` reads again over more windows: the
        # bounds that may skip processes take the start's own spread meanwhile
        self.margin, self.choice_rate = spread([w.rate for w in self.mine]), duel.dear_rate
        self.processes_before_down = True
        self.phases.remove("processes")
        self.phases.insert(0, "processes")
        self._advance()
        return True

    def _order_processes_before_up(self) -> None:
        """After the bottom duel: processes come before more threads (see the module
        docstring) where one thread beat the start (threads do not scale past one:
        the climb could gain a little, processes the cores) and the climb has a
        rung to try, or where the start won, one thread's rows never waited (its
        windows kept the process a core busy, within ``min_margin``: the rows, or
        the rows and the process's own Python between them) and the next rung up
        runs more threads than the cores, or where the start won held back
        (:meth:`_start_held_back`: short of its reach from one thread, the process
        busy).  Windows that do not know their CPU keep the order in the last two
        cases.  Where processes then win, in the first case the climb starts from
        the one thread they beat, each rung dueled against them (within its reach:
        :meth:`_beyond_reach`); in the others it is over (more threads than the
        cores gain only by overlapping a wait; threads held back by what they share
        gain nothing)."""
        i = self._rung(self.choice)
        if self.single_step or self.process is None or "up" not in self.phases \
                or "processes" not in self.phases or i < 0 or i + 1 >= len(self.rungs) \
                or self.rungs[i + 1] in self.tried:
            return
        if self.choice == self.space.start and not self._start_held_back() \
                and (self.rungs[i + 1].count <= self.space.cores
                     or not self._solo_never_waited()):
            return
        self.processes_before_up = True
        self.climb_from = self.choice if self.choice != self.space.start else None
        self.phases.remove("processes")
        self.phases.insert(self.phases.index("up"), "processes")
