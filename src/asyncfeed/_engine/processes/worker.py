"""A worker process of the stage: its loop runs ``dataset[index]`` for the rows
of each task it is sent and writes the samples into the batch's shared memory
(or sends them back pickled)."""

from __future__ import annotations

import collections
import gc
import os
import pickle
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch

from ..._memory.layout import _PY_SCALARS, Layout, LayoutMismatch
from .. import gcpauses
from ..rowwrite import BULK_ROW_BYTES, FlatWriter
from .opened import forget_all
from .shm import open_segment, remove_segments, segment_plan
from .transport import dump_task, dumps_results, error_payload

__all__ = ["worker_main"]

PARENT_CHECK_S = 1.0   # an idle worker checks this often that the loader's process lives
STOP_CHECK_S = 0.01   # a busy worker looks this often for the stage's stop between rows


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
        self.mm = open_segment(path, size, create=False)
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
        # rows smaller than BULK_ROW_BYTES go in a task's run at a time (write_run):
        # per row, the Python of a write costs more than the copy; bigger rows are
        # written one by one as they come, while they are still in the cache
        writer = FlatWriter.for_layout(layout) \
            if all(v is not None for v in self.views) else None
        self.writer = writer if writer is not None \
            and writer.row_bytes < BULK_ROW_BYTES else None
        self.bufs = [torch.from_numpy(v) for v in self.views] if self.writer is not None else []

    def write_run(self, lo: int, samples: list[Any]) -> bool:
        """Write ``samples`` into rows ``lo, lo + 1, ...`` at once, column by column
        (``FlatWriter.write_rows``: one ``torch.stack`` for a column of tensors);
        False (nothing that matters written) where rows are not written so (big
        rows, or samples that do not all fit the layout the way ``FlatWriter``
        takes them): the caller then writes them one by one."""
        if self.writer is None or not samples:
            return False
        hi = lo + len(samples)
        at: list[Any] = [None] * lo + samples
        try:
            return self.writer.write_rows(self.bufs, self.views, lo, hi, at, bulk=True)
        except Exception:  # noqa: BLE001 - written row by row, where it finds its row
            return False

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


def worker_main(worker_id: int, num_workers: int, dataset: Any, init_fn: Any,
                 base_seed: int, tasks: Any, results: Any, owner: int,
                 collate: Any = None) -> None:
    """A worker's loop: ``(task_id, rows, indices, path, layout, n_rows, collate_here,
    forget, epoch)`` in (pickled, over its own task pipe), one ``(task_id, worker_id,
    out, seconds the rows took)`` back per task; ``None`` (or the pipe closed) ends
    it, between two rows too: a task the loader dropped sends nothing back.
    ``epoch``: an EpochAware dataset's epoch in the loader's process (None
    otherwise), applied to this copy before its rows.  ``collate_here``: the task
    is a whole batch that ``collate`` (the user's ``collate_fn``) collates here
    when every row loaded (:func:`_collated`).

    ``results`` is this worker's own pipe, written synchronously: a worker that dies
    (``os._exit``, a segfault, the OOM killer) between tasks leaves no half-written
    message and holds no lock another worker needs (a shared ``multiprocessing.Queue``
    is written by a feeder thread under a lock shared by every worker: a worker dying
    mid-write used to leave the others, and so the pass, waiting forever).  A
    sample's exception goes back as :func:`~.transport.error_payload` makes it."""
    from torch._utils import ExceptionWrapper
    from torch.utils.data._utils import worker as tw
    torch.set_num_threads(1)
    # what the worker starts with (inherited by a fork: the loader's whole heap, over
    # 100k objects once torch is imported) is never walked by its collections: a full
    # collection of them takes tens of ms, during which the worker's batches wait,
    # and writes to every object's header, copying the pages shared with the loader
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the loader's process handles ^C
    forget_all()  # a forked worker inherits the loader's stages: not its to close
    seed = _seed_like_dataloader(base_seed, worker_id)
    tw._worker_info = tw.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                    dataset=dataset)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except BaseException:  # noqa: BLE001 - reported as the first task's failure
            results.send_bytes(dumps_results((-1, worker_id, ExceptionWrapper(
                sys.exc_info(), where=f"in worker_init_fn of worker process {worker_id}"),
                (0.0, 0.0))))
            return
    mapped: dict[str, _Rows] = {}
    parent = os.getppid()
    inbox = _Tasks(tasks)
    # a task's CPU is the worker's since the last task's: its results' pickling and
    # sending, the next task's receiving, its rows (what a worker took in all)
    spent = time.process_time()
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
        task_id, rows, indices, path, layout, n_rows, collate_here, forget, epoch = task
        if epoch is not None and getattr(dataset, "epoch", epoch) != epoch:
            dataset.set_epoch(epoch)  # the loader's dataset moved on (EpochAware)
        target = _target(mapped, forget, path, layout, n_rows)
        t0 = time.perf_counter()
        out = _run_rows(dataset, rows, indices, target, inbox)
        if inbox.stopped:
            break
        batch = _collated(collate, rows, out) if collate_here and collate else None
        took, now = time.perf_counter() - t0, time.process_time()
        results.send_bytes(dump_task(task_id, worker_id, out, (took, now - spent), batch))
        spent = now
        del out, batch
    for r in mapped.values():
        r.close()


def _collated(collate: Any, rows: list[int], out: list[tuple[int, str, Any]]) -> Any:
    """``collate(samples)`` for a task whose every row loaded and came back as a
    sample; None where a row failed, or ``collate`` raised or returned None: the
    rows then go to the loader's process, which collates them (and raises what it
    raises there, at that batch, as it does for threads)."""
    if len(out) != len(rows) or any(kind != "s" for _, kind, _ in out):
        return None
    try:
        return collate([sample for _, _, sample in out])
    except Exception:  # noqa: BLE001 - raised again where the rows are collated
        return None


def _target(mapped: dict[str, _Rows], forget: list[str], path: str | None, layout: Any,
            n_rows: int) -> _Rows | None:
    """The mapped buffer set a task's rows go into (None: pickled back), mapped on
    first use; the segments the stage let go of (``forget``) are unmapped first."""
    for f in forget:
        r = mapped.pop(f, None)
        if r is not None:
            r.close()
    if path is None:
        return None
    target = mapped.get(path)
    if target is None:
        try:
            target = mapped[path] = _Rows(path, layout, n_rows)
        except OSError:
            target = None
    return target


def _run_rows(dataset: Any, rows: list[int], indices: list[Any], target: _Rows | None,
              inbox: _Tasks) -> list[tuple[int, str, Any]]:
    """``dataset[idx]`` for each row of a task: ``(row, "w", end)`` for rows ``row``
    to ``end`` (exclusive) written into ``target`` (a run written at once is one
    result: one tuple to pickle and read back, not one a row), ``(row, "s",
    sample)`` to pickle back, ``(row, "e", payload)`` for an exception.  Stops
    early when the stage says stop (``inbox.stopped``)."""
    out: list[tuple[int, str, Any]] = []
    held: list[tuple[int, Any]] = []  # loaded rows for one write_run a run
    bulk = target is not None and target.writer is not None
    # rows a run: what they hold dies before it sets off a young collection
    run = gcpauses.rows_held(target.layout.gc_objects, len(rows)) \
        if target is not None and bulk else 0
    for row, idx in zip(rows, indices):
        if inbox.stop_asked():
            break
        try:
            sample = dataset[idx]
        except BaseException as e:  # noqa: BLE001 - travels to the loader's process
            out.append((row, "e", error_payload(e)))
            del e
            continue
        if bulk and target is not None:
            held.append((row, sample))
            if len(held) >= run and not inbox.stopped:
                _write_held(target, held, out)
                held = []
        elif target is not None and target.write(row, sample):
            out.append((row, "w", row + 1))
        else:
            out.append((row, "s", sample))
        del sample
    if held and target is not None and not inbox.stopped:
        _write_held(target, held, out)
    return out


def _write_held(target: _Rows, held: list[tuple[int, Any]], out: list[Any]) -> None:
    """Write the loaded ``(row, sample)`` pairs of a task: each run of consecutive
    rows at once where it can (``_Rows.write_run``), else one by one; a sample
    that does not fit goes back pickled."""
    i = 0
    while i < len(held):
        j = i + 1
        while j < len(held) and held[j][0] == held[j - 1][0] + 1:
            j += 1
        run = held[i:j]
        if target.write_run(run[0][0], [sample for _, sample in run]):
            out.append((run[0][0], "w", run[-1][0] + 1))
        else:
            for row, sample in run:
                out.append((row, "w", row + 1) if target.write(row, sample)
                           else (row, "s", sample))
        i = j
