"""A decision of the execution policy (:func:`.policy.decide`): what runs next, the
choice so far and why, as data."""

from __future__ import annotations

from dataclasses import dataclass

from .duel import Duel
from .readings import Candidate, Mode, Reason

__all__ = ["Decision", "fixed"]


@dataclass(frozen=True)
class Decision:
    """What to run next.

    ``run``: the candidate for the next window.  ``choice``: the best so far (the
    incumbent).  ``settled``: no duel is open (``run == choice``).  ``reason``:
    why ``choice`` stands.  ``duels``: the duels judged so far, in order.
    ``margin``: the margin of the last duel; ``choice_rate``: the choice's mean
    rate there.  ``processes_skipped``: why processes were not measured
    (``NO_ROOM``: the bound of one thread's rate, or of the rows' rate per core
    under the choice's threads; ``HANDOFF``: the bound of a
    row's trip back from a worker; ``UNAVAILABLE``: they could not start), or None.
    ``rival``: the candidate the open duel measures against the choice (one thread
    while its rate alone is measured), None when settled.  ``inline_skipped``:
    ``NO_ROOM`` where threads or processes won by more than one core's rate of the
    rows, which is all inline can run; else None.  ``threads_skipped``: ``NO_ROOM`` where more
    threads were not measured because the rows already ran at the cores' rate
    (rows per CPU second of the choice's windows together, times the cores left
    to them, less the margin); else None.  ``processes_first``: the start's threads
    ran the rows one at a time, so processes were dueled first (the search's order).
    ``inline_before_threads``: the start's threads ran the rows one at a time, so
    inline was dueled before the thread ladder (after processes, where they came
    first).
    ``processes_before_up``: processes were dueled before more threads (the
    search's order): one thread beat the start, or one thread's rows never
    waited and more threads would be more than the cores.
    ``processes_before_down``: the start's threads beat one thread, or read open
    against it after one round, but ran the rows short of that many times its
    rate, so processes were dueled before fewer threads (the search's order).
    ``window_scale``: the next window lasts this many times the least window (its
    length and completions): twice the last round's in each round of a duel.
    ``more_processes_skipped``: ``NO_ROOM`` where processes were measured but
    twice their workers were not, their workers having kept busy every core they
    could have; else None."""

    run: Candidate
    choice: Candidate
    settled: bool
    reason: Reason
    duels: tuple[Duel, ...] = ()
    margin: float = 0.0
    choice_rate: float | None = None
    processes_skipped: Reason | None = None
    rival: Candidate | None = None
    inline_skipped: Reason | None = None
    threads_skipped: Reason | None = None
    processes_first: bool = False
    inline_before_threads: bool = False
    processes_before_up: bool = False
    processes_before_down: bool = False
    window_scale: int = 1
    more_processes_skipped: Reason | None = None

    def most_threads(self) -> int:
        """The most threads the candidates of the open duel run (inline and processes
        count one: the consumer, or the dispatch), or the choice's when settled."""
        sides = (self.choice,) if self.rival is None else (self.choice, self.rival)
        return max(c.count if c.mode is Mode.THREADS else 1 for c in sides)


def fixed(candidate: Candidate, reason: Reason = Reason.FIXED) -> Decision:
    """The decision for a candidate the user chose (or the only one there is)."""
    return Decision(run=candidate, choice=candidate, settled=True, reason=reason)
