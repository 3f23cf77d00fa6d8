"""Reused host batch buffers: reused only when nobody holds any part of a batch."""

from __future__ import annotations

import collections
import gc
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import asyncfeed
from asyncfeed import AsyncLoader
from asyncfeed._memory.hostpool import HostBufferPool, reuse_supported
from asyncfeed._memory.layout import Layout
from support.oracle import MixedFixed, TupleFixed, assert_same, gen

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not reuse_supported(), reason="this torch hides use counts")]


def layout_of(sample):
    layout = Layout.infer(sample)
    assert layout is not None
    return layout


def test_pool_reuses_a_dropped_batch_and_never_a_held_one():
    layout = layout_of((torch.zeros(3, 4, dtype=torch.uint8), 7, "name"))
    pool = HostBufferPool(capacity=2)
    a = pool.take(layout, 5)
    ptr = a[0].data_ptr()
    b = pool.take(layout, 5)                      # a is held: a second set
    b_ptr = b[0].data_ptr()
    assert b_ptr != ptr
    del a
    c = pool.take(layout, 5)                      # a was dropped: its memory comes back
    assert c[0].data_ptr() == ptr and pool.reused == 1
    assert c[2] == [None] * 5, "list leaves must be fresh lists"
    view = c[0][1]                                # a view of one row keeps the whole set busy
    arr = b[1].numpy()                            # so does a NumPy array of a leaf
    del c, b
    d = pool.take(layout, 5)                      # capacity 2, both busy: a fresh one
    assert d[0].data_ptr() not in (ptr, b_ptr) and pool.allocated == 3
    del view, arr, d
    e = pool.take(layout, 5)                      # both kept sets are free again
    assert pool.reused == 2 and e[0].data_ptr() in (ptr, b_ptr)


def test_pool_keeps_at_most_capacity_and_resets_on_a_new_layout():
    layout = layout_of((torch.zeros(2),))
    pool = HostBufferPool(capacity=1)
    held = [pool.take(layout, 4) for _ in range(3)]   # the last two are not kept
    assert pool.allocated == 3 and len(pool._kept) == 1
    del held
    pool.take(layout, 4)
    assert pool.reused == 1
    other = layout_of((torch.zeros(5),))
    bufs = pool.take(other, 4)
    assert tuple(bufs[0].shape) == (4, 5) and pool.allocated == 4
    pool.clear()
    assert pool._kept == []


def test_pool_zero_capacity_always_allocates():
    layout = layout_of((torch.zeros(2),))
    pool = HostBufferPool(capacity=0)
    for _ in range(3):
        pool.take(layout, 2)
    assert (pool.allocated, pool.reused) == (3, 0)


def test_loader_reuses_buffers_and_matches_dataloader():
    ds = TupleFixed(n=300)
    want = DataLoader(ds, batch_size=16, shuffle=True, generator=gen())
    with AsyncLoader(ds, batch_size=16, shuffle=True, generator=gen(), num_threads=3) as al:
        pool = al._host_pool
        for epoch in range(2):
            allocated = pool.allocated
            for got, ref in zip(al, want, strict=True):
                assert_same(got, ref)
            assert pool.allocated - allocated <= pool.capacity + 2, "reuse within a pass"
            assert pool._kept == [], "a pass's batch memory goes with the pass"
        assert pool.reused > 0, "buffers of dropped batches were never reused"


def test_pool_is_emptied_when_a_pass_is_cut_short():
    with AsyncLoader(TupleFixed(n=300), batch_size=16, num_threads=2) as al:
        for k, _ in enumerate(al):
            if k == 5:
                break
        for _ in range(100):          # the dropped iterator's finalizer empties it
            if not al._host_pool._kept:
                break
            gc.collect()
        assert al._host_pool._kept == []


class RingMixed(MixedFixed):
    """MixedFixed without its NumPy scalar leaf, so batches go through the buffers."""

    def __getitem__(self, i: int):
        sample = super().__getitem__(i)
        del sample["np_u8"]
        return sample


@pytest.mark.parametrize("num_threads", [1, 4])
def test_held_batches_views_and_arrays_are_never_overwritten(num_threads):
    """Whatever part of a batch the user keeps stays as it was, epochs later."""
    ds = RingMixed(n=90)
    want = [list(DataLoader(ds, batch_size=4, shuffle=True, generator=gen(e)))
            for e in range(3)]
    kept = []
    for e in range(3):
        with AsyncLoader(ds, batch_size=4, shuffle=True, generator=gen(e),
                         num_threads=num_threads, prefetch=2) as al:
            for k, batch in enumerate(al):
                if k % 5 == 0:
                    kept.append((e, k, "batch", batch))
                elif k % 5 == 1:
                    kept.append((e, k, "row", batch["img"][1]))
                elif k % 5 == 2:
                    kept.append((e, k, "numpy", batch["f32"].numpy()))
                del batch
            assert al.stats().path == "ring"
            assert al._host_pool.reused > 0
    for e, k, what, x in kept:
        ref = want[e][k]
        if what == "batch":
            assert_same(x, ref)
        elif what == "row":
            assert torch.equal(x, ref["img"][1])
        else:
            assert np.array_equal(x, ref["f32"].numpy())


def test_pinned_host_batches_are_not_reused():
    """A user's own non_blocking copy may still read a dropped pinned batch: the loader
    leaves pinned buffers to torch's caching host allocator instead of reusing them."""
    import contextlib
    warns = (contextlib.nullcontext() if torch.cuda.is_available()
             else pytest.warns(UserWarning, match="pin_memory"))
    with warns:
        al = AsyncLoader(TupleFixed(n=64), batch_size=8, pin_memory=True)
    with al:
        pinned = al.pin_memory and al.device is None
        for _ in al:
            pass
        if pinned:
            assert al._host_pool.capacity == 0 and al._host_pool.reused == 0
        else:  # no CUDA here: pin_memory resolves to False and buffers are reused
            assert al._host_pool.reused > 0


def test_trim_keeps_buffers_in_use_and_the_free_ones_asked_for():
    layout = layout_of((torch.zeros(2),))
    pool = HostBufferPool(capacity=4)
    sets = [pool.take(layout, 3) for _ in range(4)]
    held = sets[0]
    del sets
    pool.trim(1)                      # one in use, three free: keep one of them
    assert len(pool._kept) == 2
    pool.trim(0)
    assert len(pool._kept) == 1
    assert pool.take(layout, 3)[0].data_ptr() != held[0].data_ptr()
    del held


def test_lent_views_write_the_lent_buffers_and_keep_the_set_busy():
    layout = layout_of((np.zeros((2, 3), np.int16), 1))
    pool = HostBufferPool(capacity=2)
    bufs, views = pool.take_views(layout, 4)
    views[0][1] = 7                               # written through the kept NumPy view
    views[1][:] = [5, 6, 7, 8]
    assert int(bufs[0][1].sum()) == 42 and bufs[1].tolist() == [5, 6, 7, 8]
    ptr = bufs[0].data_ptr()
    del views                                     # the lent buffers keep it busy
    other, _ = pool.take_views(layout, 4)
    assert other[0].data_ptr() != ptr
    del bufs, other
    again, _ = pool.take_views(layout, 4)         # both free: a kept set again
    assert pool.reused == 1 and pool.allocated == 2
    assert again[0].data_ptr() in (ptr, pool._kept[1].tensors[0].data_ptr())


def test_a_batch_reshaped_in_place_leaves_later_batches_as_they_were():
    ds = TupleFixed(n=16 * 12)
    want = DataLoader(ds, batch_size=16)
    with AsyncLoader(ds, batch_size=16, num_threads=1) as al:
        for got, ref in zip(al, want, strict=True):
            assert_same(got, ref)
            got[0].unsqueeze_(0)                  # the user's own tensor: its metadata only
            got[1].t_()
        assert al._host_pool.reused > 0           # later batches had the same memory


@pytest.fixture
def gc_off():
    """The garbage collector off: only plain reference counting frees batches."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


_PKG = os.path.dirname(asyncfeed.__file__)


def _ours(o: object) -> bool:
    """Whether cyclic garbage ``o`` is the data path's: a tensor or array (a row, a
    buffer), an asyncfeed object or function, or a frame of asyncfeed's code.  Other
    threads' garbage (an earlier test's fsspec/botocore loop thread still winding down
    while the collector is off) is not this test's business."""
    if isinstance(o, (torch.Tensor, np.ndarray)):
        return True
    if type(o).__name__ == "frame":
        return o.f_code.co_filename.startswith(_PKG)  # type: ignore[attr-defined]
    module = getattr(o, "__module__", None) if callable(o) else type(o).__module__
    return isinstance(module, str) and module.startswith("asyncfeed")


def assert_no_cyclic_garbage() -> None:
    """Fail, naming what it found, if only the garbage collector could free something
    of the data path's (see ``_ours``)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        total = gc.collect()
        ours = [o for o in gc.garbage if _ours(o)]
        kinds = collections.Counter(type(o).__qualname__ for o in ours).most_common(10)
        frames = [o.f_code.co_name for o in ours if type(o).__name__ == "frame"][:10]
        n = len(ours)
        del ours
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert n == 0, (f"{n} of the data path's objects (of {total} in all) were only freed by "
                    f"the garbage collector: {kinds}, frames {frames}")


def test_layout_walks_leave_no_cyclic_garbage(gc_off):
    """A reference cycle per sample would keep its row alive until the collector ran."""
    sample = {"img": torch.zeros(3, 4, dtype=torch.uint8), "meta": (1, 2.5, "x"),
              "pair": [np.zeros(2, np.float32), True]}
    layout = layout_of(sample)
    bufs = layout.allocate(2)
    for row in range(2):
        layout.write_row(bufs, row, sample, layout.numpy_views(bufs))
    layout.unflatten(layout.flatten(sample))
    layout.row_sample(bufs, 1)
    Layout.infer(sample)
    assert_no_cyclic_garbage()


@pytest.mark.parametrize("source", ["tuples", "dicts", "jpegs"])
def test_dropped_batches_come_back_without_the_garbage_collector(gc_off, source, tmp_path):
    """A consumer that drops each batch needs no more than the pool keeps, even with
    the collector off: nothing in the data path holds a row in a reference cycle."""
    if source == "jpegs":
        from asyncfeed import ImageFolder
        from support.imagegen import write
        for i in range(96):
            write("baseline", tmp_path / f"c{i % 3}" / f"{i}.jpg", h=40, w=48, seed=i)
        ds = ImageFolder(tmp_path, size=32)
        assert ds.decode_into  # the rows are written in place
    else:
        ds = TupleFixed(n=96) if source == "tuples" else RingMixed(n=96)
    with AsyncLoader(ds, batch_size=4, shuffle=True, seed=1, num_threads=3, prefetch=2) as al:
        pool = al._host_pool
        batches = 0
        for _ in al:
            batches += 1
        assert batches == 24
        assert pool.reused > 0
        # a decode thread that finished rows of a batch still holds it in its frame
        # until its task returns: on a loaded machine the consumer can drop that
        # batch first, and one more set is taken meanwhile (at most one a thread).
        # Rows held until a garbage collection would take a set for every batch.
        assert pool.allocated <= pool.capacity + 3, (
            f"{pool.allocated} buffer sets for {batches} dropped batches: something "
            f"holds the rows until a garbage collection")


@pytest.mark.parametrize("io", ["thread", "async"])
def test_a_whole_pass_leaves_no_cyclic_garbage(gc_off, io, tmp_path):
    """Batches, the pass's pipeline and its threads all go by reference counting:
    nothing waits for the garbage collector to release memory."""
    from asyncfeed import ImageFolder
    from support.imagegen import write
    for i in range(24):
        write("baseline", tmp_path / f"c{i % 2}" / f"{i}.jpg", h=40, w=48, seed=i)
    ds = ImageFolder(tmp_path, size=32, io=io)
    al = AsyncLoader(ds, batch_size=4, num_threads=2)
    assert sum(len(y) for _, y in al) == 24
    al.close()
    del al
    assert_no_cyclic_garbage()


@pytest.mark.parametrize("in_order", [True, False])
def test_skipped_samples_do_not_pin_their_batches(gc_off, in_order, tmp_path):
    """A failed sample's exception (its traceback holds the frames that had the batch)
    must not keep the batch's buffers once the failure is recorded."""
    from asyncfeed import ImageFolder
    from support.imagegen import write
    for i in range(96):
        kind = "truncated" if i % 8 == 3 else "baseline"
        write(kind, tmp_path / f"c{i % 3}" / f"{i:02d}.jpg", h=40, w=48, seed=i)
    ds = ImageFolder(tmp_path, size=32)
    with AsyncLoader(ds, batch_size=4, num_threads=3, prefetch=2, on_error="skip",
                     in_order=in_order) as al:
        pool = al._host_pool
        assert sum(len(y) for _, y in al) == 96 - 12
        assert len(al.stats().skipped) == 12
        assert pool.allocated <= pool.capacity, (
            f"{pool.allocated} buffer sets: failed samples kept their batches alive")
    assert_no_cyclic_garbage()
