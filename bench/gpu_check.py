#!/usr/bin/env python
"""The GPU path, checked on a real GPU: correctness, copy bandwidth, overlap, training.

    python bench/gpu_check.py [--quick] [--out PATH] [--sections a,b,c,d]

One command, sized for one H200 with 16 cores (default run about 5 minutes,
each section time-boxed). Writes JSON (``--out``; default ``$OUT/gpu_check.json``
when ``$OUT`` is set, else ``bench-results/gpu_check.json``) and prints a short
table last. ``docs/gpu.md`` says what each section measures and how.

Sections:

(a) correctness: thousands of batches through ``AsyncLoader(device="cuda")``
    (pinned slot ring, copy stream) with a small ``prefetch`` so slots are
    reused as fast as possible; the consumer runs random-length kernels on its
    own stream and checks, on the GPU, every row's checksum, index and tag
    against tables computed on the CPU from the data set's definition. Slots are
    poisoned (``SlotRing.poison``) before each reuse, so a row nobody wrote
    shows as the pattern; a negative control (a data set that skips writing
    some rows) must be caught row for row. Three data set shapes (plain
    ``__getitem__``, ``read``+``decode_into``, ``async fetch``+``decode_into``),
    variable batch sizes (the ring is rebuilt once) and a pass cut short by
    ``break``. Without CUDA it runs on the CPU: the plain CPU path, and the ring
    path behind a simulated copy stream (a thread that copies after a random
    delay; its event completes only then).
(b) bandwidth: the loader's host-to-device copies timed with CUDA events on its
    copy stream, against a plain pinned ``copy_`` of the same size in this run.
(c) overlap: a compute-bound consumer step (bf16 matmuls); the time the
    consumer's stream spends between "before next()" and "after next()" (the
    ``wait_event`` on the loader's copy) from CUDA events, as a fraction of
    step time.
(d) training: ResNet-50, synthetic JPEG folder, 224x224, batch 256, bf16
    autocast, channels_last: images/s, GPU utilisation (pynvml) and CPU cores
    busy (psutil, whole process tree) for AsyncLoader against DataLoader with
    num_workers 4, 8, 12, 16, pin_memory=True and non_blocking copies.

Without CUDA, (b)-(d) are reported as skipped ("no CUDA") and the run exits 0
if (a) passed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import queue
import random
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if os.path.join(REPO, "src") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "src"))

import torch  # noqa: E402

import asyncfeed  # noqa: E402
from asyncfeed import AsyncLoader  # noqa: E402
from asyncfeed._memory.device import CopyStream, map_tensors  # noqa: E402
from asyncfeed._memory.slots import SlotRing  # noqa: E402

SECTIONS = ("correctness", "bandwidth", "overlap", "training")
SECTION_KEYS = {"a": "correctness", "b": "bandwidth", "c": "overlap", "d": "training"}
POISON = 0xA5
CONTROL_CLEAN_BATCHES = 8
TARGETS = {"bandwidth_ratio": 0.90, "overlap_wait_fraction": 0.02}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# =========================================================================== data sets
class ChecksumSet:
    """Deterministic samples ``(uint8 image, index, float32[4] tag)``.

    Image ``i`` is ``pool[i % P] ^ (i // P)``: every sample differs, and any
    worker computes it in one cheap op. A few samples sleep (``slow``) so rows
    and batches complete out of order.
    """

    def __init__(self, n: int, shape: tuple[int, ...], *, pool: int = 64, seed: int = 0,
                 slow_fraction: float = 0.01, slow_s: float = 0.002) -> None:
        if n // pool > 255:
            raise ValueError("n must be at most 256 * pool (the xor byte must differ)")
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.shape = tuple(shape)
        self.P = pool
        self.pool = torch.randint(0, 256, (pool, *shape), dtype=torch.uint8, generator=g)
        self.slow_fraction = slow_fraction
        self.slow_s = slow_s

    def __len__(self) -> int:
        return self.n

    def _maybe_slow(self) -> None:
        if self.slow_fraction and random.random() < self.slow_fraction:
            time.sleep(random.uniform(0, self.slow_s))

    def image(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return torch.bitwise_xor(self.pool[i % self.P], (i // self.P) & 0xFF)
        return torch.bitwise_xor(self.pool[i % self.P], (i // self.P) & 0xFF, out=out)

    @staticmethod
    def tag(i: int) -> torch.Tensor:
        return torch.tensor([i, i * 0.5, -i, 1.0], dtype=torch.float32)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        self._maybe_slow()
        return self.image(i), int(i), self.tag(i)


class DecodeIntoSet(ChecksumSet):
    """``read`` + ``decode_into``: the image is written straight into the slot row.

    Indices in ``skip_write`` are deliberately left unwritten (negative control).
    """

    def __init__(self, *args: Any, skip_write: frozenset[int] = frozenset(), **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.skip_write = skip_write

    def read(self, i: int) -> int:
        self._maybe_slow()
        return i

    def decode(self, raw: int, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        return self.image(i), int(i), self.tag(i)

    def decode_into(self, raw: int, i: int, out: torch.Tensor) -> Any:
        if tuple(out.shape) != self.shape:
            return self.decode(raw, i)
        if i not in self.skip_write:
            self.image(i, out=out)
        return out, int(i), self.tag(i)


class FetchSet(DecodeIntoSet):
    """``async fetch`` on the loader's event loop, then ``decode_into``."""

    async def fetch(self, i: int) -> int:
        if self.slow_fraction and random.random() < self.slow_fraction:
            import asyncio
            await asyncio.sleep(random.uniform(0, self.slow_s))
        return i


class PoolSet:
    """Cheap fixed-size samples ``(uint8 [3,H,W], label)`` copied from a pool
    (``decode_into`` writes straight into the slot): a loader that is not CPU-bound."""

    def __init__(self, n: int, shape: tuple[int, ...], pool: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.shape = tuple(shape)
        self.pool = torch.randint(0, 256, (pool, *shape), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.pool[i % len(self.pool)].clone(), i % 1000

    def read(self, i: int) -> int:
        return i

    def decode(self, raw: int, i: int) -> tuple[torch.Tensor, int]:
        return self[i]

    def decode_into(self, raw: int, i: int, out: torch.Tensor) -> Any:
        out.copy_(self.pool[i % len(self.pool)])
        return out, i % 1000


class ChunkPlan:
    """A batch sampler that yields chunk ``epoch`` (``AsyncLoader.set_epoch`` selects it)."""

    def __init__(self, chunks: list[list[list[int]]]) -> None:
        self.chunks = chunks
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        return iter(self.chunks[self.epoch])

    def __len__(self) -> int:
        return len(self.chunks[self.epoch])


# ============================================================ CPU stand-in for CUDA
class SimEvent:
    """Duck-typed ``torch.cuda.Event``: completes when the simulated copy is done."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(60):
            raise RuntimeError("simulated copy did not finish within 60 s")


class SimCopyStream:
    """Stands in for ``CopyStream`` without CUDA: one thread performs the copies in
    order (a stream), each after a random delay, then completes its event. Any
    rewrite of a slot before its event completed corrupts the copy."""

    def __init__(self, max_delay_s: float = 0.001, seed: int = 0) -> None:
        self._q: queue.Queue = queue.Queue()
        self._rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.copies = 0
        self._thread = threading.Thread(target=self._run, name="gpu-check-simcopy")
        self._thread.start()

    def to_device(self, host_batch: Any) -> tuple[Any, SimEvent]:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def alloc(t: torch.Tensor) -> torch.Tensor:
            dst = torch.empty_like(t)
            pairs.append((t, dst))
            return dst

        out = map_tensors(host_batch, alloc)
        ev = SimEvent()
        self._q.put((pairs, ev, self._rng.uniform(0, self.max_delay_s)))
        return out, ev

    def pin(self, host_batch: Any) -> Any:
        return host_batch  # no CUDA, nothing to pin: the ring is plain memory

    def hand_over(self, gpu_batch: Any, event: SimEvent) -> None:
        event.synchronize()  # the consumer "stream" waits for the copy

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            pairs, ev, delay = item
            if delay > 0:
                time.sleep(delay)
            for src, dst in pairs:
                dst.copy_(src)
            self.copies += 1
            ev._done.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


@contextlib.contextmanager
def poisoned_slots(byte: int | None) -> Any:
    saved = SlotRing.poison
    SlotRing.poison = byte
    try:
        yield
    finally:
        SlotRing.poison = saved


# ======================================================================= (a) correctness
class Checker:
    """Per-row reference tables, on the device where batches arrive."""

    def __init__(self, ds: ChecksumSet, device: torch.device) -> None:
        numel = math.prod(ds.shape)
        g = torch.Generator().manual_seed(1234)
        w = torch.randint(1, 1 << 16, (numel,), dtype=torch.int64, generator=g)
        cs = torch.empty(ds.n, dtype=torch.int64)
        tags = torch.empty(ds.n, 4, dtype=torch.float32)
        step = 256
        for s in range(0, ds.n, step):
            idx = torch.arange(s, min(s + step, ds.n))
            xor = ((idx // ds.P) & 0xFF).to(torch.uint8).view(-1, *[1] * len(ds.shape))
            imgs = torch.bitwise_xor(ds.pool[idx % ds.P], xor)
            cs[s:s + len(idx)] = (imgs.reshape(len(idx), -1).to(torch.int64) * w).sum(1)
            tags[s:s + len(idx)] = torch.stack([idx.float(), idx.float() * 0.5, -idx.float(),
                                                torch.ones(len(idx))], 1)
        self.device = device
        self.shape = ds.shape
        self.w = w.to(device)
        self.cs = cs.to(device)
        self.tags = tags.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the tables are read on other streams

    def bad_rows(self, batch: Any, expect: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
        """Rows of ``batch`` that differ from the reference (a device tensor, no sync),
        or (None, why) when the batch's structure is wrong (host-visible)."""
        if not (isinstance(batch, (list, tuple)) and len(batch) == 3):
            return None, f"structure {type(batch).__name__}"
        img, idx, tag = batch
        n = expect.numel()
        if tuple(img.shape) != (n, *self.shape) or tuple(idx.shape) != (n,) \
                or tuple(tag.shape) != (n, 4):
            return None, f"shapes {tuple(img.shape)} {tuple(idx.shape)} for {n} rows"
        if img.device != self.device or idx.device != self.device:
            return None, f"device {img.device}"
        got = (img.reshape(n, -1).to(torch.int64) * self.w).sum(1)
        bad = (got != self.cs[expect]) | (idx != expect) | (tag != self.tags[expect]).any(1)
        return bad.sum(), None


def make_plan(n_items: int, n_batches: int, batch: int, passes: int,
              rng: random.Random) -> list[list[list[int]]]:
    """``passes`` chunks of batches: the first batch half size (so the ring is
    rebuilt when the full ones come), most full, some of random size."""
    batches = []
    for k in range(n_batches):
        if k == 0:
            size = max(1, batch // 2)
        elif rng.random() < 0.15:
            size = rng.randint(1, batch)
        else:
            size = batch
        batches.append(rng.sample(range(n_items), size))
    per = max(1, math.ceil(n_batches / passes))
    return [batches[i:i + per] for i in range(0, n_batches, per)]


def run_checked(loader: AsyncLoader, plan: ChunkPlan, checker: Checker, *, cuda: bool,
                rng: random.Random, deadline: float, cut_pass: int | None,
                hold: int, max_kernel_cycles: int, pace_lag: int) -> dict:
    """Iterate every chunk of ``plan`` through ``loader`` and check every batch."""
    dev = checker.device
    stream = torch.cuda.Stream(dev) if cuda else None
    checked = samples = host_errors = 0
    notes: list[str] = []
    counters: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # pass, t, errs, late
    timed_out = False
    for p, chunk in enumerate(plan.chunks):
        if time.monotonic() > deadline:
            timed_out = True
            break
        loader.set_epoch(p)
        offs = [0]
        for b in chunk:
            offs.append(offs[-1] + len(b))
        stop_at = int(len(chunk) * 0.6) if p == cut_pass else None
        held: collections.deque = collections.deque()
        marks: collections.deque = collections.deque()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        batch = None
        with ctx:
            # made on the consumer stream, which alone uses them: ordered with the
            # checks, and the allocator reuses their memory only behind that stream
            flat = torch.tensor([i for b in chunk for i in b], dtype=torch.int64).to(dev)
            errs = torch.zeros(len(chunk), dtype=torch.int64, device=dev)
            late = torch.zeros(len(chunk), dtype=torch.int64, device=dev)
            counters.append((p, len(chunk), errs, late))
            it = iter(loader)
            for t, batch in enumerate(it):
                expect = flat[offs[t]:offs[t + 1]]
                if cuda and max_kernel_cycles and rng.random() < 0.5:
                    torch.cuda._sleep(rng.randrange(max_kernel_cycles))
                bad, why = checker.bad_rows(batch, expect)
                if bad is None:
                    host_errors += 1
                    if len(notes) < 10:
                        notes.append(f"pass {p} batch {t}: {why}")
                else:
                    errs[t:t + 1].add_(bad)
                checked += 1
                samples += len(chunk[t])
                if cuda and max_kernel_cycles and rng.random() < 0.5:
                    torch.cuda._sleep(rng.randrange(max_kernel_cycles))
                # hold a few batches and check them again later: their memory must
                # not be reused while held (caching allocator + record_stream)
                held.append((t, batch, expect))
                if len(held) > hold:
                    t0, b0, e0 = held.popleft()
                    bad0, _ = checker.bad_rows(b0, e0)
                    if bad0 is not None:
                        late[t0:t0 + 1].add_(bad0)
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    marks.append(ev)
                    if len(marks) > pace_lag:  # keep the host at most pace_lag steps ahead
                        marks.popleft().synchronize()
                elif max_kernel_cycles and rng.random() < 0.3:
                    time.sleep(rng.uniform(0, 2e-4))  # the CPU run's "kernel"
                if rng.random() < 0.05:
                    time.sleep(rng.uniform(0, 1e-3))  # host jitter: shift the phase
                if stop_at is not None and t + 1 >= stop_at:
                    break  # cut the pass short: the next iter() must still work
                if time.monotonic() > deadline:
                    timed_out = True
                    break
            while held:
                t0, b0, e0 = held.popleft()
                bad0, _ = checker.bad_rows(b0, e0)
                if bad0 is not None:
                    late[t0:t0 + 1].add_(bad0)
            del it, batch
    if cuda:
        torch.cuda.synchronize(dev)
    errors = sum(int(e.sum()) for _, _, e, _ in counters)
    late_errors = sum(int(lt.sum()) for _, _, _, lt in counters)
    first_bad = []
    for p, _, e, lt in counters:
        for t in torch.nonzero(e + lt).flatten().tolist()[:5]:
            first_bad.append({"pass": p, "batch": t, "rows": int(e[t]), "late_rows": int(lt[t])})
    return {"batches_checked": checked, "samples_checked": samples, "bad_rows": errors,
            "bad_rows_late": late_errors, "host_errors": host_errors, "notes": notes,
            "first_bad": first_bad[:10], "timed_out": timed_out}


def correctness_run(mode: str, *, cuda: bool, sim: bool, n_items: int, shape: tuple[int, ...],
                    batch: int, n_batches: int, passes: int, prefetch: int, threads: int,
                    deadline: float, seed: int, skip_write: frozenset[int] = frozenset(),
                    max_kernel_cycles: int = 0, sim_delay_s: float = 0.001,
                    hold: int = 4, pace_lag: int = 16) -> dict:
    """One loader (data set kind ``mode``) through ``passes`` passes, every batch checked."""
    cls = {"getitem": ChecksumSet, "decode_into": DecodeIntoSet, "fetch": FetchSet}[mode]
    kw = {"skip_write": skip_write} if mode != "getitem" else {}
    ds = cls(n_items, shape, seed=seed, **kw)
    rng = random.Random(seed * 7919 + len(mode))
    chunks = make_plan(n_items, n_batches, batch, passes, rng)
    if skip_write:
        # the first batches of a loader are collated (its layout is not known yet):
        # their rows are not decoded in place, so keep the skipped indices out of them
        for b in chunks[0][:CONTROL_CLEAN_BATCHES]:
            b[:] = [i + 1 if i in skip_write else i for i in b]
    plan = ChunkPlan(chunks)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    checker = Checker(ds, device)
    t0 = time.perf_counter()
    # without CUDA, the simulated copy stream drives the loader's CUDA path (slot
    # ring, copies, hand-over) as its copy_stream
    sim_copy = SimCopyStream(sim_delay_s, seed) if sim else None
    al = AsyncLoader(ds, batch_sampler=plan, num_threads=threads, prefetch=prefetch,
                     device=device if cuda else None, timeout=60, copy_stream=sim_copy)
    try:
        res = run_checked(al, plan, checker, cuda=cuda, rng=rng, deadline=deadline,
                          cut_pass=1 if passes > 2 else None, hold=hold,
                          max_kernel_cycles=max_kernel_cycles, pace_lag=pace_lag)
        st = al.stats()
        ring = al._ring
    finally:
        al.close()
        if sim_copy is not None:
            sim_copy.close()
    expected_bad = 0
    if skip_write:
        # rows whose image was deliberately not written, in the batches that were checked
        done = res["batches_checked"]
        cut = 1 if passes > 2 else None
        for p, chunk in enumerate(chunks):
            limit = len(chunk) if p != cut else max(1, int(len(chunk) * 0.6))
            take = chunk[:min(limit, done)]
            done -= len(take)
            expected_bad += sum(1 for b in take for i in b if i in skip_write)
    res.update({"mode": mode, "path": st.path, "ring_made": getattr(ring, "made", None),
                "ring_slots": getattr(ring, "count", None),
                "ring_dropped": getattr(ring, "dropped", None), "slot_waits": st.slot_waits,
                "sim_copies": sim_copy.copies if sim_copy else None,
                "seconds": round(time.perf_counter() - t0, 2),
                "expected_bad_rows": expected_bad if skip_write else 0})
    return res


def section_correctness(args: argparse.Namespace, cuda: bool) -> dict:
    t_start = time.monotonic()
    deadline = t_start + args.correct_time
    shape = tuple(int(x) for x in args.correct_shape.split(","))
    threads = args.threads or cores()
    modes = ("getitem", "decode_into", "fetch")
    per_mode = max(3, args.correct_batches // len(modes))
    kw = dict(shape=shape, batch=args.correct_batch, passes=3, prefetch=args.correct_prefetch,
              threads=threads, n_items=args.correct_items)
    runs: list[dict] = []
    variants: list[tuple[str, bool]] = \
        [("cuda", False)] if cuda else [("cpu", False), ("sim", True)]
    cycles = int(args.kernel_us * 2000) if cuda else (1 if args.kernel_us else 0)
    with poisoned_slots(POISON):
        for vi, (variant, sim) in enumerate(variants):
            for mi, mode in enumerate(modes):
                left = len(variants) * len(modes) - (vi * len(modes) + mi)
                sub_deadline = time.monotonic() + max(1.0, (deadline - time.monotonic()) / left)
                # decode_into runs with a single slot: every batch waits for the
                # previous copy before its rows may be written
                r = correctness_run(mode, cuda=cuda, sim=sim, n_batches=per_mode,
                                    deadline=sub_deadline, seed=100 * vi + mi,
                                    max_kernel_cycles=cycles,
                                    **{**kw, "prefetch": 1 if mode == "decode_into"
                                       else args.correct_prefetch})
                r["variant"] = variant
                runs.append(r)
                log(f"(a) {variant}/{mode}: {r['batches_checked']} batches, "
                    f"{r['bad_rows']} bad rows, {r['bad_rows_late']} late, "
                    f"{r['host_errors']} host errors, path={r['path']}, "
                    f"slot waits {r['slot_waits']}, {r['seconds']} s")
        # negative control: rows deliberately left unwritten must all be caught
        controls = []
        for variant, sim in variants:
            if variant == "cpu":
                continue  # fresh host memory, no ring to poison: not a meaningful control
            n_items = args.correct_items
            skip = frozenset(range(0, n_items, 31))
            r = correctness_run("decode_into", cuda=cuda, sim=sim,
                                n_batches=max(6, min(60, per_mode)), deadline=time.monotonic() + 30,
                                seed=999, skip_write=skip, max_kernel_cycles=0,
                                **{**kw, "passes": 1})
            r["variant"] = variant
            caught = r["bad_rows"] == r["expected_bad_rows"] and r["expected_bad_rows"] > 0
            r["caught_every_unwritten_row"] = caught
            controls.append(r)
            log(f"(a) negative control ({variant}): {r['expected_bad_rows']} rows unwritten, "
                f"{r['bad_rows']} flagged")
    checked = sum(r["batches_checked"] for r in runs)
    bad = sum(r["bad_rows"] + r["bad_rows_late"] + r["host_errors"] for r in runs)
    ring_runs = [r for r in runs if r["variant"] in ("cuda", "sim")]
    problems = []
    if bad:
        problems.append(f"{bad} bad rows/batches")
    if checked < args.correct_min_batches:
        problems.append(f"only {checked} batches checked (< {args.correct_min_batches})")
    if any(r["ring_slots"] is None for r in ring_runs):
        problems.append("a ring run did not go through the slot ring")
    if not all(c["caught_every_unwritten_row"] for c in controls):
        problems.append("the negative control was not caught row for row")
    return {"status": "failed" if problems else "passed", "problems": problems,
            "device": "cuda" if cuda else "cpu", "poison": POISON,
            "batches_checked": checked, "bad_rows": bad,
            "samples_checked": sum(r["samples_checked"] for r in runs),
            "slot_waits": sum(r["slot_waits"] for r in ring_runs),
            "runs": runs, "negative_control": controls,
            "seconds": round(time.monotonic() - t_start, 1)}


# ======================================================================= (b) bandwidth
def _plain_copy_ms(nbytes: int, reps: int, dev: torch.device) -> list[float]:
    """Plain pinned host -> device ``copy_`` of ``nbytes``, timed with CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream(dev)
    out = []
    with torch.cuda.stream(s):
        for r in range(reps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            dst.copy_(src, non_blocking=True)
            b.record(s)
            b.synchronize()
            if r >= 3:
                out.append(a.elapsed_time(b))
    del src, dst
    return out


def section_bandwidth(args: argparse.Namespace, dev: torch.device) -> dict:
    t_start = time.monotonic()
    B, shape = args.bw_batch, (3, args.image_size, args.image_size)
    ds = PoolSet(max(4096, B * 8), shape)
    img_bytes = B * math.prod(shape)
    label_bytes = B * 8
    log(f"(b) plain pinned copy of {img_bytes / 2**20:.1f} MiB ...")
    plain_before = _plain_copy_ms(img_bytes, args.bw_reps // 2, dev)
    order = [i % len(ds) for i in range(B * args.bw_batches)]
    # the loader's copy stream, with per-batch start/end events
    copy = CopyStream(dev, timing=True)
    al = AsyncLoader(ds, batch_size=B, sampler=order, device=dev, prefetch=4,
                     num_threads=args.threads or cores(), drop_last=True, timeout=60,
                     copy_stream=copy)
    consumer = torch.cuda.Stream(dev)
    n = 0
    deadline = t_start + args.bw_time
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(consumer):
            for batch in al:
                n += 1
                del batch
                if time.monotonic() > deadline:
                    break
        torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
        slot_waits = al.stats().slot_waits
    finally:
        al.close()
    plain_after = _plain_copy_ms(img_bytes, args.bw_reps - args.bw_reps // 2, dev)
    copies = [(s.elapsed_time(e), nb) for s, e, nb in copy.timings]
    full = [(ms, nb) for ms, nb in copies if nb >= img_bytes][3:]  # skip the first (warm-up)
    rates = [nb / (ms / 1e3) for ms, nb in full if ms > 0]
    plain = plain_before + plain_after
    plain_rates = [img_bytes / (ms / 1e3) for ms in plain]
    loader_bps = _median(rates)
    plain_bps = _median(plain_rates)
    ratio = loader_bps / plain_bps if loader_bps and plain_bps else None
    status = "failed" if ratio is None else (
        "passed" if ratio >= TARGETS["bandwidth_ratio"] else "below target")
    return {"status": status, "target_ratio": TARGETS["bandwidth_ratio"], "ratio": ratio,
            "loader_bytes_per_s_median": loader_bps,
            "loader_bytes_per_s_aggregate":
                sum(nb for _, nb in full) / (sum(ms for ms, _ in full) / 1e3) if full else None,
            "plain_bytes_per_s_median": plain_bps,
            "plain_bytes_per_s_before": _median([img_bytes / (ms / 1e3) for ms in plain_before]),
            "plain_bytes_per_s_after": _median([img_bytes / (ms / 1e3) for ms in plain_after]),
            "batch_bytes": img_bytes + label_bytes, "image_bytes": img_bytes,
            "copies_timed": len(full), "batches": n,
            "loader_batches_per_s_host": n / wall if wall > 0 else None,
            "copy_ms_median": _median([ms for ms, _ in full]),
            "plain_ms_median": _median(plain), "slot_waits": slot_waits,
            "seconds": round(time.monotonic() - t_start, 1)}


# ========================================================================= (c) overlap
def section_overlap(args: argparse.Namespace, dev: torch.device, loader_ms: float | None) -> dict:
    t_start = time.monotonic()
    B, shape = args.ov_batch, (3, args.image_size, args.image_size)
    D = args.ov_dim
    g = torch.Generator(device=dev).manual_seed(0)
    W = (torch.randn(D, D, device=dev, generator=g) / math.sqrt(D)).to(torch.bfloat16)
    H0 = torch.randn(D, D, device=dev, generator=g).to(torch.bfloat16)
    # one matmul's time, to size a step of the wanted length
    for _ in range(3):
        H0 @ W
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        H0 @ W
    b.record()
    b.synchronize()
    mm_ms = a.elapsed_time(b) / 10
    target_ms = max(args.ov_step_ms, 2.0 * loader_ms) if loader_ms else args.ov_step_ms
    k = max(1, round(target_ms / mm_ms))

    def step(x: torch.Tensor) -> torch.Tensor:
        s = x.float().mean() / 255.0          # reads the whole batch
        h = H0 * s.to(torch.bfloat16)
        for _ in range(k):
            h = h @ W
        return h

    ds = PoolSet(max(4096, B * 8), shape)
    total = args.ov_warmup + args.ov_steps
    consumer = torch.cuda.Stream(dev)

    def measure(use_loader: bool) -> dict:
        order = [i % len(ds) for i in range(B * (total + 1))]
        al = AsyncLoader(ds, batch_size=B, sampler=order, device=dev, prefetch=args.ov_prefetch,
                         num_threads=args.threads or cores(), drop_last=True, timeout=60) \
            if use_loader else None
        fixed = torch.randint(0, 256, (B, *shape), dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)  # made on the default stream, read on the consumer's
        before = [torch.cuda.Event(enable_timing=True) for _ in range(total + 1)]
        after = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
        deadline = time.monotonic() + args.ov_time / 2
        done = 0
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(consumer):
                it = iter(al) if al is not None else None
                for i in range(total):
                    if i >= 2:
                        before[i - 2].synchronize()  # host at most two steps ahead
                    before[i].record(consumer)
                    if it is not None:
                        x, _ = next(it)              # hand_over: consumer.wait_event(copy)
                    else:
                        x = fixed
                    after[i].record(consumer)
                    step(x)
                    done = i + 1
                    if time.monotonic() > deadline and done > args.ov_warmup + 3:
                        break
                before[done].record(consumer)
                del it
            torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
            st = al.stats() if al is not None else None
        finally:
            if al is not None:
                al.close()
        lo = min(args.ov_warmup, max(0, done - 3))
        waits = [before[i].elapsed_time(after[i]) for i in range(lo, done)]
        steps = [before[i].elapsed_time(before[i + 1]) for i in range(lo, done)]
        return {"steps_timed": len(steps), "wait_ms_total": sum(waits),
                "step_ms_total": sum(steps),
                "wait_fraction": sum(waits) / sum(steps) if steps else None,
                "wait_ms_median": _median(waits), "wait_ms_max": max(waits) if waits else None,
                "step_ms_median": _median(steps), "host_wall_s": wall,
                "slot_waits": st.slot_waits if st is not None else None,
                "host_wait_s": st.wait_s if st is not None else None}

    log(f"(c) step = {k} bf16 {D}x{D} matmuls ({mm_ms:.2f} ms each, target {target_ms:.0f} ms)")
    base = measure(False)
    with_loader = measure(True)
    frac = with_loader["wait_fraction"]
    status = "failed" if frac is None else (
        "passed" if frac <= TARGETS["overlap_wait_fraction"] else "below target")
    return {"status": status, "target_wait_fraction": TARGETS["overlap_wait_fraction"],
            "wait_fraction": frac, "batch": B, "matmuls_per_step": k, "matmul_ms": mm_ms,
            "loader_ms_per_batch_estimate": loader_ms, "with_loader": with_loader,
            "no_loader": base,
            "step_overhead": (with_loader["step_ms_median"] / base["step_ms_median"] - 1)
            if with_loader["step_ms_median"] and base["step_ms_median"] else None,
            "seconds": round(time.monotonic() - t_start, 1)}


# ======================================================================== (d) training
class GpuUtilSampler:
    """GPU utilisation (pynvml) sampled every ``interval`` s in a background thread."""

    def __init__(self, dev: torch.device, interval: float = 0.1) -> None:
        from asyncfeed._optional import require
        pynvml = require("pynvml", "GPU utilisation sampling")
        self._nvml = pynvml
        pynvml.nvmlInit()
        self.handle = None
        try:
            p = torch.cuda.get_device_properties(dev)
            bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001 - no PCI ids in this torch: go by the index
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-check-nvml")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:  # noqa: BLE001
                pass

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        s = self.samples
        return {"gpu_util_mean": sum(s) / len(s) if s else None,
                "gpu_util_median": _median([float(v) for v in s]), "gpu_util_samples": len(s)}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def tree_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of this process and every descendant, by pid."""
    import psutil
    me = psutil.Process()
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def section_training(args: argparse.Namespace, dev: torch.device) -> dict:
    t_start = time.monotonic()
    deadline = t_start + args.train_time
    try:
        import torchvision
    except ImportError as e:
        return skipped(f"torchvision is not installed ({e})")
    from torch.utils.data import DataLoader

    from asyncfeed._bench import synthetic as _synthetic
    root = args.data_root or os.path.join(os.environ.get("TMPDIR", "/tmp"), "asyncfeed-gpu-check")
    log(f"(d) synthetic set: {args.train_images} JPEGs under {root} ...")
    t0 = time.perf_counter()
    n_classes = max(1, min(100, args.train_images // 10))
    folder = _synthetic.ensure_synthetic(args.train_images, n_classes, root=root, workers=cores())
    gen_s = time.perf_counter() - t0
    ds = asyncfeed.ImageFolder(folder, size=args.image_size)
    B = args.train_batch
    steps, warmup = args.train_steps, args.train_warmup
    rng = random.Random(0)
    order: list[int] = []
    while len(order) < B * (warmup + steps):
        perm = list(range(len(ds)))
        rng.shuffle(perm)
        order += perm
    order = order[:B * (warmup + steps)]

    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=1000).to(dev)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255
    crit = torch.nn.CrossEntropyLoss()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last).float().sub_(mean).div_(std)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        util = GpuUtilSampler(dev)
        util_error = None
    except Exception as e:  # noqa: BLE001
        util, util_error = None, f"pynvml unavailable: {type(e).__name__}: {e}"

    def run(name: str, batches: Callable[[], Any], to_gpu: bool, close: Callable[[], None],
            info: dict, extra: Callable[[], dict] = dict) -> dict:
        it = batches()
        sampling = False
        try:
            for _ in range(warmup):
                x, y = next(it)
                if to_gpu:
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                train_step(x, y)
            torch.cuda.synchronize(dev)
            if util is not None:
                util.start()
                sampling = True
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            marks = []
            loss = None
            for i in range(steps):
                x, y = next(it)
                if to_gpu:
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                loss = train_step(x, y)
                marks.append(time.perf_counter())
            torch.cuda.synchronize(dev)
            t1 = time.perf_counter()
            cpu1 = tree_cpu_seconds()
            u = util.stop() if util is not None else {"gpu_util_mean": None}
            sampling = False
            info = {**info, **extra()}
        finally:
            if sampling and util is not None:
                util.stop()
            close()
        wall = t1 - t0
        half = steps // 2
        second_half = (steps - half) * B / (t1 - marks[half - 1]) if half >= 1 else None
        res = {"name": name, **info, "images_per_s": steps * B / wall,
               "images_per_s_second_half": second_half, "wall_s": wall,
               "cores_busy": _cpu_used(cpu0, cpu1) / wall, "loss_last": float(loss), **u}
        log(f"(d) {name}: {res['images_per_s']:.0f} img/s, GPU {u.get('gpu_util_mean')}%, "
            f"{res['cores_busy']:.1f} cores busy")
        return res

    def fixed_batches() -> Any:
        x = torch.randint(0, 256, (B, 3, args.image_size, args.image_size), dtype=torch.uint8,
                          device=dev)
        y = torch.randint(0, n_classes, (B,), device=dev)
        while True:
            yield x, y

    results: list[dict] = []
    configs: list[tuple[str, Any]] = [("gpu only (no loader)", None), ("asyncfeed", None)]
    configs += [(f"DataLoader w={w}", w) for w in args.train_workers]
    for name, w in configs:
        if time.monotonic() > deadline:
            results.append({"name": name, "status": "skipped", "reason": "time box"})
            continue
        try:
            if name.startswith("gpu only"):
                results.append(run(name, fixed_batches, False, lambda: None, {}))
            elif name == "asyncfeed":
                al = AsyncLoader(ds, batch_size=B, sampler=order, device=dev, drop_last=True,
                                 num_threads=args.threads or None, timeout=120)
                results.append(run(name, lambda: iter(al), False, al.close,
                                   {"num_threads": al.num_threads, "prefetch": al.prefetch},
                                   lambda: {"slot_waits": al.stats().slot_waits,
                                            "path": al.stats().path,
                                            "host_wait_s": al.stats().wait_s,
                                            "execution": str(al.stats().execution)}))
            else:
                dl = DataLoader(ds, batch_size=B, sampler=order, num_workers=w, pin_memory=True,
                                drop_last=True, persistent_workers=False, timeout=120)
                state: dict = {}

                def dl_iter(dl: Any = dl, state: dict = state) -> Any:
                    state["it"] = iter(dl)
                    return state["it"]

                def dl_close(state: dict = state) -> None:
                    it = state.pop("it", None)
                    if it is not None and hasattr(it, "_shutdown_workers"):
                        it._shutdown_workers()
                results.append(run(name, dl_iter, True, dl_close,
                                   {"num_workers": w, "pin_memory": True}))
        except Exception as e:  # noqa: BLE001 - one config failing must not lose the others
            results.append({"name": name, "status": "error",
                            "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]})
            log(f"(d) {name}: ERROR {type(e).__name__}: {e}")
    if util is not None:
        util.close()
    ok = [r for r in results if "images_per_s" in r]
    af = next((r for r in ok if r["name"] == "asyncfeed"), None)
    dls = [r for r in ok if r["name"].startswith("DataLoader")]
    best = max(dls, key=lambda r: r["images_per_s"]) if dls else None
    verdict: dict[str, Any] = {}
    if af and best:
        verdict = {"best_dataloader": best["name"],
                   "speed_vs_best": af["images_per_s"] / best["images_per_s"],
                   "matches_best": af["images_per_s"] >= 0.98 * best["images_per_s"],
                   "fewer_cores": af["cores_busy"] < best["cores_busy"]}
    status = "error" if not ok else (
        "passed" if verdict.get("matches_best") and verdict.get("fewer_cores") else
        ("below target" if verdict else "incomplete"))
    return {"status": status, "batch": B, "image_size": args.image_size, "steps": steps,
            "warmup": warmup, "images": len(ds), "synthetic_gen_s": round(gen_s, 1),
            "torchvision": torchvision.__version__, "util_error": util_error,
            "results": results, "verdict": verdict,
            "seconds": round(time.monotonic() - t_start, 1)}


# ============================================================================ driver
def machine(cuda: bool) -> dict:
    try:
        from asyncfeed._bench.machine import machine_info
        info = machine_info()
    except Exception as e:  # noqa: BLE001
        info = {"error": f"{type(e).__name__}: {e}"}
    info["cores_usable"] = cores()
    with contextlib.suppress(OSError):
        import shutil
        shm = shutil.disk_usage("/dev/shm")  # DataLoader workers pass batches through it
        info["dev_shm_bytes"] = {"total": shm.total, "free": shm.free}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=p.total_memory,
                    gpu_sms=p.multi_processor_count, torch_cuda=torch.version.cuda)
        with contextlib.suppress(Exception):
            import pynvml
            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
    return info


def quick_defaults(args: argparse.Namespace, cuda: bool) -> None:
    """--quick: small sizes everywhere (a smoke test; on CPU it is what the tests run)."""
    q = {"correct_batches": 300 if cuda else 900, "correct_batch": 16 if cuda else 8,
         "correct_shape": "3,32,32" if cuda else "3,16,16", "correct_items": 2048,
         "correct_time": 30 if cuda else 15, "correct_min_batches": 60,
         "bw_batches": 40, "bw_reps": 20, "bw_time": 10, "ov_steps": 20, "ov_warmup": 4,
         "ov_step_ms": 10, "ov_dim": 4096, "ov_time": 16, "train_images": 1024, "train_steps": 8,
         "train_warmup": 3, "train_batch": 64, "train_workers": [4, 8], "train_time": 90}
    for k, v in q.items():
        if getattr(args, k) == PARSER_DEFAULTS[k]:
            setattr(args, k, v)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or "
                    "bench-results/gpu_check.json)")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--sections", default="a,b,c,d",
                    help="which sections: a=correctness b=bandwidth c=overlap d=training")
    ap.add_argument("--threads", type=int, default=0, help="AsyncLoader num_threads (0: cores)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("(a) correctness")
    g.add_argument("--correct-batches", type=int, default=4500)
    g.add_argument("--correct-batch", type=int, default=64)
    g.add_argument("--correct-shape", default="3,64,64")
    g.add_argument("--correct-items", type=int, default=8192)
    g.add_argument("--correct-prefetch", type=int, default=2)
    g.add_argument("--correct-time", type=float, default=75.0)
    g.add_argument("--correct-min-batches", type=int, default=1000)
    g.add_argument("--kernel-us", type=float, default=300.0,
                   help="random consumer kernels up to this long (µs)")
    g = ap.add_argument_group("(b) bandwidth")
    g.add_argument("--bw-batch", type=int, default=256)
    g.add_argument("--bw-batches", type=int, default=200)
    g.add_argument("--bw-reps", type=int, default=60)
    g.add_argument("--bw-time", type=float, default=25.0)
    g = ap.add_argument_group("(c) overlap")
    g.add_argument("--ov-batch", type=int, default=256)
    g.add_argument("--ov-steps", type=int, default=150)
    g.add_argument("--ov-warmup", type=int, default=10)
    g.add_argument("--ov-step-ms", type=float, default=25.0)
    g.add_argument("--ov-dim", type=int, default=8192)
    g.add_argument("--ov-prefetch", type=int, default=4)
    g.add_argument("--ov-time", type=float, default=40.0)
    g = ap.add_argument_group("(d) training")
    g.add_argument("--train-images", type=int, default=5000)
    g.add_argument("--train-batch", type=int, default=256)
    g.add_argument("--train-steps", type=int, default=50)
    g.add_argument("--train-warmup", type=int, default=10)
    g.add_argument("--train-workers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4, 8, 12, 16])
    g.add_argument("--train-time", type=float, default=200.0)
    g.add_argument("--data-root", default=None,
                   help="parent folder of the synthetic JPEG set (default $TMPDIR or /tmp)")
    return ap


PARSER_DEFAULTS = {a.dest: a.default for a in build_parser()._actions}


def summary_table(doc: dict) -> str:
    S = doc["sections"]
    rows: list[tuple[str, str, str]] = []

    def st(name: str) -> str:
        s = S.get(name, {})
        return s.get("status", "-") + (f" ({s['reason']})" if s.get("reason") else "")

    c = S.get("correctness", {})
    if "batches_checked" in c:
        caught = all(x["caught_every_unwritten_row"] for x in c["negative_control"])
        rows.append(("(a) correctness", st("correctness"),
                     f"{c['batches_checked']} batches / {c['samples_checked']} samples on "
                     f"{c['device']}, {c['bad_rows']} bad, {c['slot_waits']} slot waits, "
                     f"negative control {'caught' if caught else 'MISSED'}"))
    else:
        rows.append(("(a) correctness", st("correctness"), c.get("error", "")))
    b = S.get("bandwidth", {})
    rows.append(("(b) bandwidth", st("bandwidth"),
                 f"loader {b['loader_bytes_per_s_median'] / 1e9:.1f} GB/s vs plain "
                 f"{b['plain_bytes_per_s_median'] / 1e9:.1f} GB/s = {100 * b['ratio']:.0f}% "
                 f"(target >= {100 * TARGETS['bandwidth_ratio']:.0f}%)"
                 if b.get("ratio") else b.get("error", "")))
    o = S.get("overlap", {})
    rows.append(("(c) overlap", st("overlap"),
                 f"consumer waits {100 * o['wait_fraction']:.2f}% of step time "
                 f"(step {o['with_loader']['step_ms_median']:.1f} ms; target <= "
                 f"{100 * TARGETS['overlap_wait_fraction']:.0f}%)"
                 if o.get("wait_fraction") is not None else o.get("error", "")))
    t = S.get("training", {})
    v = t.get("verdict")
    rows.append(("(d) training", st("training"),
                 (f"asyncfeed {100 * v['speed_vs_best']:.0f}% of best DataLoader "
                  f"({v['best_dataloader']}), fewer cores: {v['fewer_cores']}")
                 if v else t.get("error", "")))
    w = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    lines = [f"{'section'.ljust(w)}  {'status'.ljust(w2)}  figures", "-" * (w + w2 + 40)]
    lines += [f"{a.ljust(w)}  {s.ljust(w2)}  {f}" for a, s, f in rows]
    tr = t.get("results") or []
    if any("images_per_s" in r for r in tr):
        lines += ["", f"{'ResNet-50 bf16, batch ' + str(t['batch']):<28} {'img/s':>8} "
                      f"{'GPU util %':>10} {'cores busy':>10}"]
        for r in tr:
            if "images_per_s" in r:
                gu = r.get("gpu_util_mean")
                lines.append(f"{r['name']:<28} {r['images_per_s']:>8.0f} "
                             f"{(f'{gu:.0f}' if gu is not None else '-'):>10} "
                             f"{r['cores_busy']:>10.1f}")
            else:
                why = r.get("reason") or r.get("error")
                lines.append(f"{r['name']:<28} {r.get('status')}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.quick:
        quick_defaults(args, cuda)
    if args.out is None:
        args.out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") \
            else os.path.join(REPO, "bench-results", "gpu_check.json")
    wanted = {SECTION_KEYS.get(s.strip(), s.strip()) for s in args.sections.split(",") if s.strip()}
    unknown = wanted - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; use a,b,c,d")
    t0 = time.monotonic()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    doc: dict[str, Any] = {"tool": "asyncfeed gpu_check", "version": 1,
                           "asyncfeed": asyncfeed.__version__, "cuda": cuda, "quick": args.quick,
                           "args": {k: v for k, v in vars(args).items()},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine(cuda), "targets": dict(TARGETS), "sections": {}}
    log(f"CUDA: {cuda}{' (' + doc['machine'].get('gpu', '?') + ')' if cuda else ''}, "
        f"{cores()} cores, torch {torch.__version__}, quick={args.quick}")

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, args.out)

    def guarded(name: str, fn: Callable[[], dict]) -> None:
        if name not in wanted:
            doc["sections"][name] = skipped("not selected (--sections)")
            return
        log(f"section {name} ...")
        try:
            doc["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the other sections still run
            doc["sections"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-4000:]}
            log(f"section {name}: ERROR {type(e).__name__}: {e}")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        save()

    guarded("correctness", lambda: section_correctness(args, cuda))
    if cuda:
        assert dev is not None
        guarded("bandwidth", lambda: section_bandwidth(args, dev))
        bw = doc["sections"].get("bandwidth", {})
        loader_ms = 1e3 / bw["loader_batches_per_s_host"] \
            if bw.get("loader_batches_per_s_host") and args.ov_batch == args.bw_batch else None
        guarded("overlap", lambda: section_overlap(args, dev, loader_ms))
        guarded("training", lambda: section_training(args, dev))
    else:
        for name in ("bandwidth", "overlap", "training"):
            doc["sections"][name] = skipped("no CUDA")
    statuses = {k: v.get("status") for k, v in doc["sections"].items()}
    doc["statuses"] = statuses
    # exit 1 only for a wrong result or a crash; a figure below its target is a finding
    doc["ok"] = not any(s in ("failed", "error") for s in statuses.values())
    save()
    print()
    print(summary_table(doc))
    print(f"\nJSON: {args.out}  ({doc['elapsed_s']} s)", flush=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
