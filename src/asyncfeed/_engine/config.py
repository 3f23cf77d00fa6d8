"""What an :class:`~asyncfeed.AsyncLoader` runs with: its arguments, checked and
resolved once into a frozen :class:`LoaderConfig`."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._memory.device import resolve_device, resolve_pin
from ..protocols import DeviceTransfer
from .resources import available_cores, default_threads, resolve_ranks

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class LoaderConfig:
    """An ``AsyncLoader``'s settings after defaults are resolved.

    ``num_threads`` is the decode thread count (``threads_given``: the user fixed
    it); ``workers`` the worker processes when they run (``num_workers``, or the
    cores when that is 0); ``seed`` is None where a ``generator`` given with it
    wins; ``device`` and ``pin_memory`` are resolved (``transfer``: batches go
    through a device transfer); ``prefetch`` is the batches loaded ahead.
    """

    batch_size: int | None
    shuffle: bool
    drop_last: bool
    timeout: float
    num_workers: int
    workers: int
    persistent_workers: bool
    snapshot_every_n_steps: int | None
    in_order: bool
    on_error: OnError
    seed: int | None
    io_concurrency: int
    prefetch: int
    prefetch_given: bool
    readahead_bytes: int | None
    num_threads: int
    threads_given: bool
    device: torch.device | None
    pin_memory: bool
    transfer: bool
    execution: str
    rank: int
    world_size: int
    progress: bool
    log_every: float | None


def check_args(*, timeout: float, on_error: str, num_threads: int | None,
               io_concurrency: int, prefetch: int | None, readahead_bytes: int | None,
               log_every: float | None, seed: int | None,
               copy_stream: DeviceTransfer | None) -> None:
    """Raise ``ValueError``/``TypeError`` for an asyncfeed argument out of range
    (DataLoader's own arguments are checked by :func:`.plan.validate`)."""
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    if not isinstance(io_concurrency, int) or io_concurrency < 1:
        raise ValueError(f"io_concurrency must be a positive int, got {io_concurrency!r}")
    if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
        raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
    if readahead_bytes is not None and (not isinstance(readahead_bytes, int)
                                        or readahead_bytes < 0):
        raise ValueError(f"readahead_bytes must be None or an int >= 0, "
                         f"got {readahead_bytes!r}")
    if log_every is not None and not (isinstance(log_every, (int, float))
                                      and log_every > 0):
        raise ValueError(f"log_every must be a positive number of seconds, got {log_every!r}")
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if copy_stream is not None and not isinstance(copy_stream, DeviceTransfer):
        raise TypeError(f"copy_stream must be a DeviceTransfer (pin, to_device, "
                        f"hand_over), got {type(copy_stream).__name__}")


def _seed_beside(seed: int | None, generator: torch.Generator | None,
                 world_size: int) -> int | None:
    """The seed that shuffles: given with a generator, the generator wins (warning)
    except on several ranks, whose shards are shuffled by the seed."""
    if seed is None or generator is None:
        return seed
    if world_size > 1:
        # the sharded plan shuffles as DistributedSampler does: by seed, not generator
        warnings.warn("both seed and generator given with world_size > 1: shards are "
                      "shuffled by the seed, the generator is ignored", stacklevel=4)
        return seed
    warnings.warn("both seed and generator given: the generator is used, the "
                  "seed ignored", stacklevel=4)
    return None


def default_prefetch(batch_size: int | None, num_threads: int, use_fetch: bool,
                     io_concurrency: int) -> int:
    """Batches loaded ahead by default: enough rows in flight for every thread."""
    per_batch = batch_size or 1
    # rows in flight: four per thread (a task may hold two rows that mostly
    # wait, see tasksize.rows_per_task; with many threads the consumer's cadence
    # needs the slack: 128 threads of 5 ms sleeps ran 7% faster with it)
    want = 4 * num_threads
    if use_fetch:
        want = max(want, io_concurrency)
    return max(2, min(64, math.ceil(want / per_batch) + 1))


def make_config(*, batch_size: int | None, shuffle: bool | None, drop_last: bool,
                timeout: float, num_workers: int, persistent_workers: bool,
                snapshot_every_n_steps: int | None, in_order: bool, on_error: OnError,
                seed: int | None, generator: torch.Generator | None, io_concurrency: int,
                prefetch: int | None, readahead_bytes: int | None,
                num_threads: int | None, device: Any, pin_memory: bool | None,
                copy_stream: DeviceTransfer | None, execution: str, rank: int | None,
                world_size: int | None, progress: bool, log_every: float | None,
                use_fetch: bool) -> LoaderConfig:
    """The config for checked arguments (see :func:`check_args`): ranks from the
    environment, defaults for threads, prefetch and pinning, the device resolved.

    Warns where a seed is given beside a generator; raises ``ImportError`` for
    ``progress=True`` without ``tqdm`` (here, not at ``iter()``)."""
    ranks = resolve_ranks(rank, world_size)
    seed = _seed_beside(seed, generator, ranks[1])
    if progress:
        from .._optional import require
        require("tqdm", "AsyncLoader(progress=True)")
    threads = num_threads or default_threads()
    resolved = resolve_device(device)
    # with a transfer of the user's, pinning is its pin(): no CUDA check here
    pin = resolve_pin(pin_memory, resolved) if copy_stream is None else pin_memory is not False
    return LoaderConfig(
        batch_size=batch_size, shuffle=bool(shuffle), drop_last=drop_last, timeout=timeout,
        num_workers=num_workers,
        workers=num_workers if num_workers > 0 else available_cores(),
        persistent_workers=persistent_workers,
        snapshot_every_n_steps=snapshot_every_n_steps, in_order=in_order,
        on_error=on_error, seed=seed, io_concurrency=io_concurrency,
        prefetch=prefetch or default_prefetch(batch_size, threads, use_fetch,
                                              io_concurrency),
        prefetch_given=prefetch is not None,
        readahead_bytes=readahead_bytes, num_threads=threads,
        threads_given=num_threads is not None, device=resolved, pin_memory=pin,
        transfer=resolved is not None or copy_stream is not None, execution=execution,
        rank=ranks[0], world_size=ranks[1], progress=bool(progress), log_every=log_every)
