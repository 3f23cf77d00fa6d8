"""Small datasets and helpers shared by the engine tests."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset

from asyncfeed import AsyncLoader


class Ids(Dataset):
    def __init__(self, n: int = 97, bad: tuple[int, ...] = ()) -> None:
        self.n, self.bad = n, set(bad)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.bad:
            raise ValueError(f"bad {i}")
        return torch.full((2,), i), i


class Spin(Dataset):
    """Rows of about ``us`` microseconds of pure Python (the GIL held throughout, as a
    Python-heavy transform holds it): ``(int64 array of 3, index)``."""

    def __init__(self, n: int, us: float) -> None:
        self.n, self.us = n, us

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.thread_time() + self.us * 1e-6
        while time.thread_time() < end:
            pass
        return np.full(3, i, np.int64), i


def ids(batch) -> list[int]:
    return batch[1].tolist()


def make(kw: dict, **extra) -> AsyncLoader:
    kw = dict(kw)
    bad = kw.pop("bad", ())
    if "generator" in kw:
        kw["generator"] = torch.Generator().manual_seed(kw["generator"])
    return AsyncLoader(Ids(97, bad), batch_size=8, **kw, **extra)


def chunks(xs: list, n: int, drop_last: bool = False) -> list[list]:
    out = [xs[i:i + n] for i in range(0, len(xs), n)]
    if drop_last and out and len(out[-1]) < n:
        out.pop()
    return out


def next_or_error(it):
    """``next(it)``, or the exception it raised (StopIteration returned as such)."""
    try:
        return next(it)
    except BaseException as e:  # noqa: BLE001
        return e


def _drain(it) -> list:
    """Every batch or error, DataLoader-style, until StopIteration."""
    out = []
    while True:
        x = next_or_error(it)
        if isinstance(x, StopIteration):
            return out
        out.append(x)


drain = _drain


class SwitchAtRow(Dataset):
    """Fixed-shape rows.  In the loader's process, loading row ``trigger`` asks the
    loader's chooser for two worker processes (as a measured choice would) and
    then holds its decode thread until
    the process stage has started, so that the batches planned meanwhile are
    still queued for the threads when the stage takes over.  Picklable for any
    start method (the loader is not pickled)."""

    def __init__(self, n: int, trigger: int) -> None:
        import os
        self.n, self.trigger, self.parent = n, trigger, os.getpid()
        self.loader: AsyncLoader | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "loader": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import os
        import time
        al = self.loader
        if i == self.trigger and al is not None and os.getpid() == self.parent:
            from asyncfeed._engine.policy import processes
            al._chooser.request(processes(2))  # as a measured choice would
            deadline = time.monotonic() + 30
            while al._exec.stage is None and time.monotonic() < deadline:
                time.sleep(0.005)
        return torch.full((3, 4), i, dtype=torch.int64), i % 7
