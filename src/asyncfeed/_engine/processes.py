"""A process stage for per-sample code that holds the GIL.

Only the per-sample function (``dataset[index]``) moves to worker processes;
the plan, the event loop, batch assembly, the host pool and ring, pinned memory
and the copy stream stay in the loader's process.  The pipeline hands the stage
runs of rows (``submit``), as it hands them to the decode pool:

* the indices go to a worker over its own task queue; a worker holds at most
  ``WORKER_DEPTH`` tasks, the others wait in the stage's backlog for the first
  worker to send results back;
* a fixed-shape batch's buffers live in shared memory (:class:`ShmBuffers`, one
  ``/dev/shm`` file per buffer set): the worker maps the file and writes each
  sample's leaves straight into its row, so nothing big is pickled and nothing
  is collated in the worker; a sample that does not fit the layout (or any
  sample before the layout is known) is pickled back whole;
* a thread of this process (``asyncfeed-proc-results``) reads the results,
  places pickled samples, notes failures, and reports the rows done to the
  pipeline, which finishes the batch as it does for threads.

Workers are started lazily, with the ``multiprocessing_context`` given to the
loader (DataLoader's argument: "fork", "forkserver", "spawn" or a context), and
run ``worker_init_fn(worker_id)`` with ``torch.utils.data.get_worker_info()``
set as DataLoader sets it (id, num_workers, seed, dataset; ``random``, torch and
numpy seeded from the base seed as DataLoader seeds them).

A worker that dies (a segfault, ``os._exit``, the OOM killer) is noticed within
a tenth of a second: every row it held fails with :class:`WorkerCrashedError`
naming those samples, the stage stops taking work (the pipeline goes back to
its threads, and so do the backlog's tasks) and no one waits forever.
``close()`` (idempotent) stops the workers (terminating, then killing, one that
does not exit), joins the results thread and unlinks every shared-memory file;
the loader closes its stage at ``close()``, when it is garbage-collected and at
interpreter exit.  A loader killed outright leaves its files to its workers,
which unlink them as they notice (``remove_segments``).
"""

from __future__ import annotations

import collections
import fcntl
import io
import itertools
import logging
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import random
import secrets
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, ContextManager

import numpy as np
import torch

from .._errors import (AsyncFeedError, SampleError, WorkerCrashedError, describe,
                       set_remote_traceback, traceback_text)
from .._memory.hostpool import buffers_over
from ..protocols import EpochAware
from .accounting import DECODE
from .._memory.layout import _PY_SCALARS, Layout, LayoutMismatch
from .exithooks import OpenSet
from .tasksize import RowCost

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Batch, Pipeline

log = logging.getLogger("asyncfeed")

_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # private: may be absent
_ALIGN = 64
PARENT_CHECK_S = 1.0   # an idle worker checks this often that the loader's process lives
STOP_CHECK_S = 0.01   # a busy worker looks this often for the stage's stop between rows
CLOSE_GRACE_S = 0.5   # close(): the workers' time to leave on their own, before SIGTERM
QUIET_S = 1.0          # the longest the consumer waits for running tasks before a fork
QUIET_RETRY_S = 5.0    # ... and, when they did not end, before it tries again
PROCESS_TASK_S = 0.05  # the work a task sent to a worker aims at (rows_per_process_task)
WORKER_DEPTH = 2       # tasks a worker holds at once (one running, one queued); the rest
                       # wait in the stage's backlog for the first worker to free up
TAIL_SHARE = 0.5       # once a pass's plan ran out, a backlog task sent is at most this
                       # share of the backlog's rows per live worker (ProcessStage._tail_piece)
LEASE = "lease"        # the last part of a buffer pool's lease file (see remove_segments)
_names = itertools.count()


# ---------------------------------------------------------------- shared memory
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


def _open_segment(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
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
        mm = _open_segment(path, size, create=True)
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


# ----------------------------------------------------------------- the worker
def _seed_like_dataloader(base_seed: int, worker_id: int) -> int:
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        from torch.utils.data._utils.worker import _generate_state
        np.random.seed(_generate_state(base_seed, worker_id))
    except Exception:  # noqa: BLE001 - numpy seeding is best effort, as in DataLoader
        pass
    return seed


def _as_array(x: Any, spec: Any) -> np.ndarray | None:
    """A leaf as the NumPy array to copy into its row, or None if it does not fit."""
    if spec.kind == "scalar":
        return None
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.requires_grad or x.is_conj() or x.is_neg() \
                or tuple(x.shape) != spec.shape or x.dtype != spec.dtype:
            return None
        try:
            return x.numpy()
        except (TypeError, RuntimeError):  # bfloat16 and other dtypes NumPy lacks
            return None
    if isinstance(x, np.ndarray):
        if x.shape != spec.shape or not x.dtype.isnative or x.dtype.kind not in "biuf":
            return None
        return x
    return None


class _Rows:
    """A worker's view of one buffer set: writes samples into their rows."""

    def __init__(self, path: str, layout: Layout, rows: int) -> None:
        plan, size = segment_plan(layout, rows)
        self.mm = _open_segment(path, size, create=False)
        self.layout = layout
        self.views: list[np.ndarray | None] = []
        for spec, place in zip(layout.specs, plan):
            if place is None or spec.dtype not in _NP_DTYPES:
                self.views.append(None)
                continue
            off, n = place
            dt = _NP_DTYPES[spec.dtype]
            self.views.append(np.frombuffer(self.mm, dtype=dt, count=n // dt.itemsize,
                                            offset=off).reshape(rows, *spec.shape))

    def write(self, row: int, sample: Any) -> bool:
        """Write ``sample`` into ``row``; False (nothing that matters written) if it
        does not fit exactly: the sample then goes back pickled."""
        try:
            leaves = self.layout.flatten(sample)
        except LayoutMismatch:
            return False
        arrays = []
        for spec, x, v in zip(self.layout.specs, leaves, self.views):
            if v is None:
                return False
            if spec.kind == "scalar":
                if _PY_SCALARS.get(type(x)) != spec.dtype:
                    return False
                arrays.append((v, x))
                continue
            a = _as_array(x, spec)
            if a is None or a.dtype != v.dtype:
                return False
            arrays.append((v, a))
        for v, a in arrays:
            v[row] = a
        return True

    def close(self) -> None:
        self.views = []
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view still alive; unmapped at exit
            pass


_NP_DTYPES: dict[torch.dtype, np.dtype] = {
    t: np.dtype(n) for t, n in ((torch.uint8, "u1"), (torch.int8, "i1"), (torch.int16, "i2"),
                                (torch.int32, "i4"), (torch.int64, "i8"),
                                (torch.float16, "f2"), (torch.float32, "f4"),
                                (torch.float64, "f8"), (torch.bool, "?"))}


class _ResultPickler(ForkingPickler):
    """Pickles a worker's results for the loader's process: a plain CPU tensor goes as
    its bytes (see :func:`dumps_results`); anything else as ``multiprocessing``
    pickles it."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and _plain_cpu_tensor(obj):
            data = bytearray(obj.reshape(-1).view(torch.uint8).numpy()) if obj.numel() \
                else bytearray()
            return _tensor_from_bytes, (data, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _plain_cpu_tensor(t: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor without autograd, names, or lazy conj/neg bits:
    its bytes, dtype and shape are all of it."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
            and not t.is_quantized and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and not any(getattr(t, "names", ())))  # named: older torch


def _tensor_from_bytes(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]
                       ) -> torch.Tensor:
    """The tensor :class:`_ResultPickler` sent: a view of ``data`` (no copy)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


def dumps_results(msg: Any) -> memoryview:
    """``msg`` pickled for the loader's process (``pickle.loads`` reads it).

    A plain CPU tensor (:func:`_plain_cpu_tensor`) goes as its bytes.  Pickled as
    ``multiprocessing`` pickles it (the way DataLoader's workers send batches),
    its storage was shared through a file descriptor: a connection to the
    worker's resource-sharer thread per tensor, about 1 ms of the results
    thread's CPU each; pickled as torch pickles it, 0.26 ms even for a scalar.  As bytes, a
    3x224x224 uint8 image takes 30 us there and back.  Other tensors (views that
    are not contiguous, autograd, sparse) go the ``multiprocessing`` way, as
    before."""
    buf = io.BytesIO()
    _ResultPickler(buf, pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getbuffer()


def _error_payload(e: BaseException) -> tuple[bytes | None, str, list[str]]:
    """A worker's exception as it travels: the exception pickled (None where it
    cannot be pickled, or not rebuilt from its pickle), its ``Type: message``, and
    the traceback texts taken here (its own; for a dataset's own ``SampleError``,
    its cause's too: the consumer names the sample by that cause, see
    ``rebuild_error``).  The loader's process rebuilds it with :func:`_rebuild`."""
    texts = [traceback_text(e)]
    inner = e.cause if isinstance(e, SampleError) else None
    if isinstance(inner, BaseException):
        texts.append(traceback_text(inner))
    data: bytes | None
    try:
        data = bytes(dumps_results(e))
        pickle.loads(data)  # a type whose __init__ refuses its own args cannot come back
    except Exception:  # noqa: BLE001 - sent as its text instead
        data = None
    return data, describe(e), texts


def _rebuild(payload: tuple[bytes | None, str, list[str]]) -> BaseException:
    """The exception :func:`_error_payload` sent: of its type, with its message,
    attributes and traceback text (``traceback_text`` gives the worker's), as the
    consumer would have had it from a thread.  One that could not travel is an
    :class:`AsyncFeedError` with its ``Type: message``."""
    data, text, texts = payload
    e: Any = None
    if data is not None:
        try:
            e = pickle.loads(data)
        except Exception:  # noqa: BLE001 - e.g. its class exists only in the worker
            e = None
    if not isinstance(e, BaseException):
        e = AsyncFeedError(f"{text} (raised in a worker process; the exception could not "
                           "be sent to the loader's process as it is)")
    set_remote_traceback(e, texts[0])
    inner = e.cause if isinstance(e, SampleError) else None
    if isinstance(inner, BaseException) and len(texts) > 1:
        set_remote_traceback(inner, texts[1])
    return e


def _dump_task(task_id: int, worker_id: int, out: list[tuple[int, str, Any]],
               took: float) -> memoryview:
    """A task's results pickled (:func:`dumps_results`); a sample that cannot be
    pickled fails its row (an :class:`AsyncFeedError` naming why), not the worker."""
    try:
        return dumps_results((task_id, worker_id, out, took))
    except Exception:  # noqa: BLE001 - find the rows that cannot go
        pass
    sendable = []
    for row, kind, payload in out:
        if kind == "s":
            try:
                dumps_results(payload)
            except Exception as e:  # noqa: BLE001
                err = AsyncFeedError(f"the sample could not be sent from the worker process "
                                     f"to the loader's ({describe(e)})")
                sendable.append((row, "e", _error_payload(err)))
                continue
        sendable.append((row, kind, payload))
    return dumps_results((task_id, worker_id, sendable, took))


class _Tasks:
    """A worker's end of its task pipe: the next task, and whether the stage said
    stop (``None`` sent, or the pipe closed), looked for between rows too."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.ahead: collections.deque[Any] = collections.deque()  # tasks read early
        self.stopped = False
        self._looked = time.perf_counter()

    def _read(self) -> Any:
        try:
            msg = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):  # the loader closed its end (or is gone)
            msg = None
        if msg is None:
            self.stopped = True
        return msg

    def next(self, timeout: float) -> tuple[bool, Any]:
        """(True, the next task) or (True, None) at the stop; (False, None) when
        nothing came within ``timeout`` seconds."""
        if self.stopped:
            return True, None
        if self.ahead:
            return True, self.ahead.popleft()
        if not self.conn.poll(timeout):
            return False, None
        return True, self._read()

    def stop_asked(self) -> bool:
        """(between rows, at most every ``STOP_CHECK_S``) Whether the stage said stop:
        a closing loader does not wait for the rows of tasks it has dropped."""
        now = time.perf_counter()
        if self.stopped or now - self._looked < STOP_CHECK_S:
            return self.stopped
        self._looked = now
        while not self.stopped and self.conn.poll(0):
            msg = self._read()
            if msg is not None:
                self.ahead.append(msg)
        return self.stopped


def _worker_main(worker_id: int, num_workers: int, dataset: Any, init_fn: Any,
                 base_seed: int, tasks: Any, results: Any, owner: int) -> None:
    """A worker's loop: ``(task_id, rows, indices, path, layout, n_rows, forget,
    epoch)`` in (pickled, over its own task pipe), one ``(task_id, worker_id, out,
    seconds the rows took)`` back per task; ``None`` (or the pipe closed) ends it,
    between two rows too: a task the loader dropped sends nothing back.
    ``epoch``: an EpochAware dataset's epoch in the loader's process (None
    otherwise), applied to this copy before its rows.

    ``results`` is this worker's own pipe, written synchronously: a worker that dies
    (``os._exit``, a segfault, the OOM killer) between tasks leaves no half-written
    message and holds no lock another worker needs (a shared ``multiprocessing.Queue``
    is written by a feeder thread under a lock shared by every worker: a worker dying
    mid-write used to leave the others, and so the pass, waiting forever).  A
    sample's exception goes back as :func:`_error_payload` makes it."""
    from torch._utils import ExceptionWrapper
    from torch.utils.data._utils import worker as tw
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the loader's process handles ^C
    _open.clear()  # a forked worker inherits the loader's stages: not its to close
    seed = _seed_like_dataloader(base_seed, worker_id)
    tw._worker_info = tw.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                    dataset=dataset)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except BaseException:  # noqa: BLE001 - reported as the first task's failure
            results.send_bytes(dumps_results((-1, worker_id, ExceptionWrapper(
                sys.exc_info(), where=f"in worker_init_fn of worker process {worker_id}"),
                0.0)))
            return
    mapped: dict[str, _Rows] = {}
    parent = os.getppid()
    inbox = _Tasks(tasks)
    while True:
        got, task = inbox.next(PARENT_CHECK_S)
        if not got:
            if os.getppid() != parent:
                # the loader's process is gone (killed): so is this worker, and
                # the loader's shared memory with it
                remove_segments(owner)
                break
            continue
        if task is None:
            break
        task_id, rows, indices, path, layout, n_rows, forget, epoch = task
        if epoch is not None and getattr(dataset, "epoch", epoch) != epoch:
            dataset.set_epoch(epoch)  # the loader's dataset moved on (EpochAware)
        for f in forget:
            r = mapped.pop(f, None)
            if r is not None:
                r.close()
        target = None
        if path is not None:
            target = mapped.get(path)
            if target is None:
                try:
                    target = mapped[path] = _Rows(path, layout, n_rows)
                except OSError:
                    target = None
        out: list[tuple[int, str, Any]] = []
        t0 = time.perf_counter()
        for row, idx in zip(rows, indices):
            if inbox.stop_asked():
                break
            try:
                sample = dataset[idx]
            except BaseException as e:  # noqa: BLE001 - travels to the loader's process
                out.append((row, "e", _error_payload(e)))
                del e
                continue
            if target is not None and target.write(row, sample):
                out.append((row, "w", None))
            else:
                out.append((row, "s", sample))
            del sample
        if inbox.stopped:
            break
        results.send_bytes(_dump_task(task_id, worker_id, out, time.perf_counter() - t0))
        del out
    for r in mapped.values():
        r.close()


# ------------------------------------------------------------------ the stage
def _close_all_at_exit(stages: list[ProcessStage]) -> None:
    for st in stages:
        if st.owner_pid == os.getpid():
            st.close()


_open: OpenSet[ProcessStage] = OpenSet(_close_all_at_exit)


def resolve_context(context: Any) -> Any:
    """DataLoader's ``multiprocessing_context``: None (the platform's default), a
    start method name, or a context object."""
    if context is None:
        return mp.get_context()
    if isinstance(context, str):
        if context not in mp.get_all_start_methods():
            raise ValueError(f"multiprocessing_context={context!r}: this platform supports "
                             f"{', '.join(mp.get_all_start_methods())}")
        return mp.get_context(context)
    if not isinstance(context, mp.context.BaseContext):
        raise TypeError("multiprocessing_context must be a start method name or a "
                        f"multiprocessing context, got {type(context).__name__}")
    return context


class ProcessStage:
    """``num_workers`` worker processes running ``dataset[index]`` for the pipeline."""

    def __init__(self, dataset: Any, num_workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, base_seed: int,
                 capacity: int) -> None:
        self.dataset = dataset
        self.num_workers = max(1, num_workers)
        self.ctx = resolve_context(context)
        self.worker_init_fn = worker_init_fn
        self.base_seed = base_seed
        self.buffers = ShmBuffers(capacity)
        self.broken: BaseException | None = None
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False      # the results thread may stop
        self._closing = False     # no more work is taken
        self._started = False
        self._workers: list[Any] = []
        self._tasks: list[mp_connection.Connection] = []       # each worker's task pipe
        self._send_locks: list[threading.Lock] = []
        self._readers: dict[mp_connection.Connection, int] = {}  # result pipe -> worker id
        # the results thread runs while a pass uses the stage or a worker holds a task
        # (see _collect); passes using the stage now:
        self._passes: weakref.WeakSet[Any] = weakref.WeakSet()
        self._collector: threading.Thread | None = None
        self._wake_fds: tuple[int, int] | None = None  # wakes the results thread's poll
        self._ids = itertools.count()
        # task id -> (pipeline, batch, lo, hi, worker or -1 while in the backlog, sent at)
        self._pending: dict[int, tuple[Any, Any, int, int, int, float]] = {}
        self._held = [0] * self.num_workers     # tasks sent to each worker, not yet back
        self._backlog: collections.deque[tuple[int, str | None]] = collections.deque()  # tid, path
        self._forget: list[str] = []
        self._dead: set[int] = set()
        self._last_layout: Layout | None = None
        self.row_s: float | None = None  # what a row takes in a worker (a running mean)
        # an EpochAware dataset's epoch travels with every task (see _worker_main)
        self._epoch_aware = isinstance(dataset, EpochAware)

    @property
    def usable(self) -> bool:
        return not self._closing and self.broken is None

    def start(self, quiet: Callable[[float], ContextManager[bool]] | None = None) -> bool:
        """Start the workers and the results thread (once; from the consumer thread).

        ``quiet``: the decode pool's ``TaskPool.quiet``.  With the fork start method
        the workers are forked inside it, no decode thread running user code: a
        lock such code held at the fork (NumPy's global generator's, a logging
        handler's) would stay locked in the child for ever.  False, starting
        nothing, if the threads did not go quiet in time (a task still running
        after ``QUIET_S``); the caller may try again later (``Execution`` waits
        ``QUIET_RETRY_S``)."""
        if quiet is not None and self.ctx.get_start_method() == "fork":
            with quiet(QUIET_S) as calm:
                return self._start() if calm else False
        return self._start()

    def _start(self) -> bool:
        with self._lock:
            if self._started or self._closing:
                return True
            self._started = True
            _open.add(self)
            remove_segments()  # of loaders killed with their workers (see there)
            for wid in range(self.num_workers):
                task_reader, task_writer = self.ctx.Pipe(duplex=False)
                reader, writer = self.ctx.Pipe(duplex=False)
                p = self.ctx.Process(target=_worker_main, name=f"asyncfeed-proc-{wid}",
                                     args=(wid, self.num_workers, self.dataset,
                                           self.worker_init_fn, self.base_seed,
                                           task_reader, writer, self.owner_pid), daemon=True)
                try:
                    p.start()
                finally:
                    # only the worker holds its results pipe's write end (its death
                    # reads as EOF) and its task pipe's read end (the loader closing
                    # its end stops it); closed before the next fork, so no later
                    # worker inherits them
                    writer.close()
                    task_reader.close()
                self._readers[reader] = wid
                self._tasks.append(task_writer)
                self._send_locks.append(threading.Lock())
                self._workers.append(p)
            # made after the forks: no worker holds a copy
            self._wake_fds = os.pipe()
            for fd in self._wake_fds:
                os.set_blocking(fd, False)
        return True

    def row_cost(self, cost: RowCost | None) -> float | None:
        """What a row costs in a worker, to size its tasks (``rows_per_process_task``):
        measured there once a task came back.  Before, the least of the threads'
        running means (``cost``) of a row's CPU and wall time: the wall time
        carries the GIL waits of the rows beside it."""
        if self.row_s is not None:
            return self.row_s
        if cost is None:
            return None
        known = [x for x in (cost.cpu_s, cost.wall_s) if x]
        return min(known) if known else None

    def pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]

    # -------------------------------------------------------------- submitting
    def take(self, layout: Layout, rows: int) -> tuple[list[Any], str]:
        return self.buffers.take(layout, rows)

    def submit(self, p: Pipeline, b: Batch, lo: int, hi: int, path: str | None) -> bool:
        """Send rows ``lo..hi`` of ``b`` to a worker; False if the stage cannot take
        them (closed or broken: the caller runs them in threads).

        A worker holds at most ``WORKER_DEPTH`` tasks; a task no worker can take now
        waits in the stage's backlog (first in, first out) and goes to the first
        worker that sends results back (``_handle``).  Queued straight to a worker,
        a pass's tasks were shared out as they were submitted, a ring's worth ahead:
        a worker that ran a little slower (a busy core) still held several tasks
        at the end of the pass while the other had none (a core idle for several
        tasks' time); held back, they go where a worker is free."""
        with self._lock:
            if not self.usable or p.stopping:  # (a pass over: drop_pipeline has run or will)
                return False
            self._passes.add(p)
            self._ensure_collector()
            tid = next(self._ids)
            wid = self._free_worker()
            if wid < 0:
                self._pending[tid] = (p, b, lo, hi, -1, time.perf_counter())
                self._backlog.append((tid, path))
                return True
            forget = self._assign(tid, p, b, lo, hi, wid)
        if not self._send(wid, tid, _task(b, lo, hi, path), forget):
            with self._lock:
                self._pending.pop(tid, None)
                self._held[wid] -= 1
            return False
        return True

    def _free_worker(self) -> int:
        """(under the lock) The live worker holding fewest tasks, if under
        ``WORKER_DEPTH``; else -1."""
        best = -1
        for w in range(self.num_workers):
            if w not in self._dead and self._held[w] < WORKER_DEPTH \
                    and (best < 0 or self._held[w] < self._held[best]):
                best = w
        return best

    def _assign(self, tid: int, p: Pipeline, b: Batch, lo: int, hi: int, wid: int
                ) -> list[str]:
        """(under the lock) Task ``tid`` (rows ``lo..hi`` of ``b``) goes to worker
        ``wid`` now; returns the segments it is to forget, sent with the task."""
        self._pending[tid] = (p, b, lo, hi, wid, time.perf_counter())
        self._held[wid] += 1
        forget, self._forget = self._forget, []
        return forget

    def task_rows(self, n: int, cost: RowCost | None) -> int:
        """Rows per task for a batch of ``n`` (``rows_per_process_task`` at
        :meth:`row_cost`)."""
        return rows_per_process_task(n, self.num_workers, self.row_cost(cost))

    def _send(self, wid: int, tid: int, task: tuple[Any, ...], forget: list[str]) -> bool:
        """Write a task to worker ``wid``'s pipe (any thread; one writer at a time).
        A worker holds at most ``WORKER_DEPTH`` small tasks: the write does not wait
        for the pipe to drain.  False if the pipe is closed (the stage closing) or
        the worker is gone."""
        epoch = self.dataset.epoch if self._epoch_aware else None
        data = ForkingPickler.dumps((tid, *task, forget, epoch))
        with self._send_locks[wid]:
            try:
                self._tasks[wid].send_bytes(data)
            except (ValueError, OSError):  # closed under us, or the worker died
                return False
        return True

    def _ensure_collector(self) -> None:
        """(under the lock) Start the results thread if it is not running."""
        if self._collector is None and not self._closed:
            self._collector = threading.Thread(target=self._collect,
                                               name="asyncfeed-proc-results", daemon=False)
            self._collector.start()

    def _idle(self) -> bool:
        """(under the lock) No pass uses the stage and no worker holds a task."""
        return not self._passes and not any(self._held) and not self._backlog

    def _wake_collector(self) -> None:
        """(under the lock) Have the results thread look at the stage's state now,
        not at the end of its 0.1 s poll (it ends the moment the stage is idle)."""
        if self._wake_fds is not None:
            try:
                os.write(self._wake_fds[1], b"\0")
            except OSError:  # full: it has been woken already
                pass

    def _dispatch(self) -> None:
        """Send backlog tasks to the workers with room (the results thread, after a
        task came back).  A task the queue refuses (closing) is dropped: the pass
        is being torn down."""
        while True:
            with self._lock:
                if not self._backlog or not self.usable:
                    return
                wid = self._free_worker()
                if wid < 0:
                    return
                tid, path = self._backlog.popleft()
                entry = self._pending.get(tid)
                if entry is None:  # its pass was dropped
                    continue
                p, b, lo, hi = entry[:4]
                piece = self._tail_piece(p, hi - lo)
                if piece < hi - lo:  # the rest waits at the head of the backlog
                    self._pending[tid] = (p, b, lo + piece, hi, -1, entry[5])
                    self._backlog.appendleft((tid, path))
                    tid, hi = next(self._ids), lo + piece
                forget = self._assign(tid, p, b, lo, hi, wid)
            if not self._send(wid, tid, _task(b, lo, hi, path), forget):
                return

    def _tail_piece(self, p: Pipeline, rows: int) -> int:
        """(under the lock) How many of a backlog task's ``rows`` go now: all of them,
        unless ``p``'s plan has run out (no batch will join the backlog): then the
        backlog's last rows go in ever smaller pieces, a share of what is left
        (``TAIL_SHARE`` of it per live worker), so the workers finish together.
        Whole to the end, the last tasks (about 50 ms each) leave one worker idle
        while the other runs them."""
        if not p.exhausted:
            return rows
        left = rows + sum(e[3] - e[2] for e in (self._pending.get(t) for t, _ in self._backlog)
                          if e is not None)
        live = max(1, self.num_workers - len(self._dead))
        return max(1, min(rows, math.ceil(left * TAIL_SHARE / live)))

    def _backlog_to_threads(self) -> None:
        """(the stage broke) The backlog's tasks run in their pipelines' threads."""
        with self._lock:
            waiting = [self._pending.pop(tid, None) for tid, _ in self._backlog]
            self._backlog.clear()
        for e in waiting:
            if e is not None:
                _rows_to_threads(e[0], e[1], [(e[2], e[3])])

    # -------------------------------------------------------------- collecting
    def _collect(self) -> None:
        """The results thread: apply each task's results; notice dead workers (at
        least every 0.1 s, busy or not).  It runs while a pass uses the stage or a
        worker still holds a task (of a pass that ended, too: the worker's count of
        tasks must come back); then it ends, and the next ``submit`` starts it
        again: a loader between passes keeps its workers, not a thread."""
        # one poll object for the thread's life: multiprocessing.connection.wait builds
        # and registers a selector per call (0.14 ms of this thread's CPU a task)
        live = {conn.fileno(): conn for conn, wid in self._readers.items()
                if wid not in self._dead}
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLIN)
        with self._lock:
            wake = self._wake_fds[0] if self._wake_fds is not None else -1
        if wake >= 0:
            poller.register(wake, select.POLLIN)
        checked = time.monotonic()
        while not self._closed:
            with self._lock:
                if self._idle() or self._closing:
                    if self._collector is threading.current_thread():
                        self._collector = None
                    return
            if time.monotonic() - checked >= 0.1:
                self._check_workers()
                checked = time.monotonic()
            for fd, _ in poller.poll(100):
                if fd == wake:
                    try:
                        os.read(wake, 4096)
                    except OSError:  # drained already
                        pass
                    continue
                conn = live.get(fd)
                if conn is None:
                    continue
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the worker is gone: _check_workers says how
                    poller.unregister(fd)
                    del live[fd]
                    continue
                except Exception as e:  # noqa: BLE001 - a sample that cannot be unpickled
                    self._fail_worker(self._readers[conn], AsyncFeedError(
                        f"the results of worker process {self._readers[conn]} could not be "
                        f"read: {describe(e)}"))
                    continue
                try:
                    self._handle(msg)
                except Exception:  # noqa: BLE001 - a bug of ours must not stop this thread
                    log.exception("asyncfeed: applying a worker's results failed")
                del msg

    def _handle(self, msg: tuple[int, int, Any, float]) -> None:
        """Apply one task's results (the results thread)."""
        tid, wid, out, took = msg
        if tid == -1:  # worker_init_fn failed: the worker has returned
            self._fail_worker(wid, _unwrap(out))
            return
        with self._lock:
            self._held[wid] = max(0, self._held[wid] - 1)  # (0 already: marked dead)
            entry = self._pending.pop(tid, None)
        self._dispatch()  # before this task's results: the worker is not kept waiting
        if entry is None:
            return
        p, b, lo, hi, _, sent = entry
        if hi > lo:
            c = took / (hi - lo)
            self.row_s = c if self.row_s is None else 0.7 * self.row_s + 0.3 * c
        # stage accounting: a task's rows, from sending to results (decode in a worker)
        p.acct.add_wall(DECODE, time.perf_counter() - sent, hi - lo)
        _apply(p, b, lo, hi, out)

    def _check_workers(self) -> None:
        for wid, w in enumerate(self._workers):
            if self._closed:
                return
            if self._closing:
                return
            if wid not in self._dead and not w.is_alive():
                code = w.exitcode
                why = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
                       else f"exited with code {code}")
                self._fail_worker(wid, None, why)

    def _fail_worker(self, wid: int, error: BaseException | None, why: str = "") -> None:
        with self._lock:
            self._dead.add(wid)
            self._held[wid] = 0  # it sends nothing more
            held = [(tid, e) for tid, e in self._pending.items() if e[4] == wid]
            for tid, _ in held:
                del self._pending[tid]
            if self.broken is None:
                self.broken = error or WorkerCrashedError(
                    f"worker process {wid} {why}")
        samples = [i for _, e in held for i in e[1].indices[e[2]:e[3]]]
        if error is None:
            pid = self._workers[wid].pid
            error = WorkerCrashedError(
                f"asyncfeed worker process {wid} (pid {pid}) {why} while loading samples "
                f"{samples[:16]}{'...' if len(samples) > 16 else ''}; the loader stopped "
                "using processes for the rest of its life")
        log.warning("%s", error)
        for _, (p, b, lo, hi, *_) in held:
            for row in range(lo, hi):
                p._note_failure(b, row, b.indices[row], error)
            from .rowtasks import rows_done
            rows_done(p, b, lo, hi)
        self._backlog_to_threads()

    def forget_segment(self, path: str) -> None:
        with self._lock:
            self._forget.append(path)

    # ----------------------------------------------------------------- closing
    def holds(self, p: Pipeline) -> bool:
        """Whether rows of the pass ``p`` are still with the workers or in the backlog."""
        with self._lock:
            return any(e[0] is p for e in self._pending.values())

    def drop_pipeline(self, p: Pipeline) -> None:
        """The pass ``p`` is over: results still coming for it are dropped (the
        results thread ends once the workers have sent back what they hold)."""
        with self._lock:
            self._passes.discard(p)
            for tid in [t for t, e in self._pending.items() if e[0] is p]:
                del self._pending[tid]  # a backlog entry without one is skipped
            self._backlog = collections.deque(t for t in self._backlog
                                              if t[0] in self._pending)
            if self._idle():
                self._wake_collector()

    def close(self) -> None:
        """Stop the workers and the results thread; unlink shared memory.  Idempotent;
        does nothing in another process (a forked child holding a copy).

        Every worker is told to stop (between two rows: the rows of dropped tasks
        are not run) and its task pipe closed; their results are drained (a worker
        cannot exit while its last results wait in a full pipe) until they exit,
        ``CLOSE_GRACE_S`` at most for all of them together; one still running then
        (a stuck or slow sample) is terminated, then killed, as DataLoader does at
        its shutdown.  So closing, and the interpreter's exit, wait well under a
        second for the workers, whatever their samples do."""
        if os.getpid() != self.owner_pid:
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._pending.clear()
            self._backlog.clear()
            self._passes = weakref.WeakSet()
            self._wake_collector()
        for wid, conn in enumerate(self._tasks):
            with self._send_locks[wid]:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except (ValueError, OSError):  # the worker is gone already
                    pass
                conn.close()
        self._closed = True
        collector = self._collector
        if collector is not None and collector is not threading.current_thread():
            collector.join()  # woken, it ends at once: from here on, this thread reads
        with self._lock:
            fds, self._wake_fds = self._wake_fds, None
        for fd in fds or ():
            os.close(fd)
        self._drain_until_exited(time.monotonic() + CLOSE_GRACE_S)
        for w in self._workers:
            if w.is_alive():
                w.terminate()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for w in self._workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w.is_alive():  # a worker ignoring SIGTERM
                w.kill()
                w.join(timeout=2)
        for conn in self._readers:
            conn.close()
        for w in self._workers:
            try:
                w.close()  # its sentinel's descriptor
            except ValueError:  # pragma: no cover - still running after SIGKILL
                pass
        self.buffers.close()
        _open.discard(self)

    def _drain_until_exited(self, deadline: float) -> None:
        """(closing, the results thread gone) Read and drop the workers' results
        until every worker has exited or ``deadline`` (monotonic) has passed."""
        readers = {conn: wid for conn, wid in self._readers.items() if not conn.closed}
        while True:
            running = [w for w in self._workers if w.is_alive()]
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return
            ready = mp_connection.wait(list(readers) + [w.sentinel for w in running],
                                       timeout=min(left, 0.05))
            for obj in ready:
                if isinstance(obj, mp_connection.Connection):
                    try:
                        obj.recv_bytes()
                    except Exception:  # noqa: BLE001 - EOF: that worker is gone
                        del readers[obj]


def _unwrap(wrapper: Any) -> BaseException:
    """The exception a worker sent wrapped as DataLoader's workers wrap theirs
    (``worker_init_fn``'s failure)."""
    try:
        wrapper.reraise()
    except BaseException as e:  # noqa: BLE001
        return e
    return AsyncFeedError("a worker failed")  # pragma: no cover


def _apply(p: Pipeline, b: Batch, lo: int, hi: int, out: list[tuple[int, str, Any]]) -> None:
    """Put a task's results into ``b`` (results thread) and report its rows done."""
    from .rowtasks import WRITTEN, place_sample, rows_done
    if p.stopping:
        return
    for row, kind, payload in out:
        if kind == "w":
            b.samples[row] = WRITTEN  # read back from its row if b is collated after all
        elif kind == "e":
            p._note_failure(b, row, b.indices[row], _rebuild(payload))
        elif kind == "s":
            try:
                place_sample(p, b, row, payload)
            except BaseException as e:  # noqa: BLE001
                p._note_failure(b, row, b.indices[row], e)
    del out, payload
    rows_done(p, b, lo, hi)


def rows_per_process_task(n: int, workers: int, row_cost_s: float | None) -> int:
    """Rows per task sent to a worker: about ``PROCESS_TASK_S`` of work, no more
    than one worker's share of a batch (before the row cost is known: half that
    share).  A task costs the loader's process about 0.4 ms of CPU (the results
    thread's wake-up, receive and bookkeeping) on top of the worker's queue read
    and reply: with 10 ms tasks that was 5% of a core, taken from the workers on
    a small machine (see docs/architecture.md)."""
    workers = max(1, workers)
    if row_cost_s is None or row_cost_s <= 0:
        return max(1, n // (2 * workers))
    return max(1, min(math.ceil(PROCESS_TASK_S / row_cost_s), -(-n // workers)))


def submit_batch(p: Pipeline, stage: ProcessStage, b: Batch) -> bool:
    """Send every row of ``b`` to the worker processes.  False (nothing sent) when
    the stage cannot take work: the caller runs the batch in threads."""
    path = None
    if b.mode == "ring" and b.slot is None:
        if b.bufs is None:
            assert b.layout is not None  # a ring batch's layout is known
            bufs, path = stage.take(b.layout, max(b.n, p.batch_size or b.n))
            b.views = b.layout.numpy_views(bufs)
            b.bufs = bufs
        else:
            path = stage.buffers.path_of(b.bufs)
    step = stage.task_rows(b.n, p.row_cost)
    spans = [(lo, min(lo + step, b.n)) for lo in range(0, b.n, step)]
    for i, (lo, hi) in enumerate(spans):
        if not stage.submit(p, b, lo, hi, path):
            if i == 0:
                return False
            _rows_to_threads(p, b, spans[i:])  # the stage broke mid-batch
            return True
    return True


def _task(b: Batch, lo: int, hi: int, path: str | None) -> tuple[Any, ...]:
    """What a worker gets for rows ``lo..hi`` of ``b`` (see ``_worker_main``)."""
    return (list(range(lo, hi)), b.indices[lo:hi], path, b.layout if path is not None else None,
            len(b.bufs[0]) if path is not None and b.bufs else 0)


def _rows_to_threads(p: Pipeline, b: Batch, spans: list[tuple[int, int]]) -> None:
    """Queue the runs ``spans`` of ``b`` that the stage could not take (it broke) for
    the threads; ``b`` fails as abandoned (once) if they are closing too."""
    from .rowtasks import run_rows
    for lo, hi in spans:
        if p.runtime.submit(run_rows, p, b, lo, hi) is None:
            p._abandon(b)
            return


def take_over_queued(p: Pipeline, stage: ProcessStage) -> int:
    """(once, as ``p`` starts using ``stage``) Send the row tasks of ``p`` still
    queued for its threads to the stage in the stage's task sizes: a batch none
    of whose rows has started goes whole (``submit_batch``: into shared memory),
    the queued rows of a started batch in runs of ``rows_per_process_task``
    (they come back pickled).  Left to the threads, each of those tasks -- sized
    for a thread, often one row -- would wake a thread to send it on, and the
    workers would wait between them.  Returns the rows moved; rows
    the stage cannot take (it broke) are queued for the threads again."""
    from .rowtasks import run_rows
    taken = p.runtime.pool.take_queued(
        lambda fn, args: fn is run_rows and bool(args) and args[0] is p)
    if not taken:
        return 0
    runs: dict[int, tuple[Batch, list[tuple[int, int]]]] = {}
    for _, (_, b, lo, hi) in taken:
        runs.setdefault(b.k, (b, []))[1].append((lo, hi))
    moved = 0
    for b, spans in runs.values():
        spans.sort()
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        whole = merged == [[0, b.n]] and b.bufs is None
        if whole and submit_batch(p, stage, b):
            moved += b.n
            continue
        path = stage.buffers.path_of(b.bufs) if b.bufs else None
        step = stage.task_rows(b.n, p.row_cost)
        chunks = [(lo, min(lo + step, hi0)) for lo0, hi0 in merged
                  for lo in range(lo0, hi0, step)]
        for i, (lo, hi) in enumerate(chunks):
            if not stage.submit(p, b, lo, hi, path):
                _rows_to_threads(p, b, chunks[i:])
                break
            moved += hi - lo
    return moved


EXECUTIONS = ("auto", "inline", "threads", "processes")


class Execution:
    """A loader's process stage: started when the execution chooser runs the
    process candidate (or from the first batch with ``execution="processes"``),
    and kept for the loader's later passes while that candidate is chosen.

    Owned by the loader; ``close()`` is idempotent and also runs when the loader
    is garbage-collected or the interpreter exits.
    """

    def __init__(self, mode: str, dataset: Any, workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, capacity: int) -> None:
        if mode not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {mode!r}")
        if mode in ("auto", "processes") and context is not None:
            resolve_context(context)  # a bad start method is an error now, not mid-pass
        self.mode = mode
        self.dataset = dataset
        self.workers = workers
        self.context = context
        self.worker_init_fn = worker_init_fn
        self.capacity = capacity
        self.stage: ProcessStage | None = None
        self.failed: str | None = None
        self._retry_after = 0.0  # (monotonic) no start before: see ProcessStage.start
        self._lock = threading.Lock()

    def stage_for(self, base_seed: int,
                  quiet: Callable[[float], ContextManager[bool]] | None = None
                  ) -> ProcessStage | None:
        """The started stage, started now if need be; None when it cannot run now
        (it failed to start or stopped: ``failed`` says why; or the decode threads
        did not go quiet for the fork: ``quiet``, see :meth:`ProcessStage.start`)."""
        if self.failed is not None:
            return None
        if self.stage is None and time.monotonic() < self._retry_after:
            return None  # the threads did not go quiet a moment ago: not again yet
        with self._lock:
            if self.stage is None:
                stage = ProcessStage(self.dataset, self.workers, self.context,
                                     self.worker_init_fn, base_seed, self.capacity)
                try:
                    started = stage.start(quiet)
                except Exception as e:  # noqa: BLE001 - e.g. an unpicklable dataset with spawn
                    stage.close()
                    if self.mode == "processes":
                        raise AsyncFeedError(f"the process stage could not start: "
                                             f"{type(e).__name__}: {e}") from e
                    self.failed = f"processes could not start ({type(e).__name__}: {e})"
                    log.warning("%s; staying in this process", self.failed)
                    return None
                if not started:
                    stage.close()
                    self._retry_after = time.monotonic() + QUIET_RETRY_S
                    log.debug("the decode threads did not go quiet for the fork: "
                              "the process stage starts later")
                    return None
                self.stage = stage
                log.debug("process stage started (%d workers)", self.workers)
        stage = self.stage
        if not stage.usable:
            if self.failed is None:
                self.failed = f"processes stopped ({stage.broken})"
            return None
        return stage

    def close(self) -> None:
        """Stop the stage's workers (idempotent); a later ``stage_for`` starts anew."""
        with self._lock:
            stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()
