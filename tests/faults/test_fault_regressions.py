"""The seven failures of issue 13, one test (or a few) each; each failed before its fix.

1. a decompression bomb is refused from its header, at every ``size``;
2. a server that declares a huge ``Content-Length`` costs no memory and is named a liar;
3. exit with a live iterator waits for at most one sample per decode thread;
4. a stuck sample never keeps the process alive (after LoaderTimeout, at exit, at close);
5. ``import asyncfeed`` and a pass leave OpenCV's thread count alone;
6. a tar shard cut short delivers every complete sample, its error names shard and member;
7. a consumer blocked in ``next()`` when another thread supersedes its pass is told so.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import threading
import time
import tracemalloc

import pytest
import torch
from PIL import Image

from asyncfeed import (AsyncLoader, ImageFolder, ImageLabelDecoder, LoaderClosedError,
                       LoaderTimeout, SampleError, WebDatasetShards, decode_image)
from asyncfeed._engine.policy import Mode
from asyncfeed._io.http11 import HTTPPool, IncompleteResponse
from support.faults import RawServer, bomb_jpeg, bomb_png, run_script
from support.imagegen import encode

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]


# -- 1. decompression bombs ------------------------------------------------------------

@pytest.mark.parametrize("size", [None, 32, 224])
@pytest.mark.parametrize("make", [bomb_jpeg, bomb_png], ids=["jpeg", "png"])
def test_bomb_is_refused_from_its_header_at_every_size(make, size):
    # full size: 400 M pixels, 1.2 GB if a decoder allocated it; resized: 3.6 G pixels,
    # still 168 MB after simplejpeg's 1/8 DCT scaling
    side = 20000 if size is None else 60000
    tracemalloc.start()
    try:
        with pytest.raises(Image.DecompressionBombError, match=f"{side * side} pixels"):
            decode_image(make(side, side), size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, f"{peak / 2**20:.0f} MiB allocated before refusing"


def test_max_pixels_is_configurable(tmp_path):
    good = encode("baseline", 48, 64)
    with pytest.raises(Image.DecompressionBombError, match="max_pixels=1000"):
        decode_image(good, None, max_pixels=1000)
    assert decode_image(good, None, max_pixels=48 * 64).shape == (3, 48, 64)
    with pytest.raises(ValueError, match="max_pixels"):
        decode_image(good, None, max_pixels=0)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jpg").write_bytes(good)
    (tmp_path / "c" / "b.jpg").write_bytes(bomb_jpeg())
    ds = ImageFolder(tmp_path, size=None, max_pixels=10_000)
    assert ds[0][0].shape == (3, 48, 64)
    with pytest.raises(SampleError, match=r"b\.jpg.*DecompressionBombError.*60000x60000"):
        ds[1]
    with pytest.raises(SampleError, match="max_pixels=1000"):
        ImageFolder(tmp_path, size=None, max_pixels=1000)[0]


# -- 2. a huge Content-Length ----------------------------------------------------------

def _liar(declared: int, body: bytes):
    def respond(request, sock, server):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % declared + body)
    return respond


def test_huge_content_length_costs_only_what_arrives_and_is_named():
    body = os.urandom(7600)
    with RawServer(_liar(3 << 30, body)) as server:
        async def go():
            pool = HTTPPool(4)
            try:
                return await pool.get(server.url + "x.jpg")
            finally:
                await pool.close()
        tracemalloc.start()
        try:
            with pytest.raises(IncompleteResponse) as info:
                asyncio.run(go())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    msg = str(info.value)
    assert "declared Content-Length: 3221225472" in msg and "sent 7600" in msg, msg
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB allocated for a 7.6 KB body"


def test_large_honest_body_still_arrives_whole():
    body = os.urandom(5 << 20)  # grows the buffer a few times
    with RawServer(_liar(len(body), body)) as server:
        async def go():
            pool = HTTPPool(4)
            try:
                return await pool.get(server.url + "big")
            finally:
                await pool.close()
        assert asyncio.run(go()).body == body


# -- 3. exit waits for at most one sample per thread ------------------------------------

def test_exit_with_a_live_iterator_waits_for_one_sample_per_thread():
    rc, out, err, _ = run_script("""
        import atexit, threading, time, torch
        from asyncfeed import AsyncLoader

        class Slow:
            started_after_end = 0
            ended = False
            def __len__(self): return 1024
            def __getitem__(self, i):
                if Slow.ended:
                    Slow.started_after_end += 1
                time.sleep(0.25)
                return torch.zeros(2)

        atexit.register(lambda: print("started after the end:", Slow.started_after_end,
                                      flush=True))
        loader = AsyncLoader(Slow(), batch_size=128, num_threads=2)
        it = iter(loader)
        time.sleep(0.6)   # both threads are inside a chunk of rows
        Slow.ended = True  # the script ends here, with `it` alive
    """)
    assert rc == 0, err
    started = int(out.rsplit(":", 1)[1])
    assert started <= 2, f"{started} samples started after the script ended (2 threads)"


# -- 4. a stuck sample -----------------------------------------------------------------

STUCK = """
    import sys, threading, time, torch
    from asyncfeed import AsyncLoader, LoaderTimeout

    class Stuck:
        def __len__(self): return 64
        def __getitem__(self, i):
            if i == 3:
                threading.Event().wait()   # a read that never returns
            return torch.zeros(2)
"""


def test_process_exits_after_loader_timeout_with_a_stuck_sample():
    rc, out, err, took = run_script(STUCK + """
    loader = AsyncLoader(Stuck(), batch_size=8, num_threads=2, timeout=1)
    it = iter(loader)
    try:
        next(it)
    except LoaderTimeout as e:
        print("timeout:", e, flush=True)
    print("end", time.monotonic(), flush=True)
    """, timeout=30)
    assert rc == 0, err
    assert "timeout:" in out and "[3]" in out, out  # the message names the sample
    assert took < 20, took


def test_process_exits_with_a_live_iterator_and_a_stuck_sample():
    rc, out, err, took = run_script(STUCK + """
    loader = AsyncLoader(Stuck(), batch_size=8, num_threads=2)
    it = iter(loader)
    time.sleep(0.5)
    print("end", flush=True)
    """, timeout=30)
    assert rc == 0, err
    assert out.strip() == "end"


def test_close_after_a_timeout_abandons_the_stuck_thread_and_tests_see_it():
    release = threading.Event()

    class Stuck:
        def __len__(self):
            return 16

        def __getitem__(self, i):
            if i == 3:
                release.wait(60)
            return torch.zeros(2)

    loader = AsyncLoader(Stuck(), batch_size=8, num_threads=2, timeout=0.5)
    it = iter(loader)
    with pytest.raises(LoaderTimeout, match=r"\[3\]"):
        next(it)
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 10  # a hang check: close() no longer waits forever
    abandoned = [t for t in threading.enumerate() if t.name.startswith("asyncfeed-abandoned-")]
    assert [t.name for t in abandoned] and all(not t.daemon for t in abandoned)
    release.set()  # the stuck call returns: its thread exits on its own
    for t in abandoned:
        t.join(10)
        assert not t.is_alive()


# -- 5. OpenCV's thread count ------------------------------------------------------------

def test_import_and_a_pass_leave_opencv_threads_alone(tmp_path):
    for i in range(6):
        os.makedirs(tmp_path / "c", exist_ok=True)
        (tmp_path / "c" / f"{i}.jpg").write_bytes(encode("baseline", 300, 400, seed=i))
    rc, out, err, _ = run_script(f"""
        import cv2
        cv2.setNumThreads(3)
        import asyncfeed
        print("after import", cv2.getNumThreads())
        ds = asyncfeed.ImageFolder({str(tmp_path)!r}, size=64)
        with asyncfeed.AsyncLoader(ds, batch_size=3, num_threads=2) as al:
            n = sum(len(b[1]) for b in al)
        print("after pass", cv2.getNumThreads(), n)
    """)
    assert rc == 0, err
    assert out.split() == ["after", "import", "3", "after", "pass", "3", "6"], out


# -- 6. tar shards cut short -----------------------------------------------------------

def _shard(n: int) -> tuple[bytes, list[int]]:
    """A shard of ``n`` samples (jpg + cls); the end offset of every member."""
    buf = io.BytesIO()
    ends = []
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            for ext, data in (("jpg", encode("baseline", 24, 24, seed=i)), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s/{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                ends.append(tf.offset)
    return buf.getvalue(), ends


def test_shard_cut_in_a_member_delivers_every_complete_sample(tmp_path):
    raw, ends = _shard(6)
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[:ends[9] + 600])  # inside 0005.jpg's data: 5 complete samples
    ds = WebDatasetShards(str(path), shuffle_buffer=0)
    got = []
    with pytest.raises(tarfile.ReadError) as info:  # a ShardError
        for s in ds:
            got.append(s["__key__"])
    assert got == [f"s/{i:04d}" for i in range(5)]
    assert str(path) in str(info.value) and "s/0005.jpg" in str(info.value)
    assert type(info.value).__name__ == "ShardError"


def test_shard_cut_in_a_header_is_an_error_not_an_end(tmp_path):
    raw, ends = _shard(6)
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[:ends[9] + 100])  # inside 0005.jpg's header
    got = []
    with pytest.raises(tarfile.ReadError, match=r"cut\.tar.*s/0004\.cls.*cut short"):
        for s in WebDatasetShards(str(path), shuffle_buffer=0):
            got.append(s["__key__"])
    assert len(got) == 5


def test_shard_errors_through_the_loader_name_the_shard(tmp_path):
    raw, ends = _shard(6)
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[:ends[9] + 600])
    ds = WebDatasetShards(str(path), shuffle_buffer=0, decode=ImageLabelDecoder(16))
    got = []
    with pytest.raises(Exception) as info:
        with AsyncLoader(ds, batch_size=1, num_threads=2) as al:
            for _, label in al:
                got.extend(label.tolist())
    assert got == [0, 1, 2, 3, 4]
    assert "cut.tar" in str(info.value) and "s/0005.jpg" in str(info.value), info.value


# -- 7. superseded while waiting -------------------------------------------------------

def test_consumer_blocked_in_next_is_told_its_pass_was_superseded():
    gate = threading.Event()

    class Gated:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            gate.wait(30)
            return torch.zeros(1)

    loader = AsyncLoader(Gated(), batch_size=4, num_threads=2)
    it = iter(loader)
    caught: list[BaseException] = []

    def consume():
        try:
            next(it)
        except BaseException as e:  # noqa: BLE001
            caught.append(e)

    t = threading.Thread(target=consume, name="test-consumer")
    t.start()
    time.sleep(0.3)  # the consumer is waiting in next()
    opener = threading.Timer(0.3, gate.set)  # lets the running samples end while closing
    opener.start()
    it2 = iter(loader)  # supersedes the first pass
    opener.join()
    t.join(10)
    assert caught and isinstance(caught[0], LoaderClosedError)
    assert "superseded" in str(caught[0]), caught[0]
    assert len(list(it2)) == 2
    loader.close()


class _Small:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i)


def test_a_bug_in_a_row_task_fails_the_pass_instead_of_hanging(monkeypatch):
    """What a decode task raises outside the per-sample handling (a bug of ours)
    reaches the consumer; before, the pool only logged it and ``next()`` waited for
    the batch's rows for ever."""
    from asyncfeed._engine import rowtasks

    def broken_rows(*args):
        raise RuntimeError("row task broke")

    monkeypatch.setattr(rowtasks, "_rows", broken_rows)
    with AsyncLoader(_Small(), batch_size=8, timeout=20) as loader:
        with pytest.raises(RuntimeError, match="row task broke"):
            for _ in loader:
                pass


def test_a_bug_in_the_execution_choice_is_logged_and_loses_only_the_choice(monkeypatch,
                                                                         caplog):
    from asyncfeed._engine import chooser

    def broken(*args, **kw):
        raise RuntimeError("the policy broke")

    with AsyncLoader(_Small(), batch_size=8, timeout=20) as loader:
        monkeypatch.setattr(chooser, "decide", broken)  # at the first window's end
        for _ in range(200):  # short epochs: windows span them
            got = torch.cat([b for b in loader])
            assert sorted(got[:, 0].tolist()) == list(range(64))
            if "the execution choice failed" in caplog.text:
                break
        ex = loader.stats().execution
        assert sorted(torch.cat([b for b in loader])[:, 0].tolist()) == list(range(64))
    assert "the execution choice failed" in caplog.text
    assert ex is not None and ex.mode is Mode.THREADS, str(ex)
