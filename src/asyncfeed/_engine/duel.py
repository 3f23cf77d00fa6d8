"""A duel of two candidates' windows, judged: each side's rate, the noise margin
measured between like windows, and the winner (see :mod:`.policy` for the
search that runs the duels); whether a settled choice's rate drifted; and the
parameters the policy runs on."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from .readings import Candidate, Window

__all__ = ["Duel", "PolicyConfig", "clear_lead", "drifted", "hopeless", "judge", "spread",
           "unsure"]


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's parameters; each holds on any core count.

    ``window_s``: a window lasts at least this long; None (the default): four
    of the interpreter's GIL switch intervals (``sys.getswitchinterval()``, 5 ms
    unless the program changed it: 20 ms).  A thread that wants the GIL waits
    up to one interval for it, so a window of four lets each of two contending
    threads hold it at least twice; shorter windows measure whose turn it was.
    Longer ones only make exploring dearer (a window runs a candidate that may
    be the slower one): the noise a window still shows is measured, as the
    duel's margin.  A duel's later rounds read windows twice as long as the
    round before's (``Decision.window_scale``).  ``window_events``: and sees at
    least this many completions (tasks or worker replies) for each task the
    candidate runs at once (its threads or workers; one inline): rows arrive in
    chunks, and a window of one chunk measures the chunk; cut at one task's
    completion, a window counts the chunks the other tasks are partway through
    at its ends (up to one each, or none), so as many completions per task keep
    that within about one part in ``window_events`` on any core count.
    ``like_windows``: windows per side of a duel round (two are the least that
    show a spread).
    ``min_margin``: the least margin a dearer candidate must beat: a switch
    costs what no window shows (a fork, workers' memory, threads' CPU), and
    below this gain stability is worth more.  ``recheck_windows``: settled
    windows before the first re-check may run (doubling after each).
    ``warmup_windows``: a pass's first windows after a start or a switch that
    are not used (threads waking, the buffers filling); such a window sees one
    completion for each task the candidate runs at once, not ``window_events``,
    and lasts ``window_s`` in any round of a duel (it is no reading, and on many
    cores a reading's length is many tasks each, a whole short epoch for sixteen
    workers; the switch it waits out takes no longer in a later round).  ``start_attempts``:
    how often the process candidate may fail to start (the decode threads did
    not go quiet for the fork) before it counts as unavailable.  ``max_rounds``:
    a duel whose dearer side led the cheaper by more than ``min_margin``, but by
    less than twice the margin, is measured again with as many windows more, up
    to this many rounds, before it is decided (the medians firm up; the spread,
    a median of steps, no longer rests on one step).
    """

    window_s: float | None = None
    window_events: int = 4
    like_windows: int = 2
    min_margin: float = 0.05
    recheck_windows: int = 40
    warmup_windows: int = 1
    start_attempts: int = 3
    max_rounds: int = 3

    def window_seconds(self) -> float:
        """The least length of a window, in seconds (see ``window_s``)."""
        return self.window_s if self.window_s is not None else 4 * sys.getswitchinterval()


@dataclass(frozen=True)
class Duel:
    """A judged duel: the cheaper and dearer candidate, their mean rates, the
    margin measured, and the winner."""

    cheap: Candidate
    dear: Candidate
    cheap_rate: float
    dear_rate: float
    margin: float
    winner: Candidate


def spread(rates: list[float]) -> float:
    """How far like windows read apart: the median difference between successive
    ones, relative to their median (for two windows, their range over their
    mean).  Medians, because a shared machine's noise is heavy-tailed: one
    window whose threads lost their cores for a while reads a fraction of the
    others, and must not decide the duel, nor its margin, alone."""
    if len(rates) < 2:
        return 0.0
    m = statistics.median(rates)
    steps = statistics.median(abs(b - a) for a, b in zip(rates, rates[1:]))
    return steps / m if m > 0 else 0.0


def judge(a: list[Window], b: list[Window], config: PolicyConfig) -> Duel:
    """The duel of the windows ``a`` and ``b`` (each of one candidate): each side's
    rate is the median of its windows."""
    ca, cb = a[0].candidate, b[0].candidate
    cheap, dear = (a, b) if ca.cost <= cb.cost else (b, a)
    rc = statistics.median(w.rate for w in cheap)
    rd = statistics.median(w.rate for w in dear)
    margin = max(config.min_margin, spread([w.rate for w in cheap]),
                 spread([w.rate for w in dear]))
    # the cheaper side that keeps up with the consumer (its rate within the margin of
    # the consumer's own pace) cannot be beaten: the dearer reads faster only by noise
    ceiling = statistics.median(w.ceiling for w in cheap)
    keeps_up = ceiling != float("inf") and rc * (1 + margin) >= ceiling
    winner = dear[0].candidate if rd > rc * (1 + margin) and not keeps_up \
        else cheap[0].candidate
    return Duel(cheap[0].candidate, dear[0].candidate, rc, rd, margin, winner)


def unsure(duel: Duel, config: PolicyConfig) -> bool:
    """Whether a duel's windows leave its outcome open: the dearer read faster than
    the cheaper by more than ``min_margin``, but by less than twice the margin.
    Each side's rate is a median of a few windows, and the margin is a spread of
    as few: a lead of one margin is what noise alone gives about one duel in
    six, so such a lead must hold over another round's windows; and a lead inside
    a margin set by two windows is that one difference, which a slow window (a
    start still under way, another process's burst) makes alone, so the margin
    is read again over more windows.

    The lead that must be beaten for this is ``min_margin`` less the noise the
    windows showed beyond it (``margin - min_margin``): a slow window that widens
    the margin also drags its side's median (of two windows, their mean) down,
    so a dearer side that reads level with the cheaper, or behind it, while its
    windows read that far apart may still lead.  Where the windows read no
    further apart than ``min_margin`` a lead inside it is not measured again:
    the cheaper stays, as it would after more rounds of two candidates that
    read alike."""
    noise = duel.margin - config.min_margin
    return duel.cheap_rate * (1 + config.min_margin) < duel.dear_rate * (1 + noise) \
        and duel.dear_rate <= duel.cheap_rate * (1 + 2 * duel.margin)


def hopeless(choice: list[Window], rival: list[Window], config: PolicyConfig,
             cheaper: bool = False) -> bool:
    """Whether the rival's one window read below every window of the choice (a
    round's worth of them) by more than their spread (at least ``min_margin``), or,
    for a rival ``cheaper`` than the choice, by more than twice that: it cannot
    win, and the duel ends without its second window (a slow candidate's windows
    are what exploring costs).  Ending a dearer rival's duel early keeps the
    cheaper choice, as more windows would; ending a cheaper rival's hands the
    dearer the win, which its median must earn by the spread of the cheaper
    side's windows too, and one window shows none.  So the cheaper rival's one
    window must read beyond the lead that decides a duel in one round (twice the
    margin: see :func:`unsure`)."""
    if len(rival) != 1 or len(choice) < config.like_windows:
        return False
    mine = [w.rate for w in choice]
    lead = max(config.min_margin, spread(mine)) * (2 if cheaper else 1)
    return rival[0].rate * (1 + lead) < min(mine)


def clear_lead(choice: list[Window], rival: list[Window], config: PolicyConfig) -> bool:
    """Whether the rival, with its first block read, leads the choice, of which
    fewer than a block were read, by more than twice the margin of its own windows
    (at least ``min_margin``) in each of them: a lead beyond twice the margin is
    decided whatever the rest of the choice's block would read, so the duel ends
    without it."""
    n = config.like_windows
    if len(rival) < n or not 0 < len(choice) < n:
        return False
    m = max(config.min_margin, spread([w.rate for w in rival]))
    return min(w.rate for w in rival) > max(w.rate for w in choice) * (1 + 2 * m)


def drifted(settled_rate: float, recent: list[float], margin: float,
            config: PolicyConfig = PolicyConfig()) -> bool:
    """Whether the settled choice's recent window rates left its band: their median
    off ``settled_rate`` by more than twice the duel's margin (at least twice
    ``min_margin``).  Needs ``like_windows * 2`` recent readings."""
    if settled_rate <= 0 or len(recent) < 2 * config.like_windows:
        return False
    band = 2 * max(margin, config.min_margin)
    m = statistics.median(recent)
    return abs(m - settled_rate) / settled_rate > band
