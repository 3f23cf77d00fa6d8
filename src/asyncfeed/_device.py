"""Where batches go: the device argument, pinning, and the CUDA copy stream.

On CUDA, host-to-device copies run on a dedicated copy stream and are followed
by an event; the consumer's stream waits on that event (``wait_event``: the GPU
waits, not the host) and the GPU tensors are marked as used by the consumer's
stream (``record_stream``) so the caching allocator never hands their memory to
the copy stream while the consumer's kernels may still read it.
"""

from __future__ import annotations

import collections.abc
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
            return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})
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


class CopyStream:
    """Host-to-device copies on a stream of their own, one event per batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def to_device(self, host_batch: Any) -> tuple[Any, torch.cuda.Event]:
        """Enqueue the copy of every tensor of ``host_batch``; returns GPU batch and event.

        Returns at once (copies from pinned memory are asynchronous).  The host
        memory must not be rewritten until the event has completed.
        """
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = map_tensors(host_batch,
                              lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def hand_over(self, gpu_batch: Any, event: torch.cuda.Event) -> None:
        """Make the consumer's current stream wait for the copy (on the GPU, not the host)."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        map_tensors(gpu_batch, lambda t: t.record_stream(consumer) if t.is_cuda else None)
