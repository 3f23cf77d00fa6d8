"""The CUDA path's logic, as far as a machine without CUDA can check it.

``_slots.SlotRing`` is driven with duck-typed events (``query``/``synchronize``);
``_device.CopyStream``'s bookkeeping runs against stand-ins for torch.cuda's
stream and event; and whole loaders are driven through their CUDA path (slot
ring, copy, hand-over) with a copy "stream" that copies in a thread of its own
after a delay and completes its event only then.  The real GPU run is
``bench/gpu_check.py`` (docs/gpu.md).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time

import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._memory import device as _device
from asyncfeed._memory.device import CopyStream, map_tensors, resolve_device, resolve_pin
from asyncfeed._memory.layout import Layout
from asyncfeed._memory.slots import SlotRing, fill_poison, poison_from_env

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


# ------------------------------------------------------------------ test doubles
class FakeEvent:
    """query()/synchronize() like torch.cuda.Event; completes when ``complete()`` is called."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()
        self.synchronized = 0

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        assert self._done.wait(10), "the event never completed"


def layout() -> Layout:
    lay = Layout.infer((torch.zeros(3, 4, dtype=torch.uint8), 0, torch.zeros(2), "name"))
    assert lay is not None
    return lay


@pytest.fixture
def no_poison():
    saved = SlotRing.poison
    SlotRing.poison = None
    yield
    SlotRing.poison = saved


# ----------------------------------------------------------------- resolve_device
def test_resolve_device_cpu_and_none():
    assert resolve_device(None) is None
    assert resolve_device("cpu") is None
    assert resolve_device(torch.device("cpu")) is None


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_resolve_device_rejects_other_types(device):
    with pytest.raises(ValueError, match="device must be None, 'cpu' or a CUDA device"):
        resolve_device(device)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 3)])
def test_resolve_device_without_cuda_says_so(device):
    with pytest.raises(ValueError) as e:
        resolve_device(device)
    msg = str(e.value)
    assert "CUDA is not available" in msg and "device=None" in msg and repr(device) in msg


@no_cuda
def test_loader_with_cuda_device_fails_at_construction_not_at_iteration():
    with pytest.raises(ValueError, match="CUDA is not available"):
        AsyncLoader(list(range(4)), batch_size=2, device="cuda")


# -------------------------------------------------------------------- resolve_pin
def test_resolve_pin_defaults_follow_the_device():
    assert resolve_pin(None, None) is False
    assert resolve_pin(None, torch.device("cuda", 0)) is True
    assert resolve_pin(False, torch.device("cuda", 0)) is False


@no_cuda
def test_pin_memory_without_cuda_warns_and_falls_back():
    with pytest.warns(UserWarning, match="pin_memory"):
        assert resolve_pin(True, None) is False


@no_cuda
def test_pin_without_an_accelerator_raises_clearly():
    """``pin`` is only called when pinning was resolved on; called anyway, it says why."""
    with pytest.raises(RuntimeError, match="accelerator|CUDA"):
        _device.pin(torch.zeros(2))


def test_pin_keeps_structure_and_already_pinned_tensors(monkeypatch):
    pinned: list[torch.Tensor] = []

    class T(torch.Tensor):
        pass

    def fake_pin_memory(self):
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.numel() == 1)
    a, b = torch.zeros(3), torch.zeros(1)
    out = _device.pin({"a": a, "rest": (b, "s", 3)})
    assert out["a"] is not a and out["rest"][0] is b and out["rest"][1:] == ("s", 3)
    assert len(pinned) == 1 and pinned[0] is a


# -------------------------------------------------------------------- map_tensors
def test_map_tensors_keeps_container_types():
    Point = collections.namedtuple("Point", "x y")

    class D(dict):
        pass

    t = torch.ones(2)
    obj = {"p": Point(t, [t, (t, "s", b"b", 1)]), "d": D(k=t)}
    out = map_tensors(obj, lambda x: x * 2)
    assert isinstance(out["p"], Point) and isinstance(out["d"], D)
    assert out["p"].y[1][1:] == ("s", b"b", 1)
    assert torch.equal(out["p"].x, torch.full((2,), 2.0))
    assert torch.equal(out["d"]["k"], torch.full((2,), 2.0))


# ---------------------------------------------------------------------- SlotRing
def test_ring_is_unpinned_without_cuda_and_pinned_with_it():
    ring = SlotRing(layout(), rows=4, count=2)
    assert ring.pin == torch.cuda.is_available()
    slot = ring.acquire()
    assert slot.bufs[0].shape == (4, 3, 4) and slot.bufs[0].is_pinned() == ring.pin
    assert slot.bufs[1].dtype == torch.int64 and slot.bufs[3] == [None] * 4


def test_ring_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        SlotRing(layout(), rows=4, count=0)


def test_ring_hands_out_distinct_slots_up_to_count(no_poison):
    ring = SlotRing(layout(), rows=2, count=3, pin=False)
    slots = [ring.acquire() for _ in range(3)]
    assert len({id(s) for s in slots}) == 3
    assert len({s.bufs[0].data_ptr() for s in slots}) == 3
    assert ring.free_slots() == 0 and ring.made == 3 and ring.waits == 0
    for s in slots:
        ring.release(s)
    assert ring.free_slots() == 3
    again = [ring.acquire() for _ in range(3)]
    assert {id(s) for s in again} == {id(s) for s in slots}, "no new memory in steady state"
    assert ring.made == 3


def test_ring_runs_dry_only_when_slots_were_lost(no_poison):
    """A pass cut short never gives its slots back; the ring then makes new ones
    instead of failing (the lost ones are freed with their batches)."""
    ring = SlotRing(layout(), rows=2, count=2, pin=False)
    lost = [ring.acquire(), ring.acquire()]
    fresh = ring.acquire()
    assert ring.made == 3 and all(fresh is not s for s in lost)


def test_slot_with_running_copy_is_not_handed_out_while_a_finished_one_is_free(no_poison):
    ring = SlotRing(layout(), rows=2, count=2, pin=False)
    a, b = ring.acquire(), ring.acquire()
    a.event = FakeEvent()            # copy still running
    ring.release(a)
    b.event = FakeEvent(done=True)   # copy finished
    ring.release(b)
    got = ring.acquire()
    assert got is b and ring.waits == 0
    assert a.event.synchronized == 0 and got.event is None


def test_finished_slots_are_handed_out_oldest_first(no_poison):
    ring = SlotRing(layout(), rows=2, count=3, pin=False)
    s = [ring.acquire() for _ in range(3)]
    for x in s:
        x.event = FakeEvent(done=True)
        ring.release(x)
    assert [ring.acquire() for _ in range(3)] == s


def test_acquire_waits_for_the_copy_when_every_free_slot_is_busy(no_poison):
    ring = SlotRing(layout(), rows=2, count=1, pin=False)
    slot = ring.acquire()
    ev = FakeEvent()
    slot.event = ev
    ring.release(slot)
    timer = threading.Timer(0.2, ev.complete)
    timer.start()
    t0 = time.monotonic()
    got = ring.acquire()
    waited = time.monotonic() - t0
    timer.join()
    assert got is slot and ev.query(), "handed out before its copy finished"
    assert waited >= 0.15 and ring.waits == 1 and ev.synchronized == 1


def test_slot_is_not_reused_while_its_batch_is_held(no_poison):
    """Until a slot is released it is never handed out again, however many acquires."""
    ring = SlotRing(layout(), rows=2, count=2, pin=False)
    held = ring.acquire()
    held.bufs[0].fill_(7)
    for _ in range(5):
        other = ring.acquire()
        assert other is not held
        other.bufs[0].fill_(1)
        ring.release(other)
    assert bool((held.bufs[0] == 7).all())


def test_double_release_raises(no_poison):
    ring = SlotRing(layout(), rows=2, count=2, pin=False)
    slot = ring.acquire()
    ring.release(slot)
    with pytest.raises(RuntimeError, match="released twice"):
        ring.release(slot)


def test_slot_of_another_ring_is_dropped_not_mixed_in(no_poison):
    old = SlotRing(layout(), rows=2, count=1, pin=False)
    new = SlotRing(layout(), rows=8, count=1, pin=False)
    small = old.acquire()
    new.release(small)
    assert new.dropped == 1 and new.free_slots() == 1
    assert new.acquire().bufs[0].shape[0] == 8


def test_fits():
    lay = layout()
    ring = SlotRing(lay, rows=4, count=1, pin=False)
    assert ring.fits(lay, 4) and ring.fits(lay, 1)
    assert not ring.fits(lay, 5) and not ring.fits(layout(), 4)


# ------------------------------------------------------------------------ poison
def test_poison_from_env():
    assert poison_from_env("") is None and poison_from_env("0") is None
    assert poison_from_env("off") is None
    assert poison_from_env("1") == 0xA5 and poison_from_env("yes") == 0xA5
    assert poison_from_env("0x5a") == 0x5A and poison_from_env("255") == 255
    with pytest.raises(ValueError):
        poison_from_env("256")
    with pytest.raises(ValueError):
        poison_from_env("lots")


def test_fill_poison_covers_every_byte_of_every_leaf():
    bufs = [torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, 2, dtype=torch.float32), torch.zeros(2, dtype=torch.bool), ["a", "b"]]
    fill_poison(bufs, 0xA5)
    assert bool((bufs[0] == 0xA5).all())
    assert bufs[1].tolist() == [int.from_bytes(b"\xa5" * 8, "little", signed=True)] * 2
    assert bool((bufs[2].view(torch.uint8) == 0xA5).all())
    assert bufs[3].tolist() == [True, True]
    assert bufs[4] == [None, None]


def test_acquire_poisons_a_reused_slot_after_its_copy():
    saved = SlotRing.poison
    SlotRing.poison = 0x5A
    try:
        ring = SlotRing(layout(), rows=2, count=1, pin=False)
        slot = ring.acquire()
        assert bool((slot.bufs[0] == 0x5A).all()), "a fresh slot is poisoned too"
        slot.bufs[0].fill_(3)
        ev = FakeEvent()
        slot.event = ev
        ring.release(slot)
        threading.Timer(0.05, ev.complete).start()
        again = ring.acquire()
        assert ev.query(), "poisoned before its copy had finished"
        assert again is slot and bool((slot.bufs[0] == 0x5A).all())
    finally:
        SlotRing.poison = saved


def test_poison_is_off_by_default():
    import os
    if os.environ.get("ASYNCFEED_DEBUG_POISON"):
        pytest.skip("poison asked for in this environment")
    assert SlotRing.poison is None


# ------------------------------------------------------------------- CopyStream
class FakeCudaEvent:
    log: list = []

    def __init__(self, enable_timing: bool = False, **kw) -> None:
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        FakeCudaEvent.log.append(("record", self, stream))


class FakeStream:
    def __init__(self, device=None) -> None:
        self.device = device
        self.waited: list = []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream/event API replaced by recorders (tensors stay on the CPU)."""
    FakeCudaEvent.log = []
    current = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current)
    copies: list = []
    real_to, real_copy, real_empty_like = torch.Tensor.to, torch.Tensor.copy_, torch.empty_like

    def to(self, *a, **kw):
        copies.append((self, kw.get("non_blocking")))
        FakeCudaEvent.log.append(("copy", self.nbytes, None))
        return real_to(self, *a, **kw).clone()

    def copy_(self, src, non_blocking=False):
        copies.append((src, non_blocking))
        FakeCudaEvent.log.append(("copy", src.nbytes, None))
        return real_copy(self, src)

    def empty_like(t, **kw):
        FakeCudaEvent.log.append(("alloc", t.nbytes, None))
        return real_empty_like(t, **kw)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    return {"current": current, "copies": copies}


def test_copy_stream_copies_every_tensor_non_blocking_then_records(fake_cuda):
    cs = CopyStream(torch.device("cpu"))
    batch = (torch.zeros(4, 3, dtype=torch.uint8), torch.arange(4), ["a", "b", "c", "d"])
    out, ev = cs.to_device(batch)
    assert isinstance(out, tuple) and out[2] == batch[2]
    assert [nb for _, nb in fake_cuda["copies"]] == [True, True]
    kinds = [k for k, *_ in FakeCudaEvent.log]
    # bracketed by timing events for the stage accounting (stats().stages["h2d"])
    assert kinds == ["record", "copy", "copy", "record"], \
        "the event must follow the batch's copies"
    assert FakeCudaEvent.log[-1][1] is ev and FakeCudaEvent.log[-1][2] is cs.stream
    assert ev.enable_timing and len(cs.timings) == 0


def test_copy_stream_timing_brackets_only_the_copies(fake_cuda):
    cs = CopyStream(torch.device("cpu"), timing=True)
    batch = (torch.full((4, 3), 7, dtype=torch.uint8), torch.arange(4))
    out, ev = cs.to_device(batch)
    kinds = [k for k, *_ in FakeCudaEvent.log]
    assert kinds == ["alloc", "alloc", "record", "copy", "copy", "record"], \
        "device memory is allocated before the start event, copies inside the bracket"
    assert all(nb for _, nb in fake_cuda["copies"])
    (start, end, nbytes), = cs.timings
    assert end is ev and start.enable_timing and end.enable_timing
    assert nbytes == 12 + 4 * 8
    assert torch.equal(out[0], batch[0]) and torch.equal(out[1], batch[1])


def test_copy_stream_keeps_each_batch_contiguous_across_threads(fake_cuda):
    """Copies and event of one batch are enqueued together, whatever the threads do."""
    cs = CopyStream(torch.device("cpu"), timing=True)
    barrier = threading.Barrier(4)

    def work(k):
        barrier.wait()
        for _ in range(20):
            cs.to_device((torch.full((8,), k, dtype=torch.uint8), torch.zeros(k + 1)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kinds = [k for k, *_ in FakeCudaEvent.log]
    assert kinds == ["alloc", "alloc", "record", "copy", "copy", "record"] * 80
    assert len(cs.timings) == 80


def test_hand_over_waits_on_the_consumer_stream(fake_cuda):
    cs = CopyStream(torch.device("cpu"))
    out, ev = cs.to_device((torch.zeros(2),))
    cs.hand_over(out, ev)  # CPU tensors: no record_stream (it would fail)
    assert fake_cuda["current"].waited == [ev]


# --------------------------------------- whole loaders through the CUDA path, on the CPU
class DelayedCopy:
    """A copy "stream": a thread copies each batch after ``delay`` s, then completes
    its event.  A slot refilled before its event completed corrupts the copy."""

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="test-delayed-copy")
        self.thread.start()

    def to_device(self, host):
        pairs = []

        def alloc(t):
            d = torch.empty_like(t)
            pairs.append((t, d))
            return d
        out = map_tensors(host, alloc)
        ev = FakeEvent()
        self.q.put((pairs, ev))
        return out, ev

    def pin(self, host):
        return host  # no CUDA: "pinned" is plain memory here

    def hand_over(self, out, ev):
        ev.synchronize()

    def _run(self):
        while (item := self.q.get()) is not None:
            pairs, ev = item
            time.sleep(self.delay)
            for s, d in pairs:
                d.copy_(s)
            ev.complete()

    def close(self):
        self.q.put(None)
        self.thread.join()


class Rows:
    """Sample i: (uint8 image filled with i % 251, i); decode_into writes in place."""

    def __init__(self, n: int = 400) -> None:
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((2, 5), i % 251, dtype=torch.uint8), i

    def read(self, i):
        return i

    def decode(self, raw, i):
        return self[i]

    def decode_into(self, raw, i, out):
        out.fill_(i % 251)
        return out, i


@contextlib.contextmanager
def through_cuda_path(*args, delay: float = 0.002, **kw):
    """An AsyncLoader(*args, **kw) whose CUDA path (slot ring, copy, hand-over) runs
    through a DelayedCopy given as its copy stream."""
    copy = DelayedCopy(delay)
    loader = AsyncLoader(*args, copy_stream=copy, **kw)
    try:
        yield loader
    finally:
        loader.close()
        copy.close()


def check(batch, indices):
    img, idx = batch
    assert idx.tolist() == list(indices)
    for row, i in enumerate(indices):
        assert bool((img[row] == i % 251).all()), f"row {row} (sample {i}) is wrong"


@pytest.mark.parametrize("prefetch", [1, 2])
def test_loader_ring_waits_for_copies_before_refilling(prefetch):
    saved = SlotRing.poison
    SlotRing.poison = 0xA5
    try:
        with through_cuda_path(Rows(), batch_size=8, prefetch=prefetch,
                               num_threads=2) as al:
            got = list(al)
            assert al._ring is not None and al._ring.count == prefetch
            waits = al.stats().slot_waits
        assert len(got) == 50
        for k, b in enumerate(got):
            check(b, range(8 * k, 8 * k + 8))
        assert waits > 0, "the copies were never slow enough to test the wait"
    finally:
        SlotRing.poison = saved


def test_loader_ring_survives_a_pass_cut_short():
    """Regression: slots of batches in flight when a pass was cut short were never
    returned, and the next pass failed with 'pop from empty list'."""
    with through_cuda_path(Rows(), batch_size=4, prefetch=2, num_threads=2) as al:
        for _ in range(3):
            for k, b in enumerate(al):
                check(b, range(4 * k, 4 * k + 4))
                if k == 5:
                    break
        got = list(al)
    assert len(got) == 100
    check(got[-1], range(396, 400))


def test_loader_ring_rebuilt_for_a_larger_batch_keeps_old_slots_out():
    """Regression: after a larger batch made the loader build a new ring, slots of
    the old (smaller) ring were released into the new one and later overflowed."""
    sizes = [2, 2, 3, 3, 3, 3, 6, 6, 6, 6, 6, 6, 6, 6, 2, 6, 6]
    plan, s = [], 0
    for n in sizes:
        plan.append(list(range(s, s + n)))
        s += n
    with through_cuda_path(Rows(), batch_sampler=plan, prefetch=2, num_threads=2) as al:
        got = list(al)
        ring = al._ring
    assert len(got) == len(plan)
    for b, idx in zip(got, plan):
        check(b, idx)
    assert ring.rows == 6 and ring.dropped >= 1
