"""Shared memory for a process stage: batch buffer sets in ``/dev/shm`` files the
workers map, and the leases that let a later stage remove the files of a loader
killed outright (see :func:`remove_segments`)."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import secrets
import threading
from typing import Any

import numpy as np
import torch

from ..._memory.hostpool import buffers_over
from ..._memory.layout import Layout

__all__ = ["LEASE", "ShmBuffers", "remove_segments", "segment_plan"]

_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # private: may be absent
_ALIGN = 64
LEASE = "lease"        # the last part of a buffer pool's lease file (see remove_segments)
_names = itertools.count()


def segment_plan(layout: Layout, rows: int) -> tuple[list[tuple[int, int] | None], int]:
    """(offset, bytes) of each leaf's buffer in a buffer set's segment (None for
    leaves kept in Python lists), and the segment's size.  Both processes compute it."""
    out: list[tuple[int, int] | None] = []
    off = 0
    for s in layout.specs:
        if s.kind == "list":
            out.append(None)
            continue
        n = rows * int(np.prod(s.shape, dtype=np.int64)) * torch.empty(
            (), dtype=s.dtype).element_size()
        out.append((off, n))
        off += -(-max(n, 1) // _ALIGN) * _ALIGN
    return out, max(off, _ALIGN)


def open_segment(path: str, size: int, create: bool) -> mmap.mmap:
    """The segment at ``path`` mapped (made, ``size`` bytes, with ``create``).  Made,
    its pages are reserved first where the system can (``posix_fallocate``): a full
    shared-memory file system is then an ``OSError`` here (and no file is left),
    not a SIGBUS in the worker that first writes a row."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                os.ftruncate(fd, size)
                if size and hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _lease_free(path: str) -> bool:
    """Whether nobody holds the lease file ``path`` (its loader is gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # gone already, or another user's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its loader (or a worker of it) lives
        return False
    finally:
        os.close(fd)
    return True


def remove_segments(of_pid: int | None = None) -> int:
    """Unlink the shared-memory files (``asyncfeed-<pid>-<token>-...``) of process
    ``of_pid``, or, with None, of every loader that no longer runs; returns how many.

    A loader killed with ``SIGKILL`` cannot unlink its files, and ``/dev/shm`` is
    memory: its workers remove them as they notice it gone (``of_pid``), and
    each new stage removes those of dead loaders whose workers died with them.
    A loader is gone when nobody holds the ``flock`` on its files' lease (see
    :class:`ShmBuffers`): that holds across PID namespaces (containers sharing
    ``/dev/shm``, where another loader's PID cannot be seen); files without a
    lease go when their PID runs no process.  Unlinking a file some process still
    maps leaves the mapping valid."""
    d = _shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "asyncfeed" or not parts[1].isdigit():
            continue
        if of_pid is not None and int(parts[1]) != of_pid:
            continue
        groups.setdefault("-".join(parts[:3]), []).append(name)
    gone = 0
    for group, files in groups.items():
        if of_pid is None:
            lease = f"{group}-{LEASE}"
            if lease in files:
                if not _lease_free(os.path.join(d, lease)):
                    continue
            elif _pid_alive(int(group.split("-")[1])):
                continue
        for name in files:
            try:
                os.unlink(os.path.join(d, name))
                gone += 1
            except OSError:  # gone already, or another user's
                pass
    return gone


class ShmBuffers:
    """Batch buffer sets in shared memory, reused once nobody holds them (as the
    host pool reuses its buffers: a set is free when the pool alone holds its
    storages).  ``take`` may be called from any thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity if _use_count is not None else 0
        self._lock = threading.Lock()
        self._layout: Layout | None = None
        self._rows = 0
        self._kept: list[tuple[str, list[Any]]] = []     # (path, storages)
        self._paths: dict[int, str] = {}                 # first storage's data_ptr -> path
        self._files: set[str] = set()                    # every file not yet unlinked
        # a PID is reused: a token keeps a dead loader's files (same PID) out of the way
        self._prefix = f"asyncfeed-{os.getpid()}-{secrets.token_hex(4)}-"
        self._lease: int | None = None   # fd of the flock'ed lease (see remove_segments)

    def room(self) -> int | None:
        """Buffer sets of the current layout that the sets kept and half the free
        space of the shared-memory file system hold (None before a layout is
        known): what more batches in flight may take, leaving the rest to others."""
        with self._lock:
            if self._layout is None:
                return None
            _, size = segment_plan(self._layout, self._rows)
            kept = len(self._kept)
        if size <= 0:
            return None
        try:
            st = os.statvfs(_shm_dir())
        except OSError:  # pragma: no cover - no such file system: no bound known
            return None
        return kept + st.f_bavail * st.f_frsize // 2 // size

    def reserve(self, sets: int) -> None:
        """Keep up to ``sets`` buffer sets for reuse (never fewer than before)."""
        if _use_count is not None:
            self.capacity = max(self.capacity, sets)

    def take(self, layout: Layout, rows: int) -> tuple[list[Any], str]:
        """Buffers for ``rows`` samples of ``layout``, and the file they live in."""
        with self._lock:
            if layout is not self._layout or rows > self._rows:
                self._forget_all()
                self._layout, self._rows = layout, rows
            for path, storages in self._kept:
                if all(st is None or _use_count(st._cdata) == 1 for st in storages):
                    return buffers_over(layout, storages, self._rows), path
            return self._allocate(layout)

    def _allocate(self, layout: Layout) -> tuple[list[Any], str]:
        if self._lease is None:
            self._lease = self._take_lease()
        plan, size = segment_plan(layout, self._rows)
        path = os.path.join(_shm_dir(), f"{self._prefix}{next(_names)}")
        mm = open_segment(path, size, create=True)
        self._files.add(path)
        bufs: list[Any] = []
        for spec, place in zip(layout.specs, plan):
            if place is None:
                bufs.append([None] * self._rows)
                continue
            off, n = place
            assert spec.dtype is not None  # only list leaves have no dtype, and no place
            t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off) if n else \
                torch.empty(0, dtype=torch.uint8)
            bufs.append(t.view(spec.dtype).view(self._rows, *spec.shape))
        storages = [b.untyped_storage() if isinstance(b, torch.Tensor) else None for b in bufs]
        key = next((b.data_ptr() for b in bufs if isinstance(b, torch.Tensor)), 0)
        self._paths[key] = path
        if len(self._kept) < self.capacity:
            self._kept.append((path, storages))
        return bufs, path

    def path_of(self, bufs: list[Any]) -> str | None:
        """The file of a buffer set this pool handed out (None for other buffers)."""
        key = next((b.data_ptr() for b in bufs if isinstance(b, torch.Tensor)), 0)
        with self._lock:
            return self._paths.get(key)

    def _forget_all(self) -> None:
        self._kept = []
        self._unlink_all()

    def _unlink_all(self) -> None:
        # unlinking removes the name; memory stays mapped (valid) wherever a batch
        # or a worker still uses it, and goes with the last mapping
        for path in list(self._files):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files.clear()

    def _take_lease(self) -> int:
        """Create and lock this pool's lease: while this process (or a worker it
        forked, which shares the lock) lives, no other stage removes its files."""
        fd = os.open(os.path.join(_shm_dir(), f"{self._prefix}{LEASE}"),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    def close(self) -> None:
        """Forget every buffer set and unlink every file (idempotent)."""
        with self._lock:
            self._kept = []
            self._paths.clear()
            self._unlink_all()
            if self._lease is not None:
                try:
                    os.unlink(os.path.join(_shm_dir(), f"{self._prefix}{LEASE}"))
                except FileNotFoundError:
                    pass
                os.close(self._lease)
                self._lease = None
