"""The transfer stage: an assembled host batch pinned, or its copy to the device
started, in the thread that completed the batch."""

from __future__ import annotations

from typing import Any

from .._memory.device import pin
from ..protocols import DeviceTransfer

__all__ = ["to_target"]


def to_target(copy: DeviceTransfer | None, pin_host: bool, host: Any) -> tuple[Any, Any]:
    """(batch, event): ``host`` with its device copy started on ``copy`` (pinned
    first with ``pin_host``; ``event`` says when the copy is done), or, without a
    device, ``host`` itself (pinned with ``pin_host``) and no event."""
    if copy is not None:
        return copy.to_device(copy.pin(host) if pin_host else host)
    if pin_host:
        return pin(host), None
    return host, None
