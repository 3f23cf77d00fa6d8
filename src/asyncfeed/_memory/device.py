"""Where batches go: the device argument, pinning, and the CUDA copy stream.

On CUDA, host-to-device copies run on a dedicated copy stream and are followed
by an event; the consumer's stream waits on that event (``wait_event``: the GPU
waits, not the host) and the GPU tensors are marked as used by the consumer's
stream (``record_stream``) so the caching allocator never hands their memory to
the copy stream while the consumer's kernels may still read it.
"""

from __future__ import annotations

import collections
import collections.abc
import threading
import warnings
from typing import Any

import torch


def resolve_device(device: str | torch.device | int | None) -> torch.device | None:
    """``None``/``"cpu"`` → None (batches stay in host memory); CUDA → that device.

    Raises ``ValueError`` for a CUDA device when CUDA is not available, or for a
    device type asyncfeed does not move batches to.
    """
    if device is None:
        return None
    dev = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but CUDA is not available "
                         "on this machine (use device=None for CPU batches)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {dev} does not exist: {torch.cuda.device_count()} CUDA devices")
    return dev


def resolve_pin(pin_memory: bool | None, device: torch.device | None) -> bool:
    """Pin by default on CUDA; asking for pinning without CUDA warns (as DataLoader does)."""
    if pin_memory is None:
        return device is not None
    if pin_memory and not torch.cuda.is_available():
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                      "then device pinned memory won't be used.", stacklevel=3)
        return False
    return bool(pin_memory)


def map_tensors(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor in a (nested) batch, keeping container types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, collections.abc.Mapping):
        try:
            mapping_type: Any = type(obj)  # a concrete mapping class, not the ABC
            return mapping_type({k: map_tensors(v, fn) for k, v in obj.items()})
        except TypeError:
            return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    return obj


def pin(obj: Any) -> Any:
    """Pinned copies of the tensors of a batch (already pinned ones are kept)."""
    return map_tensors(obj, lambda t: t if t.is_pinned() else t.pin_memory())


class CopyTimes:
    """The copy stream's busy time, from CUDA timing events, for ``stats().stages["h2d"]``.

    ``add(start, end)`` keeps a batch's bracketing events; ``drain()`` returns
    ``(copies, seconds)`` of those completed since its last call (in order: it
    stops at the first still running, never waits).  At most ``keep`` are kept
    pending: with nobody draining, the oldest are dropped uncounted.
    """

    def __init__(self, keep: int = 4096) -> None:
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, start: Any, end: Any) -> None:
        self._pending.append((start, end))

    def drain(self) -> tuple[int, float]:
        n, ms = 0, 0.0
        with self._lock:
            pending = self._pending
            while pending and pending[0][1].query():
                start, end = pending.popleft()
                n += 1
                ms += start.elapsed_time(end)
        return n, ms / 1000.0


class CopyStream:
    """Host-to-device copies on a stream of their own, one event per batch.

    ``to_device`` may be called from several threads at once; each call's copies
    and its event are enqueued together (under a lock), so a batch's event
    follows its own copies directly.  With ``timing=True`` a start event is
    recorded before each batch's copies too, and ``timings`` keeps the last
    ``timing_keep`` ``(start, end, nbytes)`` triples (read them after a
    synchronize: ``start.elapsed_time(end)`` is that batch's copy time in ms).
    Every batch's copies are bracketed by timing events either way: the stage
    accounting reads the completed ones with ``drain_timings()``.
    """

    def __init__(self, device: torch.device, *, timing: bool = False,
                 timing_keep: int = 100_000) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.timing = timing
        self.timings: collections.deque[tuple[Any, Any, int]] = \
            collections.deque(maxlen=timing_keep)
        self._lock = threading.Lock()
        self.copy_times = CopyTimes()

    def drain_timings(self) -> tuple[int, float]:
        """``(copies, seconds)`` of the batch copies completed since the last call."""
        return self.copy_times.drain()

    def pin(self, host_batch: Any) -> Any:
        """Pinned copies of the batch's tensors (already pinned ones are kept), so that
        ``to_device`` copies them asynchronously."""
        return pin(host_batch)

    def to_device(self, host_batch: Any) -> tuple[Any, torch.cuda.Event]:
        """Enqueue the copy of every tensor of ``host_batch``; returns GPU batch and event.

        Returns at once (copies from pinned memory are asynchronous).  The host
        memory must not be rewritten until the event has completed.
        """
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if self.timing:
                return self._to_device_timed(host_batch)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            out = map_tensors(host_batch, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.copy_times.add(start, event)
        return out, event

    def _to_device_timed(self, host_batch: Any) -> tuple[Any, torch.cuda.Event]:
        """``to_device`` with the copies bracketed by timing events.  The device
        memory is allocated before the start event, so the bracket holds the
        copies themselves, not the allocator's host-side work."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def alloc(t: torch.Tensor) -> torch.Tensor:
            dst = torch.empty_like(t, device=self.device)
            pairs.append((t, dst))
            return dst

        out = map_tensors(host_batch, alloc)
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self.timings.append((start, event, sum(src.nbytes for src, _ in pairs)))
        self.copy_times.add(start, event)
        return out, event

    def hand_over(self, gpu_batch: Any, event: Any) -> None:  # a torch.cuda.Event
        """Make the consumer's current stream wait for the copy (on the GPU, not the host)."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        map_tensors(gpu_batch, lambda t: t.record_stream(consumer) if t.is_cuda else None)
