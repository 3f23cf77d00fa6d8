"""CPU cost per remote read, client side, at zero latency over loopback (not a test).

    PYTHONPATH=src python bench/measure_remote_cpu.py [--reads 2000] [--size 110000]

The server runs in a child process (``asyncfeed._bench.httpserve.DirectoryServer``), so
this process's CPU time (user + system, from ``getrusage``) is what the read path
costs: the event loop, the HTTP client, the kernel's share of the loopback socket
work.  Each mode reads ``--reads`` files of ``--size`` bytes, ``--concurrency`` at
a time, on one event loop, after a warm-up pass that opens the connections; the
median of ``--repeat`` runs is printed.

Modes: ``aiohttp`` (a bare ``session.get``), ``fsspec-http`` (fsspec's
``HTTPFileSystem._cat_file``), ``source-http`` (``FsspecSource.read`` on an http
root: timeout, retries, size check), ``source-s3`` (``FsspecSource.read`` on an
s3 root with the signed GET of ``asyncfeed._io.s3``) and ``s3fs`` (the same
through s3fs/aiobotocore, ``fast_s3=False``).  The S3 modes talk to the same
directory server, which serves ``/bucket/key`` paths and ignores the signature
(moto's own server is too slow to measure a client against: about 140 GETs/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

_SERVE_HTTP = """
import sys, signal
sys.path.insert(0, {src!r})
from asyncfeed._bench.httpserve import DirectoryServer
s = DirectoryServer({root!r}).start()
print(s.url, flush=True)
signal.sigwait([signal.SIGTERM])
s.close()
"""

def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server(code: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line:
        p.kill()
        raise RuntimeError("server did not start")
    return p, line


def _run(loop_kind: str, coro_fn):
    if loop_kind == "uvloop":
        import uvloop
        return uvloop.run(coro_fn())
    return asyncio.run(coro_fn())


async def _drive(read, urls: list[str], concurrency: int, close) -> tuple[float, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(u: str) -> int:
        async with sem:
            return len(await read(u))

    await asyncio.gather(*(one(u) for u in urls[: min(len(urls), 2 * concurrency)]))  # warm-up
    c0, w0 = _cpu(), time.perf_counter()
    await asyncio.gather(*(one(u) for u in urls))
    c1, w1 = _cpu(), time.perf_counter()
    await close()
    return c1 - c0, w1 - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--size", type=int, default=110_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--modes", default="aiohttp,fsspec-http,source-http-aiohttp,source-http,"
                                       "source-s3,s3fs")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--loops", default="uvloop,asyncio")
    args = ap.parse_args()

    from asyncfeed._io.fsspec import FsspecSource

    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "bench", "data", "c"))
        os.symlink(os.path.join(root, "bench", "data", "c"), os.path.join(root, "c"))
        for i in range(args.files):
            with open(os.path.join(root, "bench", "data", "c", f"{i:05d}.jpg"), "wb") as f:
                f.write(os.urandom(args.size))
        rels = [f"c/{i % args.files:05d}.jpg" for i in range(args.reads)]
        modes = args.modes.split(",")
        servers = {}
        try:
            src_dir = os.path.join(os.path.dirname(HERE), "src")
            servers["http"] = _server(_SERVE_HTTP.format(src=src_dir, root=root))
            print(f"{args.reads} reads of {args.size} B, {args.concurrency} in flight, server in "
                  f"another process; client CPU = user + system, median of {args.repeat}")
            for loop_kind in args.loops.split(","):
                for mode in modes:
                    runs = sorted(_run(loop_kind, lambda: _mode(mode, servers, rels, args,
                                                                FsspecSource))
                                  for _ in range(args.repeat))
                    cpu, wall = runs[len(runs) // 2]
                    print(f"  {mode:12s} {loop_kind:8s} {1e6 * cpu / args.reads:7.1f} us CPU/read"
                          f"   {args.reads / wall:7.0f} reads/s")
        finally:
            for p, _ in servers.values():
                p.terminate()
                p.wait()


async def _mode(mode, servers, rels, args, FsspecSource):
    if mode == "aiohttp":
        import aiohttp
        base = servers["http"][1]
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))

        async def read(u):
            async with session.get(u) as r:
                r.raise_for_status()
                return await r.read()

        return await _drive(read, [base + r for r in rels], args.concurrency, session.close)
    if mode == "fsspec-http":
        from fsspec.implementations.http import HTTPFileSystem
        base = servers["http"][1]
        fs = HTTPFileSystem(asynchronous=True, skip_instance_cache=True)
        await fs.set_session()

        async def close():
            await fs._session.close()

        return await _drive(fs._cat_file, [base + r for r in rels], args.concurrency, close)
    if mode in ("source-http", "source-http-aiohttp", "source-s3", "s3fs"):
        if mode.startswith("source-http"):
            src = FsspecSource(servers["http"][1], fast=(mode == "source-http"))
        else:
            src = FsspecSource("s3://bench/data", fast=(mode == "source-s3"), storage_options={
                "endpoint_url": servers["http"][1].rstrip("/"), "key": "k", "secret": "s",
                "client_kwargs": {"region_name": "us-east-1"}})
        return await _drive(src.read, [src.root + "/" + r for r in rels], args.concurrency,
                            src.close_io)
    raise ValueError(mode)


if __name__ == "__main__":
    main()
