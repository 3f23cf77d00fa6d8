"""The DataLoader oracle: strict batch comparison and fixed-shape test datasets."""

from __future__ import annotations

import math
from collections import namedtuple
import struct

import numpy as np
import torch
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader

ASYNCFEED_ONLY = ("num_threads", "prefetch", "io_concurrency", "in_order", "on_error",
                  "execution", "multiprocessing_context")
Point = namedtuple("Point", "x y")


def assert_same(a, b, path: str = "batch") -> None:
    """``a`` and ``b`` are the same batch: same types all the way down, same bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        ab = a.detach().reshape(-1).contiguous().view(torch.uint8)
        bb = b.detach().reshape(-1).contiguous().view(torch.uint8)
        if not torch.equal(ab, bb):
            diff = (ab != bb).nonzero().reshape(-1)[:1].tolist()
            raise AssertionError(f"{path}: tensor bits differ ({int((ab != bb).sum())} bytes, "
                                 f"first at byte {diff}); first elements "
                                 f"{a.reshape(-1)[:6].tolist()} vs {b.reshape(-1)[:6].tolist()}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != " \
                                                          f"{b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array bits differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want), f"{len(got)} batches, DataLoader gave {len(want)}"
    for k, (a, b) in enumerate(zip(got, want)):
        assert_same(a, b, f"batch {k}")


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def both(ds, seed: int = 1234, make=None, **kw):
    """(AsyncLoader batches, DataLoader batches, the two generators after the epoch).

    ``make(generator)`` returns extra keyword arguments built around a generator
    (a sampler or batch sampler), so each loader gets its own, seeded alike.
    """
    own = {k: kw.pop(k) for k in ASYNCFEED_ONLY if k in kw}
    g_a, g_d = gen(seed), gen(seed)
    extra_a = make(g_a) if make else {}
    extra_d = make(g_d) if make else {}
    dl = DataLoader(ds, generator=g_d, **kw, **extra_d)
    want = list(dl)
    with AsyncLoader(ds, generator=g_a, **kw, **extra_a, **own) as al:
        assert len(al) == len(dl)
        got = list(al)
    return got, want, g_a, g_d


def assert_parity(ds, seed: int = 1234, make=None, **kw) -> list:
    got, want, g_a, g_d = both(ds, seed, make, **kw)
    assert_same_batches(got, want)
    assert torch.equal(g_a.get_state(), g_d.get_state()), "the generator advanced differently"
    return got


class MixedFixed:
    """Fixed-shape samples of every structure and leaf type default_collate knows."""

    def __init__(self, n: int = 45) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(i)
        special = torch.tensor([math.nan, -0.0, math.inf, 1.0 / (i + 3)], dtype=torch.float32)
        return {
            "img": torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8, generator=g),
            "f32": torch.randn(6, generator=g),
            "special": special,
            "f64": torch.randn(2, 2, dtype=torch.float64, generator=g),
            "f16": torch.randn(3, generator=g).half(),
            "bf16": torch.randn(3, generator=g).bfloat16(),
            "i8": torch.tensor([i % 128 - 64], dtype=torch.int8),
            "i32": torch.arange(3, dtype=torch.int32) * i,
            "i64": torch.tensor(i),
            "mask": torch.tensor([i % 2 == 0, i % 3 == 0]),
            "np_f32": np.arange(4, dtype=np.float32) * i,
            "np_i16": np.full((2, 1), i, dtype=np.int16),
            "np_u8": np.uint8(i) * np.ones((), dtype=np.uint8),
            "np_bool": np.array([i % 5 == 0]),
            "label": i % 5,
            "weight": i / 7,
            "flag": i % 2 == 0,
            "name": f"sample-{i}",
            "blob": bytes([i % 256]),
            "pair": (i, float(i) / 3),
            "point": Point(torch.tensor([i, -i]), i * 2),
            "nested": [[i, i + 1], {"k": torch.full((2,), float(i))}],
        }


class TupleFixed:
    """(image, label) tuples, as most vision datasets return them."""

    def __init__(self, n: int = 200, shape=(3, 8, 8)) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g), i % 10
