"""This process's share of the machine and of the job: rank and world size, the cores
it may use, and how many decode threads that makes by default."""

from __future__ import annotations

import os


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each given, else torch.distributed's, else RANK/WORLD_SIZE,
    else (0, 1).  A world size given without a rank takes the rank from the same
    sources; one of several ranks with no rank anywhere is an error."""
    import torch.distributed as dist
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else \
            int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        if initialised:
            rank = dist.get_rank()
        elif "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        elif isinstance(world_size, int) and world_size > 1:
            raise ValueError(f"world_size={world_size} needs a rank: pass rank=, initialise "
                             "torch.distributed, or set RANK")
        else:
            rank = 0
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    return rank, world_size


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """Decode threads by default: this process's share of the cores, plus up to two.

    The share is the cores this process may use divided by ``LOCAL_WORLD_SIZE``
    (set by torchrun: the ranks on this node), unless the affinity already
    gives each rank its own cores.  The spare threads keep every core busy when
    a thread stalls (a page-cache miss, the GIL, a preempted virtual CPU).
    """
    cores = available_cores()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    total = os.cpu_count() or cores
    share = cores if cores < total else max(1, cores // local)
    return share + min(2, share)
