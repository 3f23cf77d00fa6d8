"""Tail-tolerant reads: hedged requests, adaptive timeouts and read-ahead, against real
servers on 127.0.0.1 (no timing asserts: what is checked is what the server saw and
what the reader returned)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from urllib.parse import unquote

import pytest
import torch

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import S3Proxy, fast_source, s3_options, slowdown_xml  # noqa: E402

from asyncfeed import AsyncLoader, ImageFolder  # noqa: E402
from asyncfeed._bench.httpserve import DirectoryServer, TailModel  # noqa: E402
from asyncfeed._io.hedge import StallTimeout, TailGuard, TailPolicy, ReadStats  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _files(source) -> list[str]:
    return [u for d in source.list_dirs() for u in source.list_files(d)
            if u.endswith(".jpg")]


def _rel(url: str, base: str) -> str:
    """The path the server serves ``url`` under (what its faults and counts name)."""
    return unquote(url[len(base):])


def _local(image_tree: str, url: str, base: str) -> bytes:
    with open(os.path.join(image_tree, _rel(url, base)), "rb") as f:
        return f.read()


def _client_connections(port: int) -> int:
    """ESTABLISHED TCP connections of this process whose remote port is ``port``."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[2].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                n += 1
    return n


async def _warm(src, urls: list[str], n: int = 40) -> None:
    """Read ``n`` files one at a time: the source learns their latency."""
    for i in range(n):
        await src.read(urls[i % len(urls)])


def _faulted_read(src, urls, target: str, server, rel: str, kind: str,
                  **fault) -> tuple[bytes, int]:
    """Warm ``src`` up, give ``rel`` one ``kind`` fault, read ``target``: (its bytes,
    the requests the server saw for it)."""
    async def main():
        await _warm(src, urls)
        server.add_fault(rel, kind, **fault)
        before = server.count(rel)
        data = await src.read(target)
        await src.close_io()
        return data, server.count(rel) - before

    return asyncio.run(main())

def test_hedge_answers_a_stalled_read_once(image_tree, http_server):
    """A read stalled before any byte, while later reads answer, is sent again; the
    second answer wins, the stalled request is cancelled (its connection closed),
    nothing else is left."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs /proc/net/tcp to count connections")
    src = fast_source(http_server.url, timeout=60.0, adaptive_timeout=False)
    urls = _files(src)
    target = urls[5]
    port = int(http_server.url.rsplit(":", 1)[1].strip("/"))

    async def main():
        await _warm(src, urls)
        rel = _rel(target, http_server.url)
        http_server.add_fault(rel, "stall", times=1)
        before = http_server.count(rel)
        conns0 = _client_connections(port)  # listing's and the warm-up's, all idle
        # other reads overtake the stalled one: it is the server that is slow
        data, *_ = await asyncio.gather(src.read(target), *(src.read(u) for u in urls[6:12]))
        await asyncio.sleep(0.05)  # let the cancelled transport finish closing
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        pool = src._conns[id(asyncio.get_running_loop())].pool
        conns = (_client_connections(port) - conns0, *pool.connections())
        await src.close_io()
        return data, http_server.count(rel) - before, tasks, conns

    data, requests, tasks, conns = asyncio.run(main())
    assert data == _local(image_tree, target, http_server.url)
    assert requests == 2            # the stalled one and its hedge, nothing more
    stats = src.read_stats()
    assert (stats.hedges, stats.hedge_wins, stats.stalls) == (1, 1, 0)
    assert tasks == []              # the loser was reaped
    new, open_, idle = conns
    assert open_ == idle            # no request left under way
    assert new == open_ - 1         # the stalled one's connection was closed, not pooled
    src.close()


def test_hedges_stay_within_budget(image_tree):
    """Under a heavy-tailed server, extra requests (counted at the server) stay within
    5% of reads, and every read returns its file."""
    model = TailModel(median=0.002, p99=0.08, seed=3)
    with DirectoryServer(image_tree, tail=model) as server:
        src = fast_source(server.url)
        urls = _files(src)
        server.reset_counts()

        async def main():
            sem = asyncio.Semaphore(16)

            async def one(u):
                async with sem:
                    return u, await src.read(u)

            out = await asyncio.gather(*(one(urls[i % len(urls)]) for i in range(400)))
            await src.close_io()
            return out

        out = asyncio.run(main())
        sent = sum(server.requests[k] for k in server.requests if k.endswith(".jpg"))
        src.close()
    for u, data in out:
        assert data == _local(image_tree, u, server.url)
    stats = src.read_stats()
    assert sent > 400                             # hedging was on
    # every extra request the server saw is a counted hedge (a hedge cancelled while
    # its connection was being made never reaches the server)
    assert sent - 400 <= stats.hedges <= 0.05 * 400


def test_hedging_can_be_turned_off(image_tree, http_server):
    src = fast_source(http_server.url, hedge=False, adaptive_timeout=False)
    assert not src.tail_policy.hedge
    requester_pays = fast_source("s3://bucket/x", storage_options={"requester_pays": True})
    assert not requester_pays.tail_policy.hedge   # a duplicate GET bills the reader
    urls = _files(src)
    http_server.latency = 0.001

    async def main():
        await _warm(src, urls, 60)
        await src.close_io()

    asyncio.run(main())
    assert src.read_stats().hedges == 0 and src.read_stats().attempts == 60
    src.close()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("fast", [True, False], ids=["lean", "fsspec"])
def test_adaptive_timeout_abandons_a_stall_before_the_hard_cap(image_tree, http_server, fast):
    """With hedging off, a read stalled mid-body is abandoned after a few times the
    observed latency (not the 120 s hard timeout) and retried; the retry answers.
    The lean client reports progress (no byte for too long); through fsspec the
    attempt is judged on its whole duration."""
    src = fast_source(http_server.url, timeout=120.0, hedge=False, fast=fast)
    urls = _files(src)
    target = urls[3]
    rel = _rel(target, http_server.url)

    data, requests = _faulted_read(src, urls, target, http_server, rel, "stall",
                                   after=10, times=1)
    assert data == _local(image_tree, target, http_server.url)
    stats = src.read_stats()
    assert stats.stalls == 1 and stats.retries == 1 and stats.hedges == 0
    assert requests == 2
    src.close()


# -- stalls are told by progress: no byte for a while, not a long read ---------------------

_PIECES = 8        # a trickled body arrives in about this many pieces...
_INTERVAL = 0.1    # ...this many seconds apart: whole reads of ~0.8 s, gaps far below
                   # the adaptive limit's 0.5 s floor


def _trickle_everything(server, sizes: list[int]) -> None:
    """Every file's headers at once, then its body in ~_PIECES pieces _INTERVAL s apart."""
    server.add_fault("*.jpg", "trickle", chunk=max(sizes) // _PIECES + 1, interval=_INTERVAL)


@pytest.mark.timeout(60)
def test_loader_abandons_a_stall_after_headers_while_slow_reads_stream(image_tree):
    """Every file streams slowly (whole reads of ~0.8 s; with stall_factor=4, 4 x their
    p99 is beyond the 2.5 s hard timeout, so a rule on whole attempts could not catch
    the stall) and one answer stops after its headers.  The stall is told by the
    silence (no byte for 4 x the time-to-first-byte p99, here the 0.5 s floor),
    abandoned and retried before the hard timeout: counted as a stall in
    stats().io, its sample delivered once, every batch the local folder's, in order."""
    hard, factor = 2.5, 4.0

    def run():
        with DirectoryServer(image_tree) as server:
            remote = ImageFolder(server.url, 32, timeout=hard, hedge=False, backoff=0.01,
                                 max_backoff=0.05, stall_factor=factor)
            slow = remote.samples[5][0]
            rel = _rel(slow, server.url)
            server.add_fault(rel, "stall", times=1)     # headers, then nothing (first wins)
            _trickle_everything(server, [len(_local(image_tree, u, server.url))
                                         for u, _ in remote.samples])
            server.reset_counts()
            with AsyncLoader(remote, batch_size=4, num_threads=2) as loader:
                got = list(loader)
                io = loader.stats().io
            requests = server.count(rel)
            ttfb = max((g._ttfb.quantile(0.99) or 0.0)
                       for g in remote._source._guards.values())
            remote._source.close()
        return got, io, requests, ttfb

    got, io, requests, ttfb = run()
    if io is not None and io.stalls == 0 and ttfb * factor >= hard:
        # the premise did not hold: headers took so long on this (loaded) machine that
        # factor x their p99 reached the hard timeout, where the silence rule rightly
        # stands down (one CI run in three sessions); once more, then it must hold
        got, io, requests, ttfb = run()
    with AsyncLoader(ImageFolder(image_tree, 32), batch_size=4, num_threads=2) as loader:
        want = list(loader)
    assert len(got) == len(want)
    for (x, lx), (y, ly) in zip(got, want):
        assert torch.equal(x, y) and torch.equal(lx, ly)
    assert io is not None
    # a stall, not the hard timeout
    assert (io.stalls, io.retries, io.hedges) == (1, 1, 0), (io, f"ttfb p99 {ttfb:.3f}s")
    assert io.attempts == sum(len(lx) for _, lx in want) + 1  # the stalled file twice
    assert requests == 2


@pytest.mark.timeout(60)
def test_s3_stall_after_headers_is_abandoned_while_slow_reads_stream(image_tree, s3_tree,
                                                                     s3_proxy):
    """The signed S3 GETs go through the same client: a stall after the headers is told
    from slow but steady bodies there too (stall_factor=4, as above: a rule on whole
    attempts would wait past the hard timeout)."""
    hard, factor = 2.5, 4.0

    def run():
        src = fast_source(s3_tree, storage_options=s3_options(s3_proxy.url.rstrip("/")),
                          timeout=hard, hedge=False, stall_factor=factor)
        urls = _files(src)
        base = s3_tree + "/"
        rel = "asyncfeed-test/images/" + urls[4][len(base):]
        s3_proxy.clear_faults()  # (a first run's: the first fault that applies wins)
        s3_proxy.reset_counts()
        s3_proxy.add_fault(rel, "stall", times=1)
        _trickle_everything(s3_proxy, [len(_local(image_tree, u, base)) for u in urls])

        async def main():
            out = await asyncio.gather(*(src.read(u) for u in urls))
            await src.close_io()
            return out

        out = asyncio.run(main())
        for u, data in zip(urls, out):
            assert data == _local(image_tree, u, base)
        return src, rel

    src, rel = run()
    guard = src._guards["file"]  # what the adaptive timeout had seen
    if src.read_stats().stalls == 0 and (guard._ttfb.quantile(0.99) or 0.0) * factor >= hard:
        # the premise did not hold: the headers took so long on this (loaded) machine
        # that factor x their p99 reached the hard timeout, where the silence rule
        # rightly stands down; once more, then it must hold
        src.close()
        src, rel = run()
        guard = src._guards["file"]
    stats = src.read_stats()
    assert (stats.stalls, stats.retries, stats.hedges) == (1, 1, 0), \
        (stats, guard.limits(hard), len(guard._ttfb._sorted), len(guard._latency._sorted))
    assert s3_proxy.count(rel) == 2
    src.close()
    _settle()


@pytest.mark.timeout(40)
def test_a_slow_but_steady_body_is_not_abandoned(image_tree, http_server):
    """After fast reads (p99 of a few ms: the adaptive limit is its 0.5 s floor), one
    body trickles in over ~1.5 s, a piece every 0.1 s: it is not abandoned, however
    much longer than the others it takes; one request, no stall, no retry."""
    src = fast_source(http_server.url, timeout=30.0, hedge=False)
    urls = _files(src)
    target = urls[2]
    rel = _rel(target, http_server.url)
    size = len(_local(image_tree, target, http_server.url))

    data, requests = _faulted_read(src, urls, target, http_server, rel, "trickle",
                                   chunk=size // 15 + 1, interval=0.1, times=1)
    assert data == _local(image_tree, target, http_server.url)
    stats = src.read_stats()
    assert (stats.stalls, stats.retries) == (0, 0)
    assert requests == 1
    src.close()


@pytest.mark.timeout(40)
def test_the_hard_timeout_caps_a_body_that_keeps_coming(image_tree, http_server):
    """A body that keeps arriving, a piece every 0.1 s, for longer than the 1 s hard
    timeout: the adaptive rule never abandons it; the hard timeout ends every attempt
    and, once the retries are spent, the read fails naming the URL."""
    from asyncfeed import RemoteTimeoutError
    src = fast_source(http_server.url, timeout=1.0, retries=1, hedge=False)
    urls = _files(src)
    target = urls[1]
    rel = _rel(target, http_server.url)
    size = len(_local(image_tree, target, http_server.url))

    async def main():
        await _warm(src, urls)
        http_server.add_fault(rel, "trickle", chunk=size // 30 + 1, interval=0.1)  # ~3 s
        before = http_server.count(rel)
        try:
            with pytest.raises(RemoteTimeoutError) as info:
                await src.read(target)
        finally:
            await src.close_io()
        return info.value, http_server.count(rel) - before

    err, requests = asyncio.run(main())
    assert target in str(err) and "timed out after 1.0s" in str(err)
    stats = src.read_stats()
    assert (stats.stalls, stats.retries) == (0, 1)
    assert requests == 2
    src.close()


def test_guard_limits_follow_observed_latency():
    guard = TailGuard(TailPolicy(), ReadStats())
    assert guard.limits(30.0) == (None, None, None)  # nothing known: the hard cap only
    for i in range(100):
        guard._latency.observe(0.01 + i * 1e-4)
        guard._ttfb.observe(0.001)
    lim = guard.limits(30.0)
    assert 0.015 < lim.hedge < 0.025                 # p98 of whole reads
    assert lim.idle == 0.5 and lim.whole == 0.5      # 2 x p99 is under the floor
    for _ in range(300):
        guard._latency.observe(1.0)
        guard._ttfb.observe(0.3)
    lim = guard.limits(2.0)
    assert lim.hedge == 1.0 and abs(lim.idle - 0.6) < 1e-9  # 2 x time to first byte
    assert lim.whole == math.inf                     # at or past the hard cap: never
    assert guard.limits(0.6).idle == math.inf
    assert TailGuard(TailPolicy(adaptive_timeout=False), ReadStats()).limits(30.0)[1:] \
        == (math.inf, math.inf)
    with pytest.raises(ValueError):
        TailPolicy(hedge_budget=2.0)
    assert issubclass(StallTimeout, TimeoutError)


def test_a_request_queued_for_a_connection_is_not_silence():
    """Time spent waiting for the client's own connection limit is neither the
    server's silence nor its time to first byte: the watchdog counts both from when
    the request went out."""
    from asyncfeed._io.progress import Progress
    guard = TailGuard(TailPolicy(), ReadStats())
    for _ in range(100):
        guard._ttfb.observe(0.01)
        guard._latency.observe(0.02)
    lim = guard.limits(30.0)
    queued = Progress(start=100.0)
    queued.reported = True                            # taken, not sent: waiting for a slot
    assert guard._stalled(queued, lim, now=100.0 + 10 * lim.idle) is None
    assert guard._deadline(queued, lim, now=105.0) < 106.0  # looked at again soon
    queued.sent = queued.last = 104.0                 # sent: the server's clock starts
    assert guard._stalled(queued, lim, now=104.0 + lim.idle / 2) is None
    assert guard._stalled(queued, lim, now=104.0 + lim.idle) is not None
    queued.first = queued.last = 104.25
    guard._observe(queued, now=104.5)
    assert guard._ttfb._ring[100 % len(guard._ttfb._ring)] == 0.25  # from sent, not start


def test_readahead_reads_past_a_slow_batch(image_tree, http_server):
    """While batch 0 waits for one slow read, the reads of every later batch are done
    (they were started ahead of the decode window), and the batches are the local
    folder's, in order, each sample once."""
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, timeout=30, hedge=False,
                         adaptive_timeout=False)
    slow = remote.samples[1][0]
    rel = _rel(slow, http_server.url)
    http_server.add_fault(rel, "delay", delay=1.0, times=1)
    http_server.reset_counts()
    with AsyncLoader(remote, batch_size=4, num_threads=2, prefetch=2) as loader:
        it = iter(loader)
        first = next(it)
        requested = {k for k, v in http_server.requests.items() if v and k.endswith(".jpg")}
        got = [first] + list(it)
        io = loader.stats().io
    assert len(requested) == len(remote)      # all read while batch 0 waited
    assert io is not None and io.readahead_reads == len(remote)
    with AsyncLoader(local, batch_size=4, num_threads=2) as loader:
        want = list(loader)
    assert len(got) == len(want)
    for (x, lx), (y, ly) in zip(got, want):
        assert torch.equal(x, y) and torch.equal(lx, ly)
    remote._source.close()


def test_readahead_holds_within_its_byte_budget(image_tree, http_server):
    """A small budget: the bytes held by finished reads waiting for decoding stay
    within the budget plus one batch (a drawn batch may overshoot it).  The consumer
    is slow, so decoding waits for free slots and the reads run ahead of it: bytes
    are held whatever the machine's load."""
    remote = ImageFolder(http_server.url, 32)
    sizes = [len(_local(image_tree, u, http_server.url)) for u, _ in remote.samples]
    budget = 3 * max(sizes)
    n = 0
    with AsyncLoader(remote, batch_size=2, num_threads=1, prefetch=1,
                     readahead_bytes=budget) as loader:
        for _, y in loader:
            n += len(y)
            time.sleep(0.05)
        io = loader.stats().io
    assert n == len(remote)
    assert io.readahead_budget == budget and io.readahead_reads == len(remote)
    assert 0 < io.readahead_peak_bytes <= budget + 2 * max(sizes)
    with AsyncLoader(remote, batch_size=2, readahead_bytes=0) as loader:
        assert sum(len(y) for _, y in loader) == len(remote)
        assert loader.stats().io.readahead_reads == 0
    with pytest.raises(ValueError):
        AsyncLoader(remote, readahead_bytes=-1)
    remote._source.close()


class _Arrivals(Counter):
    """A server's request counter that also keeps the order requests arrived in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def __setitem__(self, key, value) -> None:
        if value:
            self.order.append(key)
        super().__setitem__(key, value)


@pytest.mark.parametrize("io_concurrency", [1, 3])
def test_a_read_waiting_for_its_retry_gives_its_place_to_the_reads_behind(
        image_tree, http_server, io_concurrency):
    """A 503's backoff sends nothing: while the refused read waits for its retry, the
    reads queued behind it are sent (with the place held, ``io_concurrency=1`` sent
    nothing until the retry), and no more than ``io_concurrency`` requests are ever
    being answered at once.  The batches are the local folder's, in order."""
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, timeout=30, hedge=False,
                         adaptive_timeout=False, backoff=1.0, max_backoff=1.0)
    refused = _rel(remote.samples[1][0], http_server.url)
    http_server.add_fault(refused, "status", status=503, times=1)
    http_server.latency = 0.01
    http_server.reset_counts()
    http_server.requests = arrivals = _Arrivals()
    with AsyncLoader(remote, batch_size=4, num_threads=2, prefetch=2,
                     io_concurrency=io_concurrency) as loader:
        got = list(loader)
        io = loader.stats().io
    with AsyncLoader(local, batch_size=4, num_threads=2) as loader:
        want = list(loader)
    order = [r for r in arrivals.order if r.endswith(".jpg")]
    first, retry = [i for i, r in enumerate(order) if r == refused]
    behind = {r for r in order[first + 1:retry]}
    assert io.retries == 1 and len(order) == len(remote) + 1
    assert len(behind) >= len(remote) // 2, (first, retry, order)
    assert http_server.max_in_flight <= io_concurrency
    assert len(got) == len(want)
    for (x, lx), (y, ly) in zip(got, want):
        assert torch.equal(x, y) and torch.equal(lx, ly)
    remote._source.close()


def test_an_s3_read_waiting_for_its_retry_gives_its_place_to_the_reads_behind(
        image_tree, s3_tree, s3_proxy):
    """The same over S3: a ``503 SlowDown``'s backoff lets the GETs queued behind the
    refused one go out before its retry."""
    remote = ImageFolder(s3_tree, 32, storage_options=s3_options(s3_proxy.url.rstrip("/")),
                         timeout=30, hedge=False, adaptive_timeout=False, backoff=1.0,
                         max_backoff=1.0)
    refused = remote.samples[1][0][len("s3://"):]
    s3_proxy.throttle(refused, times=1)
    s3_proxy.reset_counts()
    with AsyncLoader(remote, batch_size=4, num_threads=2, prefetch=2,
                     io_concurrency=1) as loader:
        got = list(loader)
        io = loader.stats().io
    gets = [rel for method, rel, _ in s3_proxy.clients if method == "GET"
            and rel.endswith(".jpg")]
    first, retry = [i for i, rel in enumerate(gets) if rel == refused]
    assert io.retries == 1 and sum(len(y) for _, y in got) == len(remote)
    assert len(set(gets[first + 1:retry])) >= len(remote) // 2, (first, retry)
    assert s3_proxy.max_in_flight <= 1
    remote._source.close()
    _settle()


class _HeldFirstRead:
    """Reads on the event loop; the read of sample 0 takes ``hold`` seconds.  Records
    which samples were decoded by the time that read returned."""

    def __init__(self, n: int = 40, hold: float = 1.0) -> None:
        self.n, self.hold = n, hold
        self.decoded: set[int] = set()
        self.decoded_during_hold: set[int] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise AssertionError("read through fetch")

    async def fetch(self, i: int) -> bytes:
        if i == 0:
            await asyncio.sleep(self.hold)
            self.decoded_during_hold = set(self.decoded)
        return bytes(16)

    def decode(self, raw: bytes, i: int):
        self.decoded.add(i)
        return torch.full((4,), float(i))


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_batches_behind_a_held_read_are_decoded_twice_prefetch_deep(prefetch):
    """While the batch the consumer waits for still waits for a read, the decode
    window is twice ``prefetch``: the batches behind it, whose bytes were read ahead,
    are decoded meanwhile, and no further ones."""
    ds = _HeldFirstRead()
    with AsyncLoader(ds, batch_size=4, num_threads=2, prefetch=prefetch) as loader:
        got = [b[:, 0].tolist() for b in loader]
    assert sum(got, []) == [float(i) for i in range(40)]
    assert ds.decoded_during_hold == set(range(1, 4 * 2 * prefetch))


def _tail_epochs(remote, local, **kw):
    with AsyncLoader(local, batch_size=4, shuffle=True, seed=3, num_threads=2) as loader:
        want = list(loader)
    with AsyncLoader(remote, batch_size=4, shuffle=True, seed=3, num_threads=2, **kw) as loader:
        for _ in range(2):
            got = list(loader)
            assert len(got) == len(want)
            for (x, lx), (y, ly) in zip(got, want):
                assert torch.equal(x, y) and torch.equal(lx, ly)
        return loader.stats().io


def test_loader_over_a_heavy_tailed_server_delivers_every_sample_once(image_tree):
    model = TailModel(median=0.003, p99=0.05, error_rate=0.2, stall_rate=0.05,
                      stall_s=0.6, seed=1)
    with DirectoryServer(image_tree, tail=model) as server:
        remote = ImageFolder(server.url, 32, backoff=0.01, max_backoff=0.05, timeout=20)
        io = _tail_epochs(remote, ImageFolder(image_tree, 32))
        assert server.tail_errors > 0 and server.tail_stalls > 0
        assert io.retries >= server.tail_errors - io.hedges
        assert io.attempts - io.hedges - io.retries == 2 * len(remote)  # reads: 2 epochs
        assert io.hedges <= 0.05 * 2 * len(remote)
        remote._source.close()


def test_loader_over_s3_with_the_tail_model(image_tree, s3_tree, moto_endpoint):
    class TailS3Proxy(S3Proxy):
        def _tail_error(self, rel):
            from aiohttp import web
            return web.Response(status=503, body=slowdown_xml().encode(),
                                content_type="application/xml")

    model = TailModel(median=0.003, p99=0.05, error_rate=0.2, stall_rate=0.03,
                      stall_s=0.6, seed=2)
    with TailS3Proxy(moto_endpoint, tail=model) as proxy:
        remote = ImageFolder(s3_tree, 32, storage_options=s3_options(proxy.url.rstrip("/")),
                             backoff=0.01, max_backoff=0.05, timeout=20)
        _tail_epochs(remote, ImageFolder(image_tree, 32))
        assert proxy.tail_errors > 0
        remote._source.close()
    _settle()


def _settle() -> None:
    """Let fsspec's I/O loop finish closing the botocore clients the passes made, and
    free their reference cycles now, not during a later test that counts garbage."""
    import gc

    import fsspec.asyn
    loop = fsspec.asyn.loop[0]
    if loop is not None and loop.is_running():
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), loop).result()
    gc.collect()
