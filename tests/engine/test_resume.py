"""Exact resume, determinism and rank sharding (the index plan's guarantees)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from asyncfeed import AsyncLoader, StateError
from asyncfeed._engine.plan import distributed_indices
from support.datasets import Ids, ids, make
from support.executions import EXECUTIONS, on


CASES = [
    dict(shuffle=True, seed=5),
    dict(shuffle=True, generator=7),
    dict(shuffle=True),                       # global RNG, as DataLoader
    dict(shuffle=False, drop_last=True),
    dict(shuffle=True, seed=1, on_error="skip", bad=(3, 50, 51, 90)),
    dict(shuffle=True, seed=2, in_order=False),
]


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("stop,execution", [(0, "threads"), (1, "threads"), (5, "threads"),
                                            (11, "threads")]
                         + [(5, e) for e in EXECUTIONS if e != "threads"], indirect=["execution"])
def test_resume_is_exact(kw, stop, execution):
    kw = {**kw, **on(execution)}
    torch.manual_seed(0)
    with make(kw) as whole:
        full = [ids(b) for b in whole]
    torch.manual_seed(0)
    loader = make(kw, prefetch=3)
    it = iter(loader)
    got = [ids(next(it)) for _ in range(stop)]
    state = json.loads(json.dumps(loader.state_dict()))   # plain: survives JSON
    loader.close()
    torch.manual_seed(999)                                # a different process state
    resumed = make(kw, num_threads=1, prefetch=1)
    resumed.load_state_dict(state)
    got += [ids(b) for b in resumed]
    resumed.close()
    if kw.get("in_order") is False:
        assert sorted(map(tuple, got)) == sorted(map(tuple, full))
    else:
        assert got == full


def test_state_is_small_plain_and_torch_saveable(tmp_path):
    loader = make(dict(shuffle=True, seed=3))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert len(json.dumps(state)) < 2000
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt") == state
    loader.close()


def test_resume_in_a_new_process(tmp_path):
    loader = make(dict(shuffle=True, seed=11))
    it = iter(loader)
    first = [ids(next(it)) for _ in range(4)]
    (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
    loader.close()
    code = f"""
import json, sys, torch
sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
from support.datasets import make, ids
l = make(dict(shuffle=True, seed=11))
l.load_state_dict(json.load(open({str(tmp_path / 'state.json')!r})))
print(json.dumps([ids(b) for b in l]))
l.close()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    rest = json.loads(out.stdout.strip().splitlines()[-1])
    assert first + rest == [ids(b) for b in make(dict(shuffle=True, seed=11))]


def test_foreign_state_is_refused():
    state = make(dict(shuffle=True, seed=1)).state_dict()
    with pytest.raises(StateError, match="97"):
        AsyncLoader(Ids(50), batch_size=8).load_state_dict(state)
    with pytest.raises(StateError, match="batch_size"):
        AsyncLoader(Ids(97), batch_size=4).load_state_dict(state)
    with pytest.raises(StateError, match="version"):
        AsyncLoader(Ids(97), batch_size=8).load_state_dict({**state, "version": 99})
    with pytest.raises(StateError):
        AsyncLoader(Ids(97), batch_size=8).load_state_dict({"epoch": 1})


@pytest.mark.parametrize("change, word", [(dict(seed=2), "seed"),
                                          (dict(shuffle=False), "shuffle"),
                                          (dict(drop_last=True), "drop_last")])
def test_state_of_another_order_is_refused(change, word):
    """A state continues its own order: another seed, shuffle or drop_last is refused."""
    loader = make(dict(shuffle=True, seed=1))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = AsyncLoader(Ids(97), batch_size=8, **{**dict(shuffle=True, seed=1), **change})
    with pytest.raises(StateError, match=word):
        other.load_state_dict(state)
    other.close()


def test_a_ranks_own_progress_is_refused_on_another_rank():
    """A state holding out-of-order progress belongs to its rank; in-step states do not."""
    kw = dict(batch_size=4, shuffle=True, seed=3, world_size=2)
    with AsyncLoader(Ids(40), rank=1, in_order=False, **kw) as a:
        it = iter(a)
        for _ in range(3):
            next(it)
        state = a.state_dict()
    state = {**state, "taken_extra": state["taken_extra"] or [state["batches_taken"] + 1]}
    with AsyncLoader(Ids(40), rank=0, **kw) as b, pytest.raises(StateError, match="rank 1"):
        b.load_state_dict(state)
    with AsyncLoader(Ids(40), rank=1, **kw) as a:
        it = iter(a)
        next(it)
        in_step = a.state_dict()
    with AsyncLoader(Ids(40), rank=0, **kw) as b:
        b.load_state_dict(in_step)        # same world size, in step: any rank's state will do
        assert len(list(b)) == len(b) - 1


def test_resume_across_set_epoch():
    def run_two_epochs(stop_epoch, stop):
        loader = make(dict(shuffle=True, seed=4))
        out = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            it = iter(loader)
            for j, b in enumerate(it):
                out.append(ids(b))
                if (epoch, j + 1) == (stop_epoch, stop):
                    state = loader.state_dict()
                    loader.close()
                    resumed = make(dict(shuffle=True, seed=4))
                    resumed.load_state_dict(state)
                    out += [ids(b) for b in resumed]
                    resumed.set_epoch(epoch + 1)
                    if epoch == 0:
                        out += [ids(b) for b in resumed]
                    resumed.close()
                    return out
        return out
    full = run_two_epochs(-1, -1)
    assert run_two_epochs(1, 3) == full
    assert run_two_epochs(0, 6) == full


@pytest.mark.parametrize("threads,prefetch,in_order,execution",
                         [(1, 1, True, "threads"), (2, 2, True, "threads"),
                          (4, 8, True, "threads"), (3, 5, False, "threads")]
                         + [(2, p, o, e) for e in EXECUTIONS if e != "threads"
                            for p, o in ((2, True), (5, False))], indirect=["execution"])
def test_same_batches_for_any_thread_count(threads, prefetch, in_order, execution):
    ref = [ids(b) for b in make(dict(shuffle=True, seed=9))]
    with make(dict(shuffle=True, seed=9, in_order=in_order), num_threads=threads,
              prefetch=prefetch, **on(execution)) as al:
        got = [ids(b) for b in al]
    assert (got if in_order else sorted(got)) == (ref if in_order else sorted(ref))


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_exactly_distributed_samplers_share(ws, drop_last):
    counts = set()
    for r in range(ws):
        ds = Ids(97)
        ref = DistributedSampler(ds, num_replicas=ws, rank=r, shuffle=True, seed=4,
                                 drop_last=drop_last)
        ref.set_epoch(2)
        assert list(ref) == distributed_indices(97, 2, 4, True, r, ws, drop_last)
        loader = AsyncLoader(ds, batch_size=8, shuffle=True, seed=4, rank=r, world_size=ws,
                             drop_last=drop_last)
        loader.set_epoch(2)
        batches = [ids(b) for b in loader]
        flat = sum(batches, [])
        expect = list(ref)
        assert flat == (expect[:len(expect) // 8 * 8] if drop_last else expect)
        counts.add(len(batches))
    assert len(counts) == 1          # every rank yields the same number of batches


def test_ranks_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    loader = AsyncLoader(Ids(10), batch_size=2, shuffle=False)
    assert (loader.rank, loader.world_size) == (1, 2)
    assert sum((ids(b) for b in loader), []) == [1, 3, 5, 7, 9]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 60), bs=st.integers(1, 9), old=st.integers(1, 4), new=st.integers(1, 4),
       stop=st.integers(0, 8))
def test_elastic_resume_covers_the_rest_exactly_once(n, bs, old, new, stop):
    """Checkpoint after `stop` batches on every rank of `old`, resume on `new` ranks:
    every sample not yet seen is seen exactly once more, the only repeats being the
    padding DistributedSampler also adds to give every rank the same length."""
    per_rank = -(-n // old)
    assume(stop < -(-per_rank // bs))   # a pass that ended resumes as a whole new pass
    seen: list[int] = []
    state = None
    for r in range(old):
        loader = AsyncLoader(Ids(n), batch_size=bs, shuffle=True, seed=1, rank=r, world_size=old)
        it = iter(loader)
        for _ in range(stop):
            b = next(it, None)
            if b is not None:
                seen += ids(b)
        state = loader.state_dict()
        loader.close()
    rest: list[int] = []
    lengths = set()
    for r in range(new):
        loader = AsyncLoader(Ids(n), batch_size=bs, shuffle=True, seed=1, rank=r, world_size=new)
        loader.load_state_dict(state)
        mine = sum((ids(b) for b in loader), [])
        lengths.add(len(mine))
        rest += mine
    assert set(seen) | set(rest) == set(range(n))
    c = Counter(rest)
    assert not (set(c) & set(seen) - set(range(n)))
    dups = sum(v - 1 for v in c.values()) + len(set(c) & set(seen))
    assert dups < max(old, new) + 1
    assert len(lengths) <= 1


def test_sharded_default_seed_is_seed_zero_and_skip_states_stay_with_their_rank():
    kw = dict(batch_size=4, shuffle=True, world_size=2)
    with AsyncLoader(Ids(40), seed=0, rank=0, **kw) as a:
        it = iter(a)
        next(it)
        state = a.state_dict()
    with AsyncLoader(Ids(40), rank=0, **kw) as b:   # seed=None shards with seed 0 too
        b.load_state_dict(state)
        assert len(list(b)) == len(b) - 1
    with AsyncLoader(Ids(40), seed=0, rank=1, on_error="skip", **kw) as a:
        it = iter(a)
        next(it)
        state = a.state_dict()
    with AsyncLoader(Ids(40), seed=0, rank=0, on_error="skip", **kw) as b, \
            pytest.raises(StateError, match="rank 1"):
        b.load_state_dict(state)


def test_iterable_dataset_states_restore_the_epoch_and_the_position():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __init__(self):
            self.epoch = 0

        def set_epoch(self, e):
            self.epoch = e

        def __iter__(self):
            return iter(range(self.epoch, self.epoch + 5))

    with AsyncLoader(Stream(), batch_size=2) as a:
        a.set_epoch(3)
        state = a.state_dict()
        it = iter(a)
        next(it)
        mid = a.state_dict()
    ds = Stream()
    with AsyncLoader(ds, batch_size=2) as b:
        b.load_state_dict(state)
        assert b.epoch == 3 and ds.epoch == 3
        assert [x.tolist() for x in b] == [[3, 4], [5, 6], [7]]
        b.load_state_dict(mid)            # mid-stream: resumed by fast-forward (issue 12)
        assert [x.tolist() for x in b] == [[5, 6], [7]]
