"""The process stages this process opened: closed at interpreter exit; a forked
worker forgets the ones it inherited (they are not its to close)."""

from __future__ import annotations

import os
from typing import Any

from ..exithooks import OpenSet

__all__ = ["forget_all", "register", "unregister"]


def _close_all_at_exit(stages: list[Any]) -> None:
    for st in stages:
        if st.owner_pid == os.getpid():
            st.close()


_open: OpenSet[Any] = OpenSet(_close_all_at_exit)


def register(stage: Any) -> None:
    """``stage`` is closed at exit unless it closed before (:func:`unregister`)."""
    _open.add(stage)


def unregister(stage: Any) -> None:
    _open.discard(stage)


def forget_all() -> None:
    """(in a forked worker) Close none of the stages inherited from the loader."""
    _open.clear()
