"""Disk and memory caches of raw bytes, alone and under FsspecSource."""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import fast_source, s3_options  # noqa: E402

from asyncfeed import ImageFolder  # noqa: E402
from asyncfeed._io.cache import DiskCache, MemoryCache  # noqa: E402

pytestmark = pytest.mark.timeout(60)

HEADER = 16


def _files(directory: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs)


# -- DiskCache ------------------------------------------------------------------------------

def test_roundtrip_and_entry_format(tmp_path):
    c = DiskCache(tmp_path)
    assert c.get("http://h/a") is None
    c.put("http://h/a", b"hello")
    assert c.get("http://h/a") == b"hello"
    [path] = _files(str(tmp_path))
    assert path == c.path_of("http://h/a")
    raw = open(path, "rb").read()
    magic, length, crc = struct.unpack("<4sQI", raw[:HEADER])
    assert (magic, length, crc, raw[HEADER:]) == (b"AFC1", 5, zlib.crc32(b"hello"), b"hello")
    s = c.stats()
    assert (s.hits, s.misses, s.puts, s.entries, s.bytes) == (1, 1, 1, 1, HEADER + 5)


def test_write_goes_through_a_temporary_and_rename(tmp_path, monkeypatch):
    c = DiskCache(tmp_path)
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, dst, os.path.exists(dst)))
        assert open(src, "rb").read()[HEADER:] == b"x" * 1000  # complete before the rename
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    c.put("k", b"x" * 1000)
    [(src, dst, existed)] = seen
    assert dst == c.path_of("k") and src.endswith(".tmp") and not existed
    assert not any(p.endswith(".tmp") for p in _files(str(tmp_path)))


def test_crash_leftovers_are_never_entries_and_old_ones_are_removed(tmp_path):
    c = DiskCache(tmp_path)
    c.put("k", b"data")
    final = c.path_of("k")
    fresh = final + ".123.456.tmp"   # a writer that may still be running
    stale = final + ".999.888.tmp"   # a writer that crashed long ago
    for p in (fresh, stale):
        with open(p, "wb") as f:
            f.write(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    c2 = DiskCache(tmp_path)  # a new process
    assert len(c2) == 1 and c2.get("k") == b"data"
    assert os.path.exists(fresh) and not os.path.exists(stale)


def test_lru_eviction_under_budget(tmp_path):
    c = DiskCache(tmp_path, max_bytes=3 * (HEADER + 100))
    for k in "abc":
        c.put(k, k.encode() * 100)
    assert c.get("a") is not None  # a is now the most recently used
    c.put("d", b"d" * 100)
    assert "b" not in c and all(k in c for k in "acd")
    assert not os.path.exists(c.path_of("b"))
    assert c.nbytes == 3 * (HEADER + 100) <= c.max_bytes
    assert sum(os.path.getsize(p) for p in _files(str(tmp_path))) <= c.max_bytes
    assert c.stats().evictions == 1
    c.put("big", b"z" * 1000)  # larger than the whole budget: not cached
    assert "big" not in c and len(c) == 3


def test_recency_survives_a_restart(tmp_path):
    c = DiskCache(tmp_path, max_bytes=3 * (HEADER + 10))
    for i, k in enumerate("abc"):
        c.put(k, b"0123456789")
        t = time.time() - 100 + i
        os.utime(c.path_of(k), (t, t))
    c.get("a")  # refreshes a's mtime
    c2 = DiskCache(tmp_path, max_bytes=3 * (HEADER + 10))
    c2.put("d", b"0123456789")
    assert "b" not in c2 and "a" in c2


def test_budget_enforced_when_opening_a_bigger_directory(tmp_path):
    c = DiskCache(tmp_path)
    for i in range(10):
        c.put(str(i), b"x" * 100)
    c2 = DiskCache(tmp_path, max_bytes=4 * (HEADER + 100))
    assert len(c2) == 4
    assert len(_files(str(tmp_path))) == 4


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty", "extend"])
def test_corrupt_entry_is_detected_and_removed(tmp_path, damage):
    c = DiskCache(tmp_path)
    c.put("k", bytes(range(256)) * 4)
    path = c.path_of("k")
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[HEADER + 500] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-10]
    elif damage == "header":
        raw[0:4] = b"XXXX"
    elif damage == "empty":
        raw = bytearray()
    else:
        raw += b"trailing"
    with open(path, "wb") as f:
        f.write(raw)
    assert c.get("k") is None
    assert not os.path.exists(path) and "k" not in c
    assert c.stats().corrupt == 1


def test_size_from_listing_must_match(tmp_path):
    c = DiskCache(tmp_path)
    c.put("k", b"12345")
    assert c.get("k", size=6) is None  # the object changed size since it was cached
    assert "k" not in c and c.stats().corrupt == 0
    c.put("k", b"123456")
    assert c.get("k", size=6) == b"123456"


def test_write_errors_never_fail(tmp_path):
    c = DiskCache(tmp_path)
    blocker = os.path.dirname(c.path_of("k"))
    with open(blocker, "w") as f:  # a file where the fan-out directory should be
        f.write("in the way")
    c.put("k", b"data")  # no exception
    assert c.get("k") is None and c.stats().errors == 1


def test_pickled_disk_cache_reopens_the_directory(tmp_path):
    c = DiskCache(tmp_path, max_bytes=10_000)
    c.put("k", b"v")
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.get("k") == b"v" and c2.max_bytes == 10_000


def test_threads_hammering_one_cache(tmp_path):
    c = DiskCache(tmp_path, max_bytes=20 * (HEADER + 64))
    errors = []

    def work(seed):
        try:
            for i in range(300):
                k = str((seed * 7 + i * 13) % 50)
                data = k.encode() * (64 // len(k)) + b"#" * (64 % len(k))
                got = c.get(k)
                if got is not None and got != data:
                    errors.append((k, got))
                c.put(k, data)
        except Exception as e:  # pragma: no cover - a failure shows up in errors
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert c.nbytes <= c.max_bytes
    on_disk = [p for p in _files(str(tmp_path)) if not p.endswith(".tmp")]
    assert len(on_disk) == len(c) <= 20
    assert c.stats().corrupt == 0


# -- MemoryCache ----------------------------------------------------------------------------

def test_memory_cache_lru():
    m = MemoryCache(max_bytes=30)
    for k in "abc":
        m.put(k, k.encode() * 10)
    m.get("a")
    m.put("d", b"d" * 10)
    assert "b" not in m and len(m) == 3 and m.nbytes == 30
    assert m.get("a", size=11) is None and m.get("a", size=10) == b"a" * 10
    m.put("huge", b"h" * 31)
    assert "huge" not in m


ops = st.lists(st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 7),
                         st.integers(1, 40)), max_size=60)


def replay_against_lru_model(cache, seq, budget: int, cost) -> "OrderedDict[int, bytes]":
    """Run ``seq`` on ``cache`` and on a plain LRU model of it (``cost(v)`` bytes per
    entry); every get must agree.  Returns the model's final content."""
    from collections import OrderedDict
    model: OrderedDict[int, bytes] = OrderedDict()
    for op, k, n in seq:
        if op == "put":
            data = bytes([k]) * n
            cache.put(str(k), data)
            model.pop(k, None)
            model[k] = data
            while sum(cost(v) for v in model.values()) > budget:
                model.popitem(last=False)
        else:
            assert cache.get(str(k)) == model.get(k)
            if k in model:
                model.move_to_end(k)
    return model


@settings(max_examples=40, deadline=None)
@given(ops)
def test_memory_cache_matches_an_lru_model(seq):
    m = MemoryCache(max_bytes=100)
    model = replay_against_lru_model(m, seq, 100, len)
    assert [int(k) for k in m._data] == list(model)


@settings(max_examples=15, deadline=None)
@given(ops)
def test_disk_cache_matches_an_lru_model(tmp_path_factory, seq):
    budget = 3 * (HEADER + 40)
    c = DiskCache(tmp_path_factory.mktemp("lru"), max_bytes=budget)
    model = replay_against_lru_model(c, seq, budget, lambda v: HEADER + len(v))
    assert len(c) == len(model) and c.nbytes == sum(HEADER + len(v) for v in model.values())


# -- under FsspecSource ---------------------------------------------------------------------

def test_disk_cache_serves_later_epochs_without_requests(image_tree, http_server, tmp_path):
    ds = ImageFolder(http_server.url, 32, cache_dir=str(tmp_path / "c"), timeout=5)
    first = [ds[i] for i in range(len(ds))]
    http_server.reset_counts()
    ds2 = ImageFolder(http_server.url, 32, cache_dir=str(tmp_path / "c"), timeout=5)
    listing = sum(http_server.requests.values())
    second = [ds2[i] for i in range(len(ds2))]
    assert sum(http_server.requests.values()) == listing  # only the listing went out
    assert all(a[1] == b[1] and bool((a[0] == b[0]).all()) for a, b in zip(first, second))
    ds._source.close()
    ds2._source.close()


def test_corrupt_cache_entry_is_refetched(image_tree, http_server, tmp_path):
    src = fast_source(http_server.url, cache_dir=str(tmp_path))
    url = http_server.url + "cat/im%200.jpg"
    good = src.read_sync(url)
    path = src.disk_cache.path_of(url)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    open(path, "wb").write(raw)
    assert src.read_sync(url) == good
    assert http_server.count("cat/im 0.jpg") == 2
    assert src.read_sync(url) == good  # the refetched copy is cached again
    assert http_server.count("cat/im 0.jpg") == 2
    assert src.disk_cache.stats().corrupt == 1
    src.close()


def test_cache_budget_holds_over_a_pass(image_tree, http_server, tmp_path):
    budget = 20_000
    src = fast_source(http_server.url, cache_dir=str(tmp_path), cache_size=budget)
    for c in src.list_dirs():
        for u in src.list_files(c):
            src.read_sync(u)
    assert sum(os.path.getsize(p) for p in _files(str(tmp_path))) <= budget
    assert src.disk_cache.stats().evictions > 0
    src.close()


def test_failed_reads_are_not_cached(http_server, tmp_path):
    http_server.add_fault("cat/im 0.jpg", "drop", after=100, times=1)
    src = fast_source(http_server.url, cache_dir=str(tmp_path), retries=0)
    url = http_server.url + "cat/im%200.jpg"
    with pytest.raises(OSError):
        src.read_sync(url)
    assert url not in src.disk_cache and not _files(str(tmp_path))
    src.close()


def test_memory_cache_under_source(image_tree, http_server):
    src = fast_source(http_server.url, cache="memory")
    url = http_server.url + "cat/im%200.jpg"
    data = src.read_sync(url)
    assert src.read_sync(url) is data  # no copy, no request
    assert http_server.count("cat/im 0.jpg") == 1
    clone = pickle.loads(pickle.dumps(src))  # workers start with an empty cache
    assert len(clone.memory_cache) == 0 and clone.read_sync(url) == data
    src.close()
    clone.close()


def test_memory_and_disk_together(http_server, tmp_path):
    src = fast_source(http_server.url, cache="memory", cache_dir=str(tmp_path))
    url = http_server.url + "cat/im%201.jpg"
    data = src.read_sync(url)
    src2 = fast_source(http_server.url, cache="memory", cache_dir=str(tmp_path))
    assert src2.read_sync(url) == data and url in src2.memory_cache
    assert http_server.count("cat/im 1.jpg") == 1
    src.close()
    src2.close()


def test_s3_cache_keyed_by_listed_size(image_tree, s3_tree, moto_endpoint, s3_client, tmp_path):
    opts = s3_options(moto_endpoint)
    key = "images/dog b/im 2.jpg"
    url = s3_tree + "/dog b/im 2.jpg"
    src = fast_source(s3_tree, storage_options=opts, cache_dir=str(tmp_path))
    src.list_dirs()
    original = src.read_sync(url)
    assert src.disk_cache.get(url, len(original)) == original
    try:  # the object is replaced by a longer one: a new listing sees its new size
        s3_client.put_object(Bucket="asyncfeed-test", Key=key, Body=original + b"\0")
        src2 = fast_source(s3_tree, storage_options=opts, cache_dir=str(tmp_path))
        src2.list_dirs()
        assert src2.read_sync(url) == original + b"\0"
        src2.close()
    finally:
        s3_client.put_object(Bucket="asyncfeed-test", Key=key, Body=original)
    src.close()
