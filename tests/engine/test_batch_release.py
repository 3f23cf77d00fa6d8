"""When the batches a user lets go of are freed (see ``_Iterator._retire``).

Freeing a tensor lets go of the GIL.  Where a decode thread runs Python at that
moment, the consumer waits for the GIL back a switch interval or more per
tensor; so the loader keeps the last outputs it handed out and frees the one
from two ``next()`` calls ago while the thread that readied the new batch waits
for the hand-over.  These tests check where and when that happens, and that
nothing is kept past the pass.
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch

from asyncfeed import AsyncLoader
from support.datasets import Spin


def _watch(batch: object, log: list, it: object) -> None:
    """Record, when ``batch``'s image tensor is freed, on which thread and whether the
    thread that readied the batch being taken was still waiting for the hand-over."""
    p = it._p  # type: ignore[attr-defined]

    def freed() -> None:
        log.append((threading.current_thread() is threading.main_thread(),
                    p._taken_hand is not None))
    weakref.finalize(batch[0], freed)  # type: ignore[index]


def test_a_dropped_batch_is_freed_while_the_readying_thread_waits() -> None:
    ds = Spin(8 * 12, 1000)  # rows holding the GIL: the consumer always waits
    loader = AsyncLoader(ds, batch_size=8, num_threads=1)
    log: list[tuple[bool, bool]] = []
    it = iter(loader)
    for batch in it:  # the user's loop: the last batch is held while next() runs
        _watch(batch, log, it)
    del batch
    loader.close()
    gc.collect()
    assert len(log) == 12  # every batch freed, none kept past the pass
    in_hand = [on_main and waiting for on_main, waiting in log[:-2]]
    # freed by the consumer, inside next(), before the decode thread went on; a
    # machine that descheduled the consumer past HAND_S (2 ms) misses a few
    assert sum(in_hand) >= len(in_hand) // 2, log


def test_the_loader_keeps_only_the_last_two_outputs() -> None:
    loader = AsyncLoader(Spin(8 * 6, 0), batch_size=8, num_threads=1)
    refs: list[weakref.ref] = []
    it = iter(loader)
    for _ in range(4):
        refs.append(weakref.ref(next(it)[0]))  # dropped by the user at once
    gc.collect()
    assert [r() is None for r in refs] == [True, True, False, False]
    it.close()
    gc.collect()
    assert all(r() is None for r in refs)  # closing the pass lets go of them
    loader.close()


def test_a_pass_that_ends_or_breaks_keeps_no_output() -> None:
    loader = AsyncLoader(Spin(8 * 5, 0), batch_size=8, num_threads=1)
    refs = [weakref.ref(b[0]) for b in loader]  # an epoch to its end
    gc.collect()
    assert all(r() is None for r in refs)
    refs = []
    for b in loader:  # a break: the iterator is dropped with the loop
        refs.append(weakref.ref(b[0]))
        if len(refs) == 3:
            break
    del b
    gc.collect()
    assert all(r() is None for r in refs)
    loader.close()


def test_a_held_batch_is_not_overwritten() -> None:
    ds = Spin(8 * 10, 0)
    with AsyncLoader(ds, batch_size=8, num_threads=1) as loader:
        kept = [(b[0], b[0].clone()) for b in loader]
    for got, copy in kept:
        assert torch.equal(got, copy)
