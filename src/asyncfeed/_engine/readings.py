"""What the execution policy reads and names: the candidates (inline, threads,
processes) and why one runs, the space a loader may choose in, and the record of
window readings :func:`.policy.decide` replays.  Plain data, no rule (the rule
is :mod:`.policy`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["INLINE", "Candidate", "Handoff", "Mode", "Reason", "Record", "Space", "Window",
           "pooled_cores", "processes", "rows_and_cpu", "threads"]


class Mode(str, enum.Enum):
    """Where rows run."""

    INLINE = "inline"
    THREADS = "threads"
    PROCESSES = "processes"


_MODE_ORDER = {Mode.INLINE: 0, Mode.THREADS: 1, Mode.PROCESSES: 2}


@dataclass(frozen=True, order=False)
class Candidate:
    """One way to run a pass's rows: a mode and its thread or worker count."""

    mode: Mode
    count: int = 0

    @property
    def cost(self) -> tuple[int, int]:
        """Cheaper first: inline, then threads by count, then processes by count."""
        return (_MODE_ORDER[self.mode], self.count)

    def __str__(self) -> str:
        if self.mode is Mode.INLINE:
            return "inline"
        unit = "thread" if self.mode is Mode.THREADS else "worker process"
        plural = "" if self.count == 1 else ("s" if self.mode is Mode.THREADS else "es")
        return f"{self.count} {unit}{plural}"


INLINE = Candidate(Mode.INLINE, 0)


def threads(n: int) -> Candidate:
    return Candidate(Mode.THREADS, n)


def processes(n: int) -> Candidate:
    return Candidate(Mode.PROCESSES, n)


class Reason(str, enum.Enum):
    """Why the current candidate runs."""

    FIXED = "fixed"                  # the user chose it (execution=, num_threads=)
    ONLY = "only"                    # nothing else can run this pass
    EXPLORING = "exploring"          # a duel is being measured
    FASTER = "faster"                # it beat the cheaper one by more than the margin
    CHEAPER = "cheaper"              # the dearer one did not beat it by the margin
    NO_ROOM = "no_room"              # processes cannot beat it (the measured bound)
    HANDOFF = "handoff"              # rows would travel back from processes too dearly
    CONSUMER = "consumer"            # it keeps up with the consumer: nothing dearer can win
    UNAVAILABLE = "unavailable"      # the process candidate could not start
    THREAD_BOUND = "thread_bound"    # rows failed in decode threads, loaded in the consumer's


@dataclass(frozen=True)
class Window:
    """One window's reading: ``rows`` completed in ``seconds`` under ``candidate``,
    while the consumer waited ``waited`` of those seconds for batches, and the rows
    took ``cpu`` seconds of this process's threads (0: not known, or rows that ran
    in worker processes); ``process_cpu``: the CPU seconds this whole process took
    meanwhile, every thread (0: not known); ``workers_cpu``: the CPU seconds worker
    processes took on the window's rows (0: not known, or none ran there)."""

    candidate: Candidate
    rows: int
    seconds: float
    waited: float = 0.0
    cpu: float = 0.0
    process_cpu: float = 0.0
    workers_cpu: float = 0.0

    @property
    def core_rate(self) -> float:
        """Rows per CPU second of the rows: what one core runs them at (0 where the
        rows' CPU is not known)."""
        return self.rows / self.cpu if self.cpu > 0 else 0.0

    @property
    def other_cores(self) -> float:
        """Cores this process kept busy besides the rows (the consumer's own work,
        the loader's hand-offs): what its CPU beyond the rows' was per second.
        0 where either is not known."""
        if self.process_cpu <= 0 or self.cpu <= 0 or self.seconds <= 0:
            return 0.0
        return max(0.0, self.process_cpu - self.cpu) / self.seconds

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def ceiling(self) -> float:
        """The most any candidate could have delivered: the consumer's own pace, had
        it never waited (infinite where it always waited)."""
        busy = self.seconds - self.waited
        return self.rows / busy if busy > 0 else float("inf")


@dataclass(frozen=True)
class Space:
    """What may run: the thread ladder (cheapest first), whether inline may run, the
    process candidate (None: not available), the cores, and where to start.
    ``more_processes``: the process rung above ``process`` (twice its workers), or
    None where the worker count is the user's or processes are not available."""

    ladder: tuple[Candidate, ...]
    start: Candidate
    cores: int
    process: Candidate | None = None
    inline: bool = True
    more_processes: Candidate | None = None

    @staticmethod
    def thread_ladder(cores: int, pool: int, most: int = 0) -> tuple[Candidate, ...]:
        """1, 2, 4, ... threads up to the cores, then the cores, then the pool's size,
        then twice the pool, four times, ... up to ``most`` (the rows a pass has in
        flight: more threads would find none to run).  Rungs past the cores gain only
        by overlapping rows that wait; the search climbs to them only while each
        rung beats the one below."""
        counts = []
        n = 1
        while n < min(cores, pool):
            counts.append(n)
            n *= 2
        counts += [min(cores, pool), pool]
        n = 2 * pool
        while n <= most:
            counts.append(n)
            n *= 2
        return tuple(threads(c) for c in sorted(set(counts)))

    def to_dict(self) -> dict[str, object]:
        return {"ladder": [c.count for c in self.ladder], "start": self.start.count,
                "cores": self.cores, "inline": self.inline,
                "process": self.process.count if self.process is not None else None,
                "more_processes": self.more_processes.count
                if self.more_processes is not None else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Space:
        return cls(ladder=tuple(threads(int(n)) for n in d["ladder"]),
                   start=threads(int(d["start"])) if int(d["start"]) else INLINE,
                   cores=int(d["cores"]),
                   process=processes(int(d["process"])) if d.get("process") else None,
                   inline=bool(d.get("inline", True)),
                   more_processes=processes(int(d["more_processes"]))
                   if d.get("more_processes") else None)

    def rungs(self) -> tuple[Candidate, ...]:
        """Every candidate of the ladder, cheapest first (inline first, if allowed)."""
        return ((INLINE,) if self.inline else ()) + self.ladder


@dataclass(frozen=True)
class Handoff:
    """The CPU seconds a row costs to travel from a worker process to the loader's,
    measured on rows a pass loaded: ``pickle_s`` in the worker, ``unpickle_s`` in
    the loader's process (holding its GIL).  Both 0 where workers write rows in
    place (shared memory) instead of sending them."""

    pickle_s: float
    unpickle_s: float

    IN_PLACE: ClassVar[Handoff]


Handoff.IN_PLACE = Handoff(0.0, 0.0)


@dataclass
class Record:
    """The readings a loader has taken: its windows in order, the re-checks and
    failed process starts it asked for, and what worker processes would add per row
    (``handoff``: None while not known).  ``decide`` replays it from the start."""

    windows: list[Window] = field(default_factory=list)
    recheck_at: list[int] = field(default_factory=list)  # window counts that re-checked
    failed_starts: int = 0
    handoff: Handoff | None = None

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON): for traces replayed in tests and bench reports."""
        return {"windows": [[w.candidate.mode.value, w.candidate.count, w.rows, w.seconds,
                             w.waited, w.cpu, w.process_cpu, w.workers_cpu]
                            for w in self.windows],
                "recheck_at": list(self.recheck_at), "failed_starts": self.failed_starts,
                "handoff": None if self.handoff is None
                else [self.handoff.pickle_s, self.handoff.unpickle_s]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls([Window(Candidate(Mode(w[0]), int(w[1])), int(w[2]), float(w[3]),
                           float(w[4]) if len(w) > 4 else 0.0,
                           float(w[5]) if len(w) > 5 else 0.0,
                           float(w[6]) if len(w) > 6 else 0.0,
                           float(w[7]) if len(w) > 7 else 0.0) for w in d["windows"]],
                   [int(i) for i in d.get("recheck_at", [])], int(d.get("failed_starts", 0)),
                   None if d.get("handoff") is None
                   else Handoff(float(d["handoff"][0]), float(d["handoff"][1])))


def rows_and_cpu(windows: list[Window], *, inline: bool) -> tuple[int, float]:
    """The rows of ``windows`` that ran in this process and know their CPU (thread
    windows, and inline ones with ``inline``), and those rows' CPU seconds: pooled,
    as one core's rate of the rows is read."""
    ws = [w for w in windows if w.cpu > 0 and (w.candidate.mode is Mode.THREADS
                                               or (inline and w.candidate.mode is Mode.INLINE))]
    return sum(w.rows for w in ws), sum(w.cpu for w in ws)


def pooled_cores(windows: list[Window], *, whole: bool) -> tuple[float, float] | None:
    """The cores the rows of ``windows`` took (their CPU per second, pooled) and the
    cores the whole process took, over the windows that know their rows' CPU (and,
    with ``whole``, the process's); None where none does."""
    ws = [w for w in windows if w.cpu > 0 and w.seconds > 0 and (w.process_cpu > 0 or not whole)]
    if not ws:
        return None
    secs = sum(w.seconds for w in ws)
    return sum(w.cpu for w in ws) / secs, sum(w.process_cpu for w in ws) / secs
