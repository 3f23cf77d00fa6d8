"""The public surface: names, DataLoader's signature, argument validation, attributes."""

from __future__ import annotations

import inspect
import os
import pickle
import types
import warnings

import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler, default_collate, default_convert)

import asyncfeed
from asyncfeed import (AsyncFeedError, AsyncLoader, LoaderClosedError, LoaderStats,
                       LoaderTimeout, SampleError, StateError)
from support.oracle import assert_same_batches

pytestmark = pytest.mark.timeout(60)


class Squares:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([i, i * i]), i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


# ------------------------------------------------------------------ public names
def test_all_is_sorted_and_is_the_public_names():
    names = asyncfeed.__all__
    assert names == sorted(names), "__all__ is not sorted"
    assert len(set(names)) == len(names), "__all__ has duplicates"
    public = {n for n, v in vars(asyncfeed).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    public |= set(asyncfeed._LAZY)  # exported names imported on first use
    assert set(names) == public
    for n in names:
        assert getattr(asyncfeed, n) is not None


def test_public_names_are_documented():
    for n in asyncfeed.__all__:
        obj = getattr(asyncfeed, n)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{n} has no docstring"
    for name, member in inspect.getmembers(AsyncLoader):
        if not name.startswith("_") and (inspect.isfunction(member) or
                                         isinstance(member, property)):
            assert inspect.getdoc(member), f"AsyncLoader.{name} has no docstring"


def test_exception_hierarchy():
    for cls in (SampleError, LoaderTimeout, LoaderClosedError, StateError):
        assert issubclass(cls, AsyncFeedError)
    assert issubclass(AsyncFeedError, Exception)
    assert issubclass(LoaderTimeout, TimeoutError)
    assert issubclass(LoaderClosedError, RuntimeError)


def test_sample_error_pickles():
    cause = OSError("disk on fire")
    e = SampleError(12, "/data/x.jpg", cause, batch=3)
    assert str(e) == "sample 12 (/data/x.jpg) in batch 3 failed: OSError: disk on fire"
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is SampleError
    assert (e2.index, e2.source, e2.batch, str(e2)) == (12, "/data/x.jpg", 3, str(e))
    assert isinstance(e2.cause, OSError)


# ------------------------------------------------------- DataLoader's signature
def test_signature_follows_dataloader():
    ours = inspect.signature(AsyncLoader).parameters
    theirs = inspect.signature(DataLoader).parameters
    positional = [n for n, p in theirs.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [n for n, p in ours.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] == positional
    for name, p in theirs.items():
        assert name in ours, f"DataLoader argument {name} is missing"
        if name != "dataset" and name not in ("shuffle", "pin_memory"):
            assert ours[name].default == p.default, name


def test_positional_arguments_in_dataloader_order():
    ds = Squares()
    torch.manual_seed(0)
    want = list(DataLoader(ds, 4, True))
    torch.manual_seed(0)
    with AsyncLoader(ds, 4, True) as al:
        assert al.batch_size == 4
        assert_same_batches(list(al), want)

    def collate(b):
        return [s[1] for s in b]

    args = (ds, 3, False, None, None, 0, collate, False, True, 0, None, None,
            torch.Generator().manual_seed(1))
    with AsyncLoader(*args) as al:
        assert al.drop_last is True and al.collate_fn is collate
        got = list(al)
    assert got == list(DataLoader(*args)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_dataloader_only_arguments_are_accepted():
    ds = Squares()
    kw = dict(num_workers=4, worker_init_fn=lambda worker_id: None, prefetch_factor=2,
              persistent_workers=True, multiprocessing_context="spawn", pin_memory_device="",
              in_order=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        al = AsyncLoader(ds, batch_size=3, **kw)
    with al:
        got = list(al)
        assert al.num_workers == 4
    assert_same_batches(got, list(DataLoader(ds, batch_size=3)))


def test_dataloader_attributes():
    ds = Squares()
    g = torch.Generator()
    for kw in (dict(batch_size=3, shuffle=True, generator=g), dict(batch_size=3),
               dict(batch_size=None)):
        dl = DataLoader(ds, **kw)
        with AsyncLoader(ds, **kw) as al:
            assert al.dataset is ds
            assert al.batch_size == dl.batch_size
            assert al.drop_last == dl.drop_last
            assert al.generator is dl.generator
            assert al.timeout == dl.timeout
            assert al.collate_fn is dl.collate_fn
            assert type(al.sampler) is type(dl.sampler)
            assert type(al.batch_sampler) is type(dl.batch_sampler)
            assert len(al) == len(dl)
            it = iter(al)
            assert len(it) == len(dl)
            list(it)
    with AsyncLoader(ds, batch_size=3, shuffle=True) as al:
        assert isinstance(al.sampler, RandomSampler)
        assert isinstance(al.batch_sampler, BatchSampler)
    with AsyncLoader(ds) as al:
        assert isinstance(al.sampler, SequentialSampler)
        assert al.collate_fn is default_collate
    with AsyncLoader(ds, batch_size=None) as al:
        assert al.collate_fn is default_convert and al.batch_sampler is None


def test_defaults():
    with AsyncLoader(Squares()) as al:
        cores = len(os.sched_getaffinity(0))
        if "LOCAL_WORLD_SIZE" not in os.environ:
            assert al.num_threads == cores + min(2, cores)
        assert al.io_concurrency == 64
        assert al.prefetch >= 2
        assert al.in_order is True
        assert al.on_error == "raise"
        assert al.device is None and al.pin_memory is False
        assert al.timeout == 0 and al.batch_size == 1


# -------------------------------------------------------------------- validation
BAD_SHARED = [  # rejected by DataLoader too: same exception type
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=-3), ValueError, "batch_size"),
    (dict(batch_size=2.5), ValueError, "batch_size"),
    (dict(batch_size="4"), ValueError, "batch_size"),
    (dict(shuffle=True, sampler=[0, 1]), ValueError, "sampler"),
    (dict(batch_sampler=[[0, 1]], batch_size=4), ValueError, "batch_sampler"),
    (dict(batch_sampler=[[0, 1]], shuffle=True), ValueError, "batch_sampler"),
    (dict(batch_sampler=[[0, 1]], sampler=[0]), ValueError, "batch_sampler"),
    (dict(batch_sampler=[[0, 1]], drop_last=True), ValueError, "batch_sampler"),
    (dict(batch_size=None, drop_last=True), ValueError, "drop_last"),
    (dict(timeout=-1), ValueError, "timeout"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_SHARED)
def test_invalid_arguments_like_dataloader(kw, exc, match):
    with pytest.raises(exc):
        DataLoader(Squares(), **kw)
    with pytest.raises(exc, match=match):
        AsyncLoader(Squares(), **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(shuffle=True), "shuffle"), (dict(sampler=[0, 1]), "sampler"),
    (dict(batch_sampler=[[0, 1]]), "batch_sampler")])
def test_iterable_dataset_rejects_sampling_options(kw, match):
    with pytest.raises(ValueError):
        DataLoader(Stream(), **kw)
    with pytest.raises(ValueError, match=match):
        AsyncLoader(Stream(), **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(on_error="ignore"), "on_error"), (dict(on_error=None), "on_error"),
    (dict(num_threads=0), "num_threads"), (dict(num_threads=-2), "num_threads"),
    (dict(num_threads=1.5), "num_threads"), (dict(io_concurrency=0), "io_concurrency"),
    (dict(io_concurrency=2.0), "io_concurrency"), (dict(prefetch=0), "prefetch"),
    (dict(prefetch=-1), "prefetch"), (dict(device="mps"), "device"),
])
def test_invalid_own_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        AsyncLoader(Squares(), **kw)


def test_invalid_seed():
    with pytest.raises(TypeError, match="seed"):
        AsyncLoader(Squares(), seed="3")


def test_seed_and_generator_together_warn():
    with pytest.warns(UserWarning, match="seed"):
        AsyncLoader(Squares(), seed=1, generator=torch.Generator()).close()


def test_not_a_dataset():
    with pytest.raises(TypeError):
        AsyncLoader(42)


def test_set_epoch_validates():
    with AsyncLoader(Squares(), shuffle=True, seed=0) as al:
        for bad in (-1, 1.5, "2"):
            with pytest.raises(ValueError):
                al.set_epoch(bad)
        al.set_epoch(3)
        assert al.epoch == 3


def test_set_epoch_is_forwarded_to_the_sampler():
    class EpochSampler(SequentialSampler):
        epochs: list[int] = []

        def set_epoch(self, e):
            self.epochs.append(e)

    s = EpochSampler(Squares())
    with AsyncLoader(Squares(), sampler=s) as al:
        al.set_epoch(2)
    assert s.epochs == [2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1), 0])
def test_cuda_device_without_cuda(device):
    with pytest.raises(ValueError, match="CUDA"):
        AsyncLoader(Squares(), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_pin_memory_without_cuda_warns():
    with pytest.warns(UserWarning, match="pin_memory"):
        al = AsyncLoader(Squares(), batch_size=5, pin_memory=True)
    with al:
        batches = list(al)
    assert len(batches) == 2 and not batches[0][0].is_pinned()


def test_cpu_device():
    for device in ("cpu", torch.device("cpu")):
        with AsyncLoader(Squares(), batch_size=5, device=device) as al:
            assert al.device is None
            assert all(b[0].device.type == "cpu" for b in al)


# -------------------------------------------------------------------------- stats
def test_stats():
    with AsyncLoader(Squares(), batch_size=3) as al:
        s0 = al.stats()
        assert isinstance(s0, LoaderStats)
        assert (s0.batches, s0.samples, s0.skipped) == (0, 0, [])
        al.set_epoch(2)
        list(al)
        s = al.stats()
        assert (s.epoch, s.batches, s.samples) == (2, 4, 10)
        assert s.wait_s >= 0 and s.slot_waits == 0
        s.skipped.append("x")
        assert al.stats().skipped == [], "stats() must return a snapshot"


def test_stats_count_samples_with_a_custom_collate():
    """``samples`` counts samples, whatever ``collate_fn`` makes of them."""
    with AsyncLoader(Squares(), batch_size=3, collate_fn=lambda b: [s[1] for s in b]) as al:
        list(al)
        assert al.stats().samples == 10
    with AsyncLoader(Squares(), batch_size=3,
                     collate_fn=lambda b: {"n": len(b), "ids": [s[1] for s in b]}) as al:
        list(al)
        assert al.stats().samples == 10
    with AsyncLoader(Squares(), batch_size=None) as al:   # no batching: a sample a batch
        list(al)
        assert (al.stats().batches, al.stats().samples) == (10, 10)


def test_closed_loader_error_message():
    al = AsyncLoader(Squares())
    al.close()
    with pytest.raises(LoaderClosedError, match="closed"):
        iter(al)


def test_get_worker_info_is_none_as_with_num_workers_0():
    class Info:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.utils.data.get_worker_info() is None

    with AsyncLoader(Info(), batch_size=3, num_threads=2) as al:
        assert [b.tolist() for b in al] == [[True] * 3] * 2


def test_default_threads_share_the_cores_among_local_ranks(monkeypatch):
    from asyncfeed._engine.resources import available_cores, default_threads
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = available_cores()
    assert default_threads() == cores + min(2, cores)
    with AsyncLoader(Squares()) as al:
        assert al.num_threads == default_threads()
    if cores == (os.cpu_count() or cores):   # affinity does not already split the node
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        assert default_threads() == 2       # one core each, plus one spare
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
        assert default_threads() == cores + min(2, cores)
