"""What travels between a worker process and the loader's: results pickled
(plain CPU tensors as their bytes), and exceptions with their traceback text."""

from __future__ import annotations

import io
import pickle
import time
from typing import Any

import torch
from multiprocessing.reduction import ForkingPickler

from ..._errors import (AsyncFeedError, SampleError, describe, set_remote_traceback,
                        traceback_text)

__all__ = ["dump_task", "dumps_results", "error_payload", "rebuild", "travel_cost",
           "unwrap"]


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


def travel_cost(samples: list[Any], budget_s: float = float("inf")
                ) -> tuple[float, float] | None:
    """The CPU seconds (this thread's) to pickle a row as a worker sends it back
    (:func:`dumps_results`) and to unpickle it here, each the least over
    ``samples``: what a row that a worker pickles whole costs at least on each
    side, so that costs read from them bound the workers' rate from above.
    Stops once the round trips took ``budget_s`` (large rows: the first ones
    tell).  None where no sample pickles."""
    least: tuple[float, float] | None = None
    spent = 0.0
    for sample in samples:
        t0 = time.thread_time()
        try:
            data = bytes(dumps_results(sample))
        except Exception:  # noqa: BLE001 - a row that cannot travel fails there anyway
            continue
        t1 = time.thread_time()
        pickle.loads(data)
        t2 = time.thread_time()
        del data
        cost = (t1 - t0, t2 - t1)
        least = cost if least is None else (min(least[0], cost[0]), min(least[1], cost[1]))
        spent += t2 - t0
        if spent >= budget_s:
            break
    return least


def error_payload(e: BaseException) -> tuple[bytes | None, str, list[str]]:
    """A worker's exception as it travels: the exception pickled (None where it
    cannot be pickled, or not rebuilt from its pickle), its ``Type: message``, and
    the traceback texts taken here (its own; for a dataset's own ``SampleError``,
    its cause's too: the consumer names the sample by that cause, see
    ``rebuild_error``).  The loader's process rebuilds it with :func:`rebuild`."""
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


def rebuild(payload: tuple[bytes | None, str, list[str]]) -> BaseException:
    """The exception :func:`error_payload` sent: of its type, with its message,
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


def dump_task(task_id: int, worker_id: int, out: list[tuple[int, str, Any]],
               took: tuple[float, float], batch: Any = None) -> memoryview:
    """A task's results and what it took (wall and CPU seconds in the worker),
    pickled (:func:`dumps_results`): ``batch`` (the task's rows collated, one
    ``"c"`` result) where given and it pickles, else the rows; a sample that
    cannot be pickled fails its row (an :class:`AsyncFeedError` naming why), not
    the worker."""
    if batch is not None and out:
        try:
            return dumps_results((task_id, worker_id, [(out[0][0], "c", batch)], took))
        except Exception:  # noqa: BLE001 - it cannot travel: the rows go instead
            pass
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
                sendable.append((row, "e", error_payload(err)))
                continue
        sendable.append((row, kind, payload))
    return dumps_results((task_id, worker_id, sendable, took))


def unwrap(wrapper: Any) -> BaseException:
    """The exception a worker sent wrapped as DataLoader's workers wrap theirs
    (``worker_init_fn``'s failure)."""
    try:
        wrapper.reraise()
    except BaseException as e:  # noqa: BLE001
        return e
    return AsyncFeedError("a worker failed")  # pragma: no cover
