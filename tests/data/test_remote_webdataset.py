"""WebDataset-style tar shards: local, over HTTP and over S3; grouping, shuffling, sharding."""

from __future__ import annotations

import io
import os
import pickle
import sys
import tarfile

import numpy as np
import pytest
import simplejpeg
import torch

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import s3_options  # noqa: E402

from asyncfeed._bench.httpserve import DirectoryServer  # noqa: E402
from asyncfeed._data.webdataset import (  # noqa: E402
    ImageLabelDecoder, WebDatasetShards, expand_braces, group_samples)

pytestmark = pytest.mark.timeout(60)

N_SHARDS = 6
PER_SHARD = 7


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (36, 44, 3), dtype=np.uint8)
    return simplejpeg.encode_jpeg(img, quality=85)


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("shards"))
    for s in range(N_SHARDS):
        with tarfile.open(os.path.join(root, f"train-{s:04d}.tar"), "w") as tf:
            _add(tf, "__meta__.json", b"{}")
            for i in range(PER_SHARD):
                key = f"part{s}/s{s:02d}_{i:03d}"
                _add(tf, key + ".jpg", _jpeg(s * 100 + i))
                _add(tf, key + ".cls", str((s * PER_SHARD + i) % 5).encode())
                _add(tf, key + ".meta.json", f'{{"i": {i}}}'.encode())
    return root


def _pattern(base: str) -> str:
    return base + f"train-{{0000..{N_SHARDS - 1:04d}}}.tar"


def _keys(samples) -> list[str]:
    return [s["__key__"] for s in samples]


ALL_KEYS = sorted(f"part{s}/s{s:02d}_{i:03d}" for s in range(N_SHARDS) for i in range(PER_SHARD))


# -- pieces -------------------------------------------------------------------------------

def test_expand_braces():
    assert expand_braces("a-{0000..0003}.tar") == [f"a-{i:04d}.tar" for i in range(4)]
    assert expand_braces("x{1..3}") == ["x1", "x2", "x3"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert expand_braces("s3://b/p/t.tar") == ["s3://b/p/t.tar"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("lit{x}-{0..1}") == ["lit{x}-0", "lit{x}-1"]


def test_group_samples():
    members = [("d/a.jpg", b"1"), ("d/a.cls", b"2"), ("d/a.seg.PNG", b"3"), ("__meta__", b""),
               ("noext", b""), ("d/b.jpg", b"4"), ("e/b.jpg", b"5")]
    out = list(group_samples(members, "u"))
    assert out == [{"__key__": "d/a", "__url__": "u", "jpg": b"1", "cls": b"2", "seg.png": b"3"},
                   {"__key__": "d/b", "__url__": "u", "jpg": b"4"},
                   {"__key__": "e/b", "__url__": "u", "jpg": b"5"}]


def test_bad_arguments(shard_dir):
    with pytest.raises(ValueError):
        WebDatasetShards([])
    with pytest.raises(ValueError):
        WebDatasetShards(_pattern(shard_dir + "/"), rank=2, world_size=2)
    with pytest.raises(ValueError):
        WebDatasetShards(_pattern(shard_dir + "/"), rank=0)


# -- local shards -------------------------------------------------------------------------

def test_local_in_order(shard_dir):
    ds = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=0, shuffle_shards=False)
    samples = list(ds)
    assert _keys(samples) == ALL_KEYS
    s = samples[0]
    assert set(s) == {"__key__", "__url__", "jpg", "cls", "meta.json"}
    assert s["jpg"] == _jpeg(0) and s["cls"] == b"0" and s["__url__"].endswith("train-0000.tar")


def test_shuffle_is_deterministic_and_complete(shard_dir):
    def order(seed, epoch=0):
        ds = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=10, seed=seed)
        ds.set_epoch(epoch)
        return _keys(ds)

    a = order(1)
    assert a == order(1)
    assert sorted(a) == ALL_KEYS and a != ALL_KEYS
    assert order(2) != a
    assert order(1, epoch=1) != a and sorted(order(1, epoch=1)) == ALL_KEYS


def test_shuffle_buffer_is_bounded(shard_dir):
    """A sample can come out at most ``shuffle_buffer`` places before it went in."""
    ds = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=5, shuffle_shards=False)
    out = _keys(ds)
    for pos, key in enumerate(out):
        assert ALL_KEYS.index(key) <= pos + 5


def test_ranks_split_the_shards(shard_dir):
    seen = []
    for rank in range(4):
        ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=3, rank=rank, world_size=4)
        seen.append(_keys(ds))
    flat = [k for keys in seen for k in keys]
    assert sorted(flat) == ALL_KEYS  # every sample once across ranks
    shards = [ds.shards_for(r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [2, 2, 1, 1]
    assert sorted(sum(shards, [])) == sorted(ds.urls)


def test_dataloader_workers_split_the_shards(shard_dir):
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=0, decode=ImageLabelDecoder(32))
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    labels = torch.cat([y for _, y in dl])
    assert len(labels) == N_SHARDS * PER_SHARD
    assert sorted(labels.tolist()) == sorted((i % 5) for i in range(N_SHARDS * PER_SHARD))


def test_image_label_decoder(shard_dir):
    ds = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=0, shuffle_shards=False,
                          decode=ImageLabelDecoder(32))
    img, label = next(iter(ds))
    from asyncfeed import decode_image
    assert torch.equal(img, torch.from_numpy(decode_image(_jpeg(0), 32))) and label == 0
    with pytest.raises(KeyError, match="none of"):
        ImageLabelDecoder(32)({"__key__": "k", "__url__": "u", "txt": b""})


def test_pickles(shard_dir):
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=5, decode=ImageLabelDecoder(32))
    ds2 = pickle.loads(pickle.dumps(ds))
    assert [y for _, y in ds] == [y for _, y in ds2]


# -- remote shards ------------------------------------------------------------------------

def test_http_shards_equal_local(shard_dir):
    local = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=8, seed=4)
    with DirectoryServer(shard_dir) as server:
        remote = WebDatasetShards(_pattern(server.url), shuffle_buffer=8, seed=4,
                                  block_size=16 << 10, readahead=3)
        got = list(remote)
        want = list(local)
        assert _keys(got) == _keys(want)
        assert all(g["jpg"] == w["jpg"] and g["cls"] == w["cls"] for g, w in zip(got, want))
        # many samples per request: a few range requests (and one HEAD) per shard
        per_shard = server.count("train-0000.tar")
        assert 2 <= per_shard < PER_SHARD
        remote.close()


def test_http_shard_dropped_block_is_retried(shard_dir):
    with DirectoryServer(shard_dir) as server:
        server.add_fault("train-0002.tar", "drop", after=1000, times=2)
        ds = WebDatasetShards(_pattern(server.url), shuffle_buffer=0, shuffle_shards=False,
                              block_size=32 << 10, backoff=0.01)
        assert _keys(ds) == ALL_KEYS
        ds.close()


def test_http_shard_stall_times_out_naming_the_shard(shard_dir):
    from asyncfeed._io.fsspec import RemoteReadError
    with DirectoryServer(shard_dir) as server:
        server.add_fault("train-0001.tar", "stall", after=100)
        ds = WebDatasetShards(_pattern(server.url), shuffle_buffer=0, shuffle_shards=False,
                              timeout=0.3, retries=1, backoff=0.01)
        with pytest.raises(RemoteReadError, match="train-0001.tar"):
            list(ds)
        ds.close()


def test_http_missing_shard_skip_or_raise(shard_dir):
    with DirectoryServer(shard_dir) as server:
        urls = [server.url + "train-0000.tar", server.url + "missing.tar",
                server.url + "train-0001.tar"]
        ds = WebDatasetShards(urls, shuffle_buffer=0, shuffle_shards=False, backoff=5.0)
        with pytest.raises(FileNotFoundError, match="missing.tar"):
            list(ds)
        assert server.count("missing.tar") <= 2  # not retried (fsspec's info: HEAD, then GET)
        server.reset_counts()
        skip = WebDatasetShards(urls, shuffle_buffer=0, shuffle_shards=False,
                                on_shard_error="skip")
        assert len(list(skip)) == 2 * PER_SHARD
        assert server.count("missing.tar") <= 2
        ds.close()
        skip.close()


def test_s3_shards_equal_local(shard_dir, moto_endpoint, s3_bucket, s3_client):
    for name in sorted(os.listdir(shard_dir)):
        s3_client.upload_file(os.path.join(shard_dir, name), "asyncfeed-test", "shards/" + name)
    local = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=8, seed=9,
                             decode=ImageLabelDecoder(32))
    remote = WebDatasetShards(_pattern("s3://asyncfeed-test/shards/"), shuffle_buffer=8, seed=9,
                              decode=ImageLabelDecoder(32),
                              storage_options=s3_options(moto_endpoint), block_size=20_000)
    for (a, la), (b, lb) in zip(local, remote, strict=True):
        assert la == lb and torch.equal(a, b)
    remote.close()


def test_asyncloader_over_http_shards(shard_dir):
    from asyncfeed import AsyncLoader
    local = WebDatasetShards(_pattern(shard_dir + "/"), seed=2, decode=ImageLabelDecoder(32))
    with DirectoryServer(shard_dir, latency=0.005) as server:
        remote = WebDatasetShards(_pattern(server.url), seed=2, decode=ImageLabelDecoder(32))
        with AsyncLoader(remote, batch_size=5) as loader:
            got = list(loader)
        want = list(torch.utils.data.DataLoader(local, batch_size=5))
        assert len(got) == len(want)
        for (a, la), (b, lb) in zip(got, want):
            assert torch.equal(a, b) and torch.equal(la, lb)
        remote.close()


def test_rank_from_the_environment_like_the_loader(shard_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=1, shuffle_buffer=0)
    want = ds.shards_for(2, 3)
    assert sorted({s["__url__"] for s in ds}) == sorted(want)


# -- ranks: set_rank ----------------------------------------------------------------------

def test_set_rank_splits_the_shards(shard_dir):
    seen = []
    for rank in range(4):
        ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=3)
        ds.set_rank(rank, 4)
        samples = list(ds)
        assert {s["__url__"] for s in samples} == set(ds.shards_for(rank, 4))
        got = _keys(samples)
        seen.append(got)
        # the same as the constructor's rank and world size
        assert got == _keys(WebDatasetShards(_pattern(shard_dir + "/"), seed=3,
                                             rank=rank, world_size=4))
    assert sorted(k for keys in seen for k in keys) == ALL_KEYS  # every sample once


def test_set_rank_beats_the_environment_and_yields_to_the_constructor(shard_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=1, shuffle_buffer=0)
    ds.set_rank(0, 2)
    assert sorted({s["__url__"] for s in ds}) == sorted(ds.shards_for(0, 2))
    ds.set_rank(1, 2)  # the latest call counts
    assert sorted({s["__url__"] for s in ds}) == sorted(ds.shards_for(1, 2))
    fixed = WebDatasetShards(_pattern(shard_dir + "/"), seed=1, shuffle_buffer=0,
                             rank=1, world_size=3)
    fixed.set_rank(0, 1)
    assert sorted({s["__url__"] for s in fixed}) == sorted(fixed.shards_for(1, 3))
    again = pickle.loads(pickle.dumps(ds))  # travels with the dataset
    assert sorted({s["__url__"] for s in again}) == sorted(ds.shards_for(1, 2))


@pytest.mark.parametrize("rank,world_size", [(2, 2), (-1, 2), (0, 0), (0.5, 2), ("0", "1")])
def test_set_rank_rejects_bad_values(shard_dir, rank, world_size):
    ds = WebDatasetShards(_pattern(shard_dir + "/"))
    with pytest.raises(ValueError):
        ds.set_rank(rank, world_size)


def test_pipeline_hands_the_loader_rank_to_the_shards(shard_dir):
    """What AsyncLoader does at iter(): IterablePipeline(ranks=...) calls set_rank first."""
    from asyncfeed._engine.handoff import PassConfig
    from asyncfeed._engine.iterable import IterablePipeline
    from asyncfeed._engine.runtime import Runtime
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=7, shuffle_buffer=0)
    with Runtime(1, with_loop=False) as rt:
        p = IterablePipeline(PassConfig(batch_size=4, collate=list), dataset=ds, runtime=rt,
                             copy=None, ranks=(1, 2))
        assert ds._loader_rank == (1, 2)
        first = next(p.it)
    assert first["__url__"] == ds.shards_for(1, 2)[0]


# -- the split: tar reading in one thread, decoding in the pool ---------------------------

class _Recording:
    """ImageLabelDecoder(32) that records its threads and fails on chosen keys."""

    def __init__(self, bad=()) -> None:
        import threading
        self.inner, self.bad = ImageLabelDecoder(32), set(bad)
        self.lock = threading.Lock()
        self.threads: set[str] = set()
        self.calls = 0

    def __call__(self, sample):
        import threading
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.calls += 1
        if sample["__key__"] in self.bad:
            raise ValueError(f"cannot decode {sample['__key__']}")
        return self.inner(sample)


def _drain(it) -> list:
    out = []
    while True:
        try:
            out.append(next(it))
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001
            out.append(e)


def test_asyncloader_decodes_shards_in_the_pool(shard_dir):
    from asyncfeed import AsyncLoader
    from asyncfeed._engine.iterable import split_decode
    rec = _Recording()
    ds = WebDatasetShards(_pattern(shard_dir + "/"), seed=2, shuffle_buffer=9, decode=rec)
    assert split_decode(ds) is not None and ds.decoder is rec  # decode() calls it
    want = list(torch.utils.data.DataLoader(ds, batch_size=5))
    rec.threads.clear()
    with AsyncLoader(ds, batch_size=5, num_threads=3) as loader:
        got = list(loader)
    assert rec.threads and all(t.startswith("asyncfeed-decode") for t in rec.threads)
    assert len(got) == len(want)
    for (a, la), (b, lb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_subclass_with_its_own_iter_is_not_split(shard_dir):
    from asyncfeed import AsyncLoader
    from asyncfeed._engine.iterable import split_decode

    class Flipped(WebDatasetShards):
        def __iter__(self):
            return ((img.flip(-1), y) for img, y in super().__iter__())

    ds = Flipped(_pattern(shard_dir + "/"), seed=2, decode=ImageLabelDecoder(32))
    assert split_decode(ds) is None
    with AsyncLoader(ds, batch_size=6) as loader:
        got = list(loader)
    want = list(torch.utils.data.DataLoader(ds, batch_size=6))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want, strict=True))


def test_asyncloader_shard_decode_errors(shard_dir):
    from asyncfeed import AsyncLoader, SampleError
    bad = {"part0/s00_003", "part0/s00_004", "part2/s02_006", "part5/s05_000"}
    ds = WebDatasetShards(_pattern(shard_dir + "/"), shuffle_buffer=0, shuffle_shards=False,
                          decode=_Recording(bad))
    want = _drain(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    with AsyncLoader(ds, batch_size=4, num_threads=3) as loader:
        got = _drain(iter(loader))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, Exception):
            assert isinstance(g, SampleError) and str(g.__cause__) == str(w)
        else:
            assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    with AsyncLoader(ds, batch_size=4, num_threads=3, on_error="skip") as loader:
        labels = torch.cat([y for _, y in loader]).tolist()
        skipped = loader.stats().skipped
    good = [k for k in ALL_KEYS if k not in bad]
    assert labels == [(int(k[4]) * PER_SHARD + int(k[-3:])) % 5 for k in good]
    assert sorted(s.index for s in skipped) == sorted(ALL_KEYS.index(k) for k in bad)
