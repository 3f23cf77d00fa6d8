"""AsyncLoader yields exactly what ``torch.utils.data.DataLoader(num_workers=0)`` yields.

The real DataLoader is the oracle everywhere: same arguments, two generators
seeded identically, then the batches are compared with :func:`assert_same`,
which checks container types, dtypes, shapes, strides and the bits of every
tensor (NaN and -0.0 included).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import numpy as np
import pytest
import simplejpeg
import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler, SubsetRandomSampler, WeightedRandomSampler,
                              default_collate)

import asyncfeed
from asyncfeed import AsyncLoader
from support.executions import EXECUTIONS, on
from support.oracle import (MixedFixed, Point, TupleFixed, assert_parity, assert_same,
                            assert_same_batches, gen)

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- helpers






class Slow(TupleFixed):
    """TupleFixed whose loads take a random short time, so completion order varies."""

    def __getitem__(self, i: int):
        time.sleep(random.random() * 0.002)
        return super().__getitem__(i)


def test_assert_same_is_strict():
    """The comparison used everywhere here can fail, for every kind of difference."""
    nan = float("nan")
    assert_same([torch.tensor([nan, -0.0]), {"a": 1, "b": "x"}, Point(1, 2.5)],
                [torch.tensor([nan, -0.0]), {"a": 1, "b": "x"}, Point(1, 2.5)])
    t = torch.arange(6.0).reshape(2, 3)
    different = [
        ([1, 2], (1, 2)), (1, True), (1, 1.0), (0.0, -0.0), ("a", b"a"),
        (Point(1, 2), (1, 2)), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),
        (torch.tensor([0.0]), torch.tensor([-0.0])),
        (torch.tensor([1, 2]), torch.tensor([[1, 2]])),
        (t.t().contiguous(), t.t()),
        (torch.tensor([1.0]), torch.tensor([1.0], requires_grad=True)),
        (np.zeros(2, np.float32), np.zeros(2, np.float64)),
        ([torch.tensor([1])], [torch.tensor([2])]),
    ]
    for a, b in different:
        with pytest.raises(AssertionError):
            assert_same(a, b)


# ----------------------------------------------------------- the argument matrix
@pytest.mark.parametrize("batch_size", [1, 7, None])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matrix_mixed_structures(shuffle, drop_last, batch_size):
    if batch_size is None and drop_last:
        pytest.skip("DataLoader rejects drop_last without batch_size")
    got = assert_parity(MixedFixed(), shuffle=shuffle, drop_last=drop_last,
                        batch_size=batch_size)
    assert got, "no batches"


@pytest.mark.parametrize("num_threads,prefetch,execution",
                         [(1, 1, "threads"), (1, 3, "threads"), (2, 1, "threads"),
                          (2, 3, "threads")]
                         + [(2, p, e) for e in EXECUTIONS if e != "threads" for p in (1, 3)],
                         indirect=["execution"])
def test_mixed_structures_through_the_ring(num_threads, prefetch, execution):
    """Small prefetch: the layout is known before most batches are submitted."""
    assert_parity(MixedFixed(60), shuffle=True, batch_size=4, num_threads=num_threads,
                  prefetch=prefetch, **on(execution))


def test_tuple_samples_become_lists_and_ring_is_used():
    ds = TupleFixed(200)
    g_a, g_d = gen(), gen()
    want = list(DataLoader(ds, batch_size=8, shuffle=True, generator=g_d))
    with AsyncLoader(ds, batch_size=8, shuffle=True, generator=g_a, prefetch=2) as al:
        got = []
        for b in al:
            got.append(b)
        assert al.stats().path == "ring", al.stats()
        assert al.stats().batches == 25 and al.stats().samples == 200
    assert_same_batches(got, want)
    assert type(got[0]) is list and got[0][0].dtype == torch.uint8
    assert got[0][1].dtype == torch.int64
    # every batch is its own memory: none was overwritten by a later one
    assert len({b[0].data_ptr() for b in got}) == len(got)


def test_default_collate_passed_explicitly_is_the_default():
    assert_parity(TupleFixed(50), batch_size=6, shuffle=True, collate_fn=default_collate,
                  prefetch=2)


def test_single_tensor_and_single_scalar_samples():
    class Tensors:
        def __len__(self):
            return 23

        def __getitem__(self, i):
            return torch.arange(4, dtype=torch.float64) + i

    class Scalars:
        def __len__(self):
            return 23

        def __getitem__(self, i):
            return i * 3

    class Strings:
        def __len__(self):
            return 23

        def __getitem__(self, i):
            return f"s{i}"

    for ds in (Tensors(), Scalars(), Strings()):
        assert_parity(ds, batch_size=5, shuffle=True, prefetch=2)
        assert_parity(ds, batch_size=None)


def test_plain_list_dataset():
    data = [(torch.tensor([i, i * i]), {"y": i}) for i in range(30)]
    assert_parity(data, batch_size=4, shuffle=True)


# ------------------------------------------------------------------- samplers
@pytest.mark.parametrize("kind", ["subset_random", "weighted", "list", "sequential",
                                  "random_replacement"])
def test_custom_sampler(kind, execution):
    ds = MixedFixed(40)

    def make(g):
        if kind == "subset_random":
            return {"sampler": SubsetRandomSampler(list(range(3, 37, 2)), generator=g)}
        if kind == "weighted":
            w = [float(i % 4 + 1) for i in range(len(ds))]
            return {"sampler": WeightedRandomSampler(w, num_samples=33, replacement=True,
                                                     generator=g)}
        if kind == "list":
            return {"sampler": [5, 3, 39, 0, 0, 7, 12, 8, 1]}
        if kind == "sequential":
            return {"sampler": SequentialSampler(ds)}
        return {"sampler": RandomSampler(ds, replacement=True, num_samples=50, generator=g)}

    assert_parity(ds, make=make, batch_size=4, **on(execution))
    assert_parity(ds, make=make, batch_size=4, drop_last=True, **on(execution))
    assert_parity(ds, make=make, batch_size=None, **on(execution))


@pytest.mark.parametrize("kind", ["lists", "random_batches"])
def test_custom_batch_sampler(kind, execution):
    ds = MixedFixed(40)

    def make(g):
        if kind == "lists":
            return {"batch_sampler": [[0, 1, 2], [5], [9, 8, 7, 6], [39, 0]]}
        return {"batch_sampler": BatchSampler(RandomSampler(ds, generator=g), 6, False)}

    assert_parity(ds, make=make, **on(execution))


def test_custom_collate_fn(execution):
    def collate(batch):
        return {"n": len(batch), "labels": [s["label"] for s in batch],
                "img": torch.stack([s["img"] for s in batch]).float().mean(0),
                "names": tuple(s["name"] for s in batch)}

    assert_parity(MixedFixed(), batch_size=6, shuffle=True, collate_fn=collate, **on(execution))
    assert_parity(MixedFixed(), batch_size=None, collate_fn=lambda s: (s["label"], s["name"]),
                  **on(execution))


class _Drawn(torch.utils.data.Sampler):
    """0..n-1 in order, counting how many were drawn so far."""

    def __init__(self, n: int) -> None:
        self.n, self.drawn = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.drawn += 1
            yield i

    def __len__(self) -> int:
        return self.n


def test_inline_draws_the_sampler_when_each_batch_is_asked_for():
    """Rows inline, as ``num_workers=0``, on collated batches: each batch is planned
    when the consumer asks for it, so the sampler is drawn as DataLoader draws it
    (a sampler that adapts to what the training loop saw, a curriculum or
    hard-example mining, sees each batch's outcome before the next is drawn)."""
    def drawn_at_each_batch(loader, sampler) -> list[int]:
        return [sampler.drawn for _ in loader]

    ds = TupleFixed(40)
    want = drawn_at_each_batch(DataLoader(ds, batch_size=4, sampler=(s := _Drawn(40)),
                                          collate_fn=list), s)
    with AsyncLoader(ds, batch_size=4, sampler=(a := _Drawn(40)), collate_fn=list,
                     execution="inline") as al:
        got = drawn_at_each_batch(al, a)
    assert got == want == list(range(4, 41, 4))


class WithGetitems(TupleFixed):
    def __init__(self, n: int = 50) -> None:
        super().__init__(n)
        self.calls = 0
        self.lock = threading.Lock()

    def __getitems__(self, indices):
        with self.lock:
            self.calls += 1
        return [self[i] for i in indices]


def test_dataset_with_getitems():
    ds = WithGetitems()
    assert_parity(ds, batch_size=6, shuffle=True)
    n = len(DataLoader(ds, batch_size=6))
    assert ds.calls == 2 * n, "both loaders should load whole batches through __getitems__"
    assert_parity(ds, batch_size=6, shuffle=True, drop_last=True,
                  collate_fn=lambda b: [s[1] for s in b])


def test_getitems_returning_a_batched_tensor_with_identity_collate():
    """DataLoader hands whatever ``__getitems__`` returns to ``collate_fn`` unchanged."""
    class Table:
        data = torch.arange(120, dtype=torch.float32).reshape(40, 3)

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return self.data[i]

        def __getitems__(self, indices):
            return self.data[indices]

    assert_parity(Table(), batch_size=8, shuffle=True, collate_fn=lambda x: x)


# --------------------------------------------- samples that are not fixed-shape
class Ragged:
    """Variable-length tensors, None values, mixed Python types."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"seq": torch.arange(i % 5 + 1, dtype=torch.int64) * i,
                "maybe": None if i % 3 == 0 else float(i),
                "text": "x" * (i % 4),
                "meta": {"id": i, "tags": ["a"] * (i % 3)}}


def pad_collate(batch):
    seqs = [s["seq"] for s in batch]
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.int64)
    for r, s in enumerate(seqs):
        out[r, :len(s)] = s
    return {"seq": out, "lengths": torch.tensor([len(s) for s in seqs]),
            "maybe": [s["maybe"] for s in batch], "text": [s["text"] for s in batch],
            "meta": [s["meta"] for s in batch]}


@pytest.mark.parametrize("shuffle", [False, True])
def test_ragged_samples_with_custom_collate(shuffle, execution):
    assert_parity(Ragged(), batch_size=5, shuffle=shuffle, collate_fn=pad_collate,
                  **on(execution))
    assert_parity(Ragged(), batch_size=None, **on(execution))


class VarShape:
    """Tensors whose length depends on the index (full-size images, sequences)."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        return torch.full((i % 3 + 1, 2), float(i)), i


def test_variable_shapes_with_batch_size_one(execution):
    """Each batch holds one sample, so default_collate always succeeds."""
    assert_parity(VarShape(), batch_size=1, shuffle=True, **on(execution))


def test_variable_shapes_bucketed_by_a_batch_sampler(execution):
    """A length-bucketing batch sampler: every batch is uniform, batches differ."""
    buckets = [[i for i in range(30) if i % 3 == r] for r in (1, 0, 2)]
    batch_sampler = [b[j:j + 4] for b in buckets for j in range(0, len(b), 4)]
    assert_parity(VarShape(), batch_sampler=batch_sampler, **on(execution))


def test_mixed_python_number_types_in_one_field(execution):
    """default_collate promotes [1.0, 2] to float64 and [True, 2] to int64."""
    class Numbers:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return torch.zeros(2), (1.0 if i % 5 else 2), (True if i % 7 else 3)

    assert_parity(Numbers(), batch_size=4, prefetch=1, **on(execution))


# -------------------------------------------------------------- epochs and RNGs
def test_several_epochs_with_one_generator(execution):
    ds = MixedFixed(30)
    g_a, g_d = gen(7), gen(7)
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=g_d)
    with AsyncLoader(ds, batch_size=4, shuffle=True, generator=g_a, **on(execution)) as al:
        firsts = []
        for epoch in range(3):
            got, want = list(al), list(dl)
            assert_same_batches(got, want)
            assert torch.equal(g_a.get_state(), g_d.get_state()), f"epoch {epoch}"
            firsts.append(got[0]["label"].tolist() + got[1]["label"].tolist())
    assert firsts[0] != firsts[1] or firsts[1] != firsts[2], "epochs were not reshuffled"


def test_global_rng_when_no_generator_is_given():
    ds = TupleFixed(40)
    torch.manual_seed(99)
    want = [list(DataLoader(ds, batch_size=5, shuffle=True)) for _ in range(2)]
    state_d = torch.get_rng_state()
    torch.manual_seed(99)
    with AsyncLoader(ds, batch_size=5, shuffle=True) as al:
        got = [list(al) for _ in range(2)]
    state_a = torch.get_rng_state()
    for g, w in zip(got, want):
        assert_same_batches(g, w)
    assert torch.equal(state_a, state_d), "the global RNG advanced differently"


def test_generator_after_a_pass_that_was_cut_short(execution):
    """A ``break`` after the first batch: the next epoch still matches DataLoader."""
    ds = TupleFixed(12)
    g_a, g_d = gen(3), gen(3)
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=g_d)
    with AsyncLoader(ds, batch_size=4, shuffle=True, generator=g_a, **on(execution)) as al:
        for got, want in zip(al, dl):
            assert_same(got, want)
            break
        assert_same_batches(list(al), list(dl))
    assert torch.equal(g_a.get_state(), g_d.get_state())


def test_seed_and_set_epoch_match_dataloader_with_seeded_generator():
    ds = TupleFixed(30)
    with AsyncLoader(ds, batch_size=4, shuffle=True, seed=11) as al:
        for epoch in (0, 1, 2, 5):
            al.set_epoch(epoch)
            # seed mode shuffles as DistributedSampler does: randperm with seed + epoch
            want = list(DataLoader(ds, batch_size=4,
                                   sampler=RandomSampler(ds, generator=gen(11 + epoch))))
            assert_same_batches(list(al), want)


def test_seed_mode_leaves_the_global_rng_alone():
    ds = TupleFixed(20)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with AsyncLoader(ds, batch_size=4, shuffle=True, seed=1) as al:
        list(al)
    assert torch.equal(before, torch.get_rng_state()), \
        "seed= mode drew from torch's global RNG (DataLoader with a generator does not)"


def test_seed_epochs_differ_and_repeat():
    ds = TupleFixed(40)

    def labels(loader):
        return [b[1].tolist() for b in loader]

    with AsyncLoader(ds, batch_size=8, shuffle=True, seed=3) as al:
        e0 = labels(al)
        e0_again = labels(al)
        al.set_epoch(1)
        e1 = labels(al)
        al.set_epoch(0)
        e0_back = labels(al)
    assert e0 == e0_again == e0_back
    assert e0 != e1
    assert sorted(sum(e0, [])) == sorted(sum(e1, []))
    with AsyncLoader(ds, batch_size=8, shuffle=True, seed=4) as other:
        assert labels(other) != e0


@pytest.fixture(scope="module")
def seeded_reference():
    ds = Slow(48, shape=(2, 3))
    with AsyncLoader(ds, batch_size=5, shuffle=True, seed=21, num_threads=1, prefetch=1) as al:
        al.set_epoch(2)
        return ds, list(al)


@pytest.mark.parametrize("prefetch", [1, 2, 8])
@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_seed_determinism_across_threads_and_prefetch(seeded_reference, num_threads,
                                                      prefetch):
    ds, ref = seeded_reference
    with AsyncLoader(ds, batch_size=5, shuffle=True, seed=21, num_threads=num_threads,
                     prefetch=prefetch) as al:
        al.set_epoch(2)
        assert_same_batches(list(al), ref)


@pytest.mark.parametrize("num_threads", [2, 4])
def test_out_of_order_delivery_yields_the_same_batches(seeded_reference, num_threads):
    ds, ref = seeded_reference
    with AsyncLoader(ds, batch_size=5, shuffle=True, seed=21, num_threads=num_threads,
                     prefetch=8, in_order=False) as al:
        al.set_epoch(2)
        got = list(al)
    assert len(got) == len(ref)

    def key(b):
        return (tuple(b[0].reshape(-1).tolist()), tuple(b[1].tolist()))

    assert Counter(map(key, got)) == Counter(map(key, ref))
    for b in got:                       # and each one is a well-formed batch
        match = next(r for r in ref if key(r) == key(b))
        assert_same(b, match)


# --------------------------------------------------------------- iterable data
class Stream(IterableDataset):
    def __init__(self, n: int = 23, with_len: bool = True) -> None:
        self.n = n
        self.with_len = with_len

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.tensor([i, -i], dtype=torch.int16), "id": i, "s": str(i)}

    def __len__(self):
        if not self.with_len:
            raise TypeError("no length")
        return self.n


@pytest.mark.parametrize("batch_size,drop_last", [(4, False), (4, True), (1, False),
                                                  (None, False), (23, True), (30, True)])
def test_iterable_dataset(batch_size, drop_last):
    ds = Stream()
    want = list(DataLoader(ds, batch_size=batch_size, drop_last=drop_last))
    with AsyncLoader(ds, batch_size=batch_size, drop_last=drop_last) as al:
        assert len(al) == len(DataLoader(ds, batch_size=batch_size, drop_last=drop_last))
        got = list(al)
        assert al.stats().path == "iterable"
    assert_same_batches(got, want)


def test_iterable_dataset_with_collate_fn_and_without_len():
    ds = Stream(17, with_len=False)

    def collate(batch):
        return [s["id"] for s in batch]

    assert_same_batches(list(AsyncLoader(ds, batch_size=3, collate_fn=collate)),
                        list(DataLoader(ds, batch_size=3, collate_fn=collate)))
    with pytest.raises(TypeError):
        len(AsyncLoader(ds, batch_size=3))


# ------------------------------------------------------------------ async path
class AsyncSplit:
    """A dataset that splits its work: async fetch on the event loop, decode in threads."""

    def __init__(self, n: int = 60) -> None:
        self.n = n
        self.fetches = 0
        self.fetch_threads: set[str] = set()
        self.decode_threads: set[str] = set()
        self.in_flight = 0
        self.max_in_flight = 0

    def __len__(self):
        return self.n

    def _raw(self, i: int) -> bytes:
        return bytes((i * 7 + j) % 256 for j in range(24))

    async def fetch(self, i: int) -> bytes:
        self.fetches += 1
        self.fetch_threads.add(threading.current_thread().name)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(random.random() * 0.004)
        finally:
            self.in_flight -= 1
        return self._raw(i)

    def decode(self, raw: bytes, i: int):
        self.decode_threads.add(threading.current_thread().name)
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(2, 3, 4)
        return {"x": x.float() / 3, "raw": x, "i": i}

    def __getitem__(self, i: int):
        return self.decode(self._raw(i), i)


@pytest.mark.parametrize("shuffle,batch_size", [(False, 8), (True, 8), (True, 1), (True, None)])
def test_async_fetch_decode_dataset(shuffle, batch_size):
    oracle = AsyncSplit()
    want = list(DataLoader(oracle, batch_size=batch_size, shuffle=shuffle, generator=gen(5)))
    ds = AsyncSplit()
    with AsyncLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen(5),
                     io_concurrency=16) as al:
        got = list(al)
    assert_same_batches(got, want)
    assert ds.fetches == len(ds), "the loader did not use the dataset's async fetch"
    assert ds.fetch_threads == {"asyncfeed-io"}, ds.fetch_threads
    assert all(t.startswith("asyncfeed-decode") for t in ds.decode_threads), ds.decode_threads
    assert ds.max_in_flight > 1, "fetches did not overlap"
    assert ds.max_in_flight <= 16


def _write_jpegs(root, per_class=(5, 4, 6)):
    rng = np.random.default_rng(0)
    for c, n in enumerate(per_class):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for j in range(n):
            h, w = int(rng.integers(20, 90)), int(rng.integers(20, 90))
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), 40 * c + j)],
                           axis=-1).astype(np.uint8)
            img = np.ascontiguousarray(img)
            (d / f"img{j:02d}.jpg").write_bytes(simplejpeg.encode_jpeg(img, quality=90))
    (root / "class1" / "notes.txt").write_text("not an image")   # filtered by extension


@pytest.mark.parametrize("io", ["thread", "async"])
def test_image_folder(tmp_path, io):
    _write_jpegs(tmp_path)
    oracle = asyncfeed.ImageFolder(tmp_path, size=32)
    assert len(oracle) == 15
    want = list(DataLoader(oracle, batch_size=4, shuffle=True, generator=gen(2)))
    ds = asyncfeed.ImageFolder(tmp_path, size=32, io=io)
    with AsyncLoader(ds, batch_size=4, shuffle=True, generator=gen(2), prefetch=2) as al:
        got = list(al)
        got2 = list(al)    # a second epoch through the (now known) ring layout
    assert_same_batches(got, want)
    assert got[0][0].shape == (4, 3, 32, 32) and got[0][0].dtype == torch.uint8
    dl = DataLoader(oracle, batch_size=4, shuffle=True, generator=gen(2))
    list(dl)
    assert_same_batches(got2, list(dl))


class WithNames:
    """Fixed-shape arrays beside strings and bytes, under a tuple, a dict and a list."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int):
        x = np.full((3,), i, dtype=np.float32)
        return (x, f"s{i}", {"name": f"n{i}", "raw": bytes([i]), "pair": [f"a{i}", i]})


@pytest.mark.parametrize("num_threads,execution", [(1, "threads"), (3, "threads")]
                         + [(3, e) for e in EXECUTIONS if e != "threads"], indirect=["execution"])
def test_string_columns_keep_default_collates_containers(num_threads, execution):
    # default_collate gives a tuple of strings under a sequence (its columns come from
    # zip) and a list under a mapping; the ring path must build the same containers
    got = assert_parity(WithNames(), batch_size=5, num_threads=num_threads, **on(execution))
    assert isinstance(got[0][1], tuple) and isinstance(got[0][2]["name"], list)
