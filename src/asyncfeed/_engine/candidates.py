"""Where a loader's rows may run, from its arguments: the chooser it starts with."""

from __future__ import annotations

from .chooser import Chooser
from .config import LoaderConfig
from .policy import INLINE, Candidate, Reason, Space, processes, threads
from .resources import available_cores


def make_chooser(cfg: LoaderConfig, *, iterable: bool, use_fetch: bool) -> Chooser:
    """The execution chooser for ``cfg.execution``: a fixed candidate where the
    arguments fix one (``inline``, ``processes``, ``num_threads=N``, an
    ``IterableDataset``), else the candidates to measure."""
    execution, workers, num_threads = cfg.execution, cfg.workers, cfg.num_threads
    pinned: Candidate | None = None
    if iterable:  # a stream's items are read in order by the threads
        return Chooser(None, threads(num_threads), Reason.ONLY)
    if execution == "inline":
        pinned = INLINE
    elif execution == "processes" and use_fetch:
        # reads on the event loop feed the decode threads: no process stage there
        return Chooser(None, threads(num_threads), Reason.ONLY)
    elif execution == "processes":
        pinned = processes(workers)
    elif cfg.threads_given:
        pinned = threads(num_threads)
    if pinned is not None:
        return Chooser(None, pinned)
    cores = available_cores()
    # past the pool's threads, up to the rows in flight (rows that wait overlap more)
    ladder = Space.thread_ladder(cores, num_threads, cfg.prefetch * (cfg.batch_size or 1))
    start = threads(min(cores, num_threads))
    with_processes = execution == "auto" and not use_fetch
    # a timeout bounds the wait for rows loaded elsewhere: rows the consumer loads
    # itself cannot be timed out (as DataLoader's num_workers=0), so a loader given
    # one never chooses inline
    # twice the workers, where their count is the loader's own: num_workers given is
    # the user's count, as DataLoader's
    more = processes(2 * workers) if with_processes and cfg.num_workers == 0 else None
    return Chooser(Space(ladder=ladder, start=start, cores=cores,
                         process=processes(workers) if with_processes else None,
                         inline=execution == "auto" and not cfg.timeout,
                         more_processes=more))
