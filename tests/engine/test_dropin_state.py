"""Drop-in resume behaviour (issue 12, items 1-3 and the state's versions), with
torchdata's ``StatefulDataLoader`` (``num_workers=0``) as the oracle where it runs.

Each scenario is run on both loaders: the oracle shows what users of
StatefulDataLoader rely on, and AsyncLoader must show the same.
"""

from __future__ import annotations

import copy
import json
import time
import warnings

import pytest
import torch
from torch.utils.data import IterableDataset, Sampler

from asyncfeed import AsyncLoader, StateError
from asyncfeed._engine.processes import EXECUTIONS
from support.datasets import Ids, ids

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402


def flat(batches) -> list[list[int]]:
    out = []
    for b in batches:
        out.append(b[1].tolist() if isinstance(b, (list, tuple)) else b.tolist())
    return out


def plain(state):
    """What a checkpoint file gives back (JSON for our plain state, a deep copy for the
    oracle's, which holds tensors)."""
    try:
        return json.loads(json.dumps(state))
    except TypeError:
        return copy.deepcopy(state)


LOADERS = {
    "StatefulDataLoader": lambda ds, **kw: StatefulDataLoader(ds, **kw),
    "AsyncLoader": lambda ds, **kw: AsyncLoader(ds, num_threads=2, prefetch=3, **kw),
}


def _close(loader) -> None:
    if isinstance(loader, AsyncLoader):
        loader.close()


# ------------------------------------------------------- 1. the state after `break`
@pytest.mark.parametrize("name", list(LOADERS))
@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(shuffle=True, generator=3),
                                dict(shuffle=False)], ids=["global-rng", "generator", "plain"])
@pytest.mark.parametrize("k", [0, 2, 9])
def test_state_after_break_resumes_with_the_rest(name, kw, k):
    """``for i, b in enumerate(loader): ... if i == k: break`` then ``state_dict()``:
    the state names the position after the k+1 batches handed out."""
    def make():
        extra = dict(kw)
        if "generator" in extra:
            extra["generator"] = torch.Generator().manual_seed(extra["generator"])
        return LOADERS[name](Ids(50), batch_size=4, **extra)

    torch.manual_seed(0)
    loader = make()
    taken = []
    for i, b in enumerate(loader):
        taken.append(ids(b))
        if i == k:
            break
    state = plain(loader.state_dict())
    _close(loader)
    torch.manual_seed(0)
    full = [ids(b) for b in make()]
    torch.manual_seed(1234)                   # another process: another global RNG
    resumed = make()
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    _close(resumed)
    assert taken == full[:k + 1]
    assert taken + rest == full


@pytest.mark.parametrize("name", list(LOADERS))
def test_state_after_a_full_pass_fixes_the_next_epochs_order(name):
    """Without a generator: the next epoch after a resume is the uninterrupted run's."""
    torch.manual_seed(0)
    loader = LOADERS[name](Ids(40), batch_size=4, shuffle=True)
    first = [ids(b) for b in loader]
    state = plain(loader.state_dict())
    second = [ids(b) for b in loader]
    _close(loader)
    assert first != second
    torch.manual_seed(77)
    resumed = LOADERS[name](Ids(40), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == second
    _close(resumed)


def test_the_position_is_kept_until_the_next_iter():
    with AsyncLoader(Ids(40), batch_size=4, shuffle=True, seed=1) as loader:
        for i, _ in enumerate(loader):
            if i == 3:
                break
        s1 = loader.state_dict()
        assert s1["in_pass"] and s1["batches_taken"] == 4
        assert loader.state_dict() == s1          # asking again changes nothing
        it = iter(loader)                         # a new pass: starts from scratch
        assert loader.state_dict()["batches_taken"] == 0
        next(it)
        assert loader.state_dict()["batches_taken"] == 1


def test_global_rng_draws_match_dataloader_when_a_state_is_taken_between_passes():
    """The seed the next pass would draw at iter() is drawn by state_dict() instead:
    the same draws, so the batches are still DataLoader's."""
    from torch.utils.data import DataLoader
    torch.manual_seed(5)
    want = [[ids(b) for b in DataLoader(Ids(30), batch_size=4, shuffle=True)]
            for _ in range(2)]
    rng_d = torch.get_rng_state()
    torch.manual_seed(5)
    with AsyncLoader(Ids(30), batch_size=4, shuffle=True) as loader:
        got = [[ids(b) for b in loader]]
        loader.state_dict()
        loader.state_dict()                       # drawn once, not per call
        got.append([ids(b) for b in loader])
    assert got == want
    assert torch.equal(torch.get_rng_state(), rng_d)


# ------------------------------------------------------ 2. IterableDataset mid-epoch
class Counting(IterableDataset):
    """0..n-1, deterministic, no state of its own; counts the items it made."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made = 0

    def __iter__(self):
        for i in range(self.n):
            self.made += 1
            yield torch.tensor([i, -i]), i


class Positioned(Counting):
    """Keeps its own position (``state_dict``/``load_state_dict``): a resume starts
    there, without making the earlier items again."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.pos = 0
        self.first_made: int | None = None

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]

    def __iter__(self):
        start, self.pos = self.pos, self.pos
        self.first_made = None
        for i in range(start, self.n):
            if self.first_made is None:
                self.first_made = i
            self.made += 1
            self.pos = i + 1
            yield torch.tensor([i, -i]), i
        self.pos = 0


class SplitCounting(IterableDataset):
    """Splits its work (``iter_raw`` + ``decode``); counts decodes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.decoded = 0

    def iter_raw(self):
        return iter(range(self.n))

    def decode(self, raw, index):
        self.decoded += 1
        return torch.tensor([raw, -raw]), raw

    def __iter__(self):
        return (self.decode(r, i) for i, r in enumerate(self.iter_raw()))


@pytest.mark.parametrize("name", list(LOADERS))
@pytest.mark.parametrize("cls", [Counting, Positioned])
@pytest.mark.parametrize("k", [1, 4])
def test_iterable_dataset_resumes_mid_epoch(name, cls, k):
    full = [ids(b) for b in LOADERS[name](cls(30), batch_size=4)]
    loader = LOADERS[name](cls(30), batch_size=4)
    it = iter(loader)
    taken = [ids(next(it)) for _ in range(k)]
    state = plain(loader.state_dict())
    _close(loader)
    ds = cls(30)
    resumed = LOADERS[name](ds, batch_size=4)
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    _close(resumed)
    assert taken + rest == full
    if cls is Positioned and name == "AsyncLoader":
        # its own state, snapshot as chunks are pulled: at most the chunk before the
        # position is read again (the next chunk may not have been pulled yet)
        assert 4 * k - 4 <= ds.first_made <= 4 * k and ds.made == 30 - ds.first_made
    elif cls is Positioned:
        assert ds.first_made == 4 * k and ds.made == 30 - 4 * k


class CountingIter:
    """An iterator with a state of its own (what ``iter(dataset)`` may return)."""

    def __init__(self, n: int) -> None:
        self.i, self.n = 0, n
        self.first: int | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        if self.first is None:
            self.first = self.i
        self.i += 1
        return torch.tensor([self.i - 1, 1 - self.i]), self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


class StatefulIter(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.iters: list[CountingIter] = []

    def __iter__(self):
        self.iters.append(CountingIter(self.n))
        return self.iters[-1]


@pytest.mark.parametrize("name", list(LOADERS))
def test_an_iterable_datasets_stateful_iterator_is_resumed_from_its_state(name):
    full = [ids(b) for b in LOADERS[name](StatefulIter(30), batch_size=4)]
    loader = LOADERS[name](StatefulIter(30), batch_size=4)
    it = iter(loader)
    taken = [ids(next(it)) for _ in range(3)]
    state = plain(loader.state_dict())
    _close(loader)
    ds = StatefulIter(30)
    resumed = LOADERS[name](ds, batch_size=4)
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    _close(resumed)
    assert taken + rest == full
    assert ds.iters[-1].first is None or ds.iters[-1].first >= 8   # not from the start


def test_iterable_fast_forward_pulls_raw_items_without_decoding_them():
    with AsyncLoader(SplitCounting(40), batch_size=4, prefetch=2) as loader:
        it = iter(loader)
        taken = [ids(next(it)) for _ in range(3)]
        state = loader.state_dict()
    ds = SplitCounting(40)
    with AsyncLoader(ds, batch_size=4) as resumed:
        resumed.load_state_dict(state)
        rest = [ids(b) for b in resumed]
    assert sum(taken + rest, []) == list(range(40))
    assert ds.decoded == 40 - 12


def test_iterable_state_between_passes_is_taken_after_a_break_too():
    with AsyncLoader(Counting(20), batch_size=3) as loader:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        state = loader.state_dict()
    assert state["in_pass"] and state["stream"]["items"] == 6
    with AsyncLoader(Counting(20), batch_size=3) as resumed:
        resumed.load_state_dict(state)
        assert sum((ids(b) for b in resumed), []) == list(range(6, 20))


# --------------------------------------------- 3. the dataset's and sampler's own state
class WithEpoch(Ids):
    """A map-style dataset with a counter of its own (e.g. an epoch for augmentation)."""

    def __init__(self, n: int = 20) -> None:
        super().__init__(n)
        self.counter = 0

    def state_dict(self):
        return {"counter": self.counter}

    def load_state_dict(self, state):
        self.counter = state["counter"]


class PassCounting(Sampler):
    """Each pass shuffles with the number of passes so far: the order depends on the
    sampler's own state, not on anything the loader knows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.passes = 0

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(1000 + self.passes)
        self.passes += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def state_dict(self):
        return {"passes": self.passes}

    def load_state_dict(self, state):
        self.passes = state["passes"]


@pytest.mark.parametrize("name", list(LOADERS))
@pytest.mark.parametrize("in_pass", [False, True])
def test_the_datasets_own_state_is_saved_and_restored(name, in_pass):
    ds = WithEpoch()
    loader = LOADERS[name](ds, batch_size=4)
    ds.counter = 7
    it = iter(loader)
    if in_pass:
        next(it)
    else:
        list(it)
    state = plain(loader.state_dict())
    _close(loader)
    fresh = WithEpoch()
    resumed = LOADERS[name](fresh, batch_size=4)
    resumed.load_state_dict(state)
    if name == "StatefulDataLoader" or in_pass:
        # restored at iter(); AsyncLoader restores a mid-pass state's once the
        # resumed pass's sampler has started, between passes at load_state_dict
        iter(resumed)
    assert fresh.counter == 7
    _close(resumed)


def test_the_samplers_own_state_is_saved_and_restored_between_passes():
    """(StatefulDataLoader saves it too, but its resume calls ``iter(sampler)`` once
    more than the uninterrupted run, so its next order is a later pass's.)"""
    name = "AsyncLoader"

    def make(sampler):
        return LOADERS[name](Ids(24), batch_size=5, sampler=sampler)

    loader = make(PassCounting(24))
    passes = [[ids(b) for b in loader] for _ in range(2)]
    state = plain(loader.state_dict())
    third = [ids(b) for b in loader]
    _close(loader)
    resumed = make(PassCounting(24))
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == third
    assert third not in passes
    _close(resumed)


class Salted(Sampler):
    """Shuffles with a salt of its own (a fresh process draws another), and resumes
    from its own position, like torchdata's stateful samplers."""

    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt = n, salt
        self.yielded = 0
        self._resume_at: int | None = None

    def __len__(self):
        return self.n

    def __iter__(self):
        start, self._resume_at = self._resume_at or 0, None
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.salt))
        self.yielded = start
        for i in perm[start:].tolist():
            self.yielded += 1
            yield i

    def state_dict(self):
        return {"salt": self.salt, "yielded": self.yielded}

    def load_state_dict(self, state):
        self.salt, self._resume_at = state["salt"], state["yielded"]


@pytest.mark.parametrize("kind", ["salted", "StatefulDistributedSampler"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_stateful_sampler_resumes_itself_mid_pass_as_in_statefuldataloader(k, kind):
    def make(cls, salt):
        ds = Ids(37)
        if kind == "salted":
            s = Salted(37, salt)
        else:
            s = StatefulDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4)
        if cls is StatefulDataLoader:
            return cls(ds, batch_size=4, sampler=s)
        return AsyncLoader(ds, batch_size=4, sampler=s, prefetch=4)

    outcomes = []
    for cls in (StatefulDataLoader, AsyncLoader):
        loader = make(cls, salt=1)
        it = iter(loader)
        taken = [ids(next(it)) for _ in range(k)]
        state = plain(loader.state_dict())
        _close(loader)
        resumed = make(cls, salt=2)          # another process would draw another salt
        resumed.load_state_dict(state)
        rest = [ids(b) for b in resumed]
        _close(resumed)
        outcomes.append((taken, rest))
    assert outcomes[0] == outcomes[1]
    taken, rest = outcomes[1]
    assert sorted(sum(taken + rest, [])) == list(range(37))


# ------------------------------------------------------------- the state's versions
# A mid-epoch state exactly as asyncfeed 0.1 (state version 1) wrote it for
# AsyncLoader(Ids(97), batch_size=8, shuffle=True, seed=5) after 3 batches.
V1_MID = {"format": "asyncfeed.AsyncLoader", "version": 1, "dataset_len": 97,
          "batch_size": 8, "drop_last": False, "shuffle": True, "seed": 5,
          "world_size": 1, "rank": 0, "on_error": "raise", "epoch": 0, "in_pass": True,
          "batches_taken": 3, "taken_extra": [], "offset": 24, "carry": [], "replay": {},
          "resharded_from": None}
V1_BETWEEN = {**V1_MID, "epoch": 2, "in_pass": False, "batches_taken": 0, "offset": 0}


def test_version_1_states_still_load():
    full = [ids(b) for b in AsyncLoader(Ids(97), batch_size=8, shuffle=True, seed=5)]
    with AsyncLoader(Ids(97), batch_size=8, shuffle=True, seed=5) as loader:
        loader.load_state_dict(V1_MID)
        assert [ids(b) for b in loader] == full[3:]
    with AsyncLoader(Ids(97), batch_size=8, shuffle=True, seed=5) as loader:
        loader.load_state_dict(V1_BETWEEN)
        assert loader.epoch == 2
        again = AsyncLoader(Ids(97), batch_size=8, shuffle=True, seed=5)
        again.set_epoch(2)
        assert [ids(b) for b in loader] == [ids(b) for b in again]


def test_state_dataclass_round_trip_and_version_checks():
    from asyncfeed._engine.state import LoaderState
    st = LoaderState.from_dict(V1_MID)
    assert st.batches_taken == 3 and st.stream is None and st.dataset_state is None
    d = st.to_dict()
    assert d["version"] == 2 and json.loads(json.dumps(d)) == d
    assert LoaderState.from_dict(d) == st
    with pytest.raises(StateError, match="version"):
        LoaderState.from_dict({**d, "version": 3})
    with pytest.raises(StateError):
        LoaderState.from_dict({**d, "batches_taken": "many"})
    with pytest.raises(StateError):
        LoaderState.from_dict([1, 2])


def test_a_v1_mid_stream_iterable_state_is_refused_with_a_reason():
    state = {**V1_MID, "dataset_len": None, "batch_size": 4, "shuffle": False, "seed": None}
    with AsyncLoader(Counting(10), batch_size=4) as loader, \
            pytest.raises(StateError, match="version 1"):
        loader.load_state_dict(state)


# ------------------------------------- 4. the cases of torchdata's own state tests
# (test/stateful_dataloader/test_state_dict.py; each scenario rewritten here, run on
# both loaders, AsyncLoader on every execution)
EXECUTIONS_RUN = [e for e in EXECUTIONS if e != "auto"]


def _loaders(execution: str) -> dict:
    return {"StatefulDataLoader": LOADERS["StatefulDataLoader"],
            "AsyncLoader": lambda ds, **kw: AsyncLoader(ds, num_threads=2, prefetch=3,
                                                        execution=execution, **kw)}


def _cases() -> list:
    return [pytest.param("StatefulDataLoader", "threads", id="StatefulDataLoader")] + [
        pytest.param("AsyncLoader", e, id=f"AsyncLoader-{e}") for e in EXECUTIONS_RUN]


class Records(torch.utils.data.Dataset):
    """Map-style: dict samples; its own state is the global RNG's (as torchdata's
    ``DummyMapDataset``), so loading it moves the RNG a sampler may draw from."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"id": i, "name": f"row_{i}", "near": [i, i + 1]}

    def state_dict(self):
        return {"g": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["g"])


def _ids_of(batches) -> list:
    return [b["id"].tolist() for b in batches]


@pytest.mark.parametrize("name, execution", _cases())
@pytest.mark.parametrize("sampler_cls", [torch.utils.data.RandomSampler,
                                         torch.utils.data.SequentialSampler],
                         ids=["random", "sequential"])
@pytest.mark.parametrize("stop", [10, 50, 80])
def test_a_sampler_without_state_resumes_by_replaying_its_order(name, execution, sampler_cls,
                                                                stop):
    """A sampler with no ``state_dict`` (RandomSampler drawing its seed from the global
    RNG): with the global RNG seeded alike, break + resume gives the uninterrupted run."""
    make = _loaders(execution)[name]

    def loader():
        ds = Records(100)
        return make(ds, batch_size=1, sampler=sampler_cls(ds))

    torch.manual_seed(0)
    first = loader()
    got = []
    for i, b in enumerate(first):
        got.append(b)
        if i == stop:
            break
    state = copy.deepcopy(first.state_dict())
    _close(first)
    torch.manual_seed(0)
    resumed = loader()
    resumed.load_state_dict(state)
    got += list(resumed)
    _close(resumed)
    torch.manual_seed(0)
    whole = loader()
    full = list(whole)
    _close(whole)
    assert str(got) == str(full)


class RngIterator:
    """An iterator with its own state that draws from the global RNG (its state holds
    the RNG's), as torchdata's ``DummyIterator`` does."""

    def __init__(self, samples: list[int]) -> None:
        self.samples, self.i = samples, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.samples):
            raise StopIteration
        self.i += 1
        return self.samples[int(torch.randint(len(self.samples), (1,)).item())]

    def state_dict(self):
        return {"nest": {"i": self.i, "g": torch.get_rng_state()}}

    def load_state_dict(self, state):
        self.i = state["nest"]["i"]
        torch.set_rng_state(state["nest"]["g"])


class RngStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return RngIterator(list(range(self.n)))


@pytest.mark.parametrize("name, execution", _cases())
@pytest.mark.parametrize("bs", [None, 4])
def test_an_iterable_state_taken_at_the_end_of_an_epoch_resumes_the_next(name, execution,
                                                                         bs):
    make = _loaders(execution)[name]
    ds = RngStream(137)
    g = torch.Generator().manual_seed(4)
    first = make(ds, batch_size=bs, generator=g, collate_fn=lambda x: x)
    list(first)
    state = copy.deepcopy(first.state_dict())
    expected = list(first)
    _close(first)
    g.manual_seed(4)
    torch.manual_seed(99)     # another process: another global RNG
    resumed = make(ds, batch_size=bs, generator=g, collate_fn=lambda x: x)
    resumed.load_state_dict(state)
    got = list(resumed)
    _close(resumed)
    assert got == expected


class Ranged(IterableDataset):
    """An iterable that is its own iterator, set up by ``__iter__`` (a range
    ``[start, end)`` and a cursor): its ``load_state_dict`` sets the cursor, so it
    must be called after ``iter()``."""

    def __init__(self, n: int) -> None:
        self.n, self.iter_calls = n, 0
        self.cur = self.end = 0

    def __iter__(self):
        self.iter_calls += 1
        self.cur, self.end = 0, self.n
        return self

    def __next__(self):
        if self.cur >= self.end:
            raise StopIteration
        self.cur += 1
        return self.cur - 1

    def state_dict(self):
        return {"cur": self.cur, "end": self.end, "iter_calls": self.iter_calls}

    def load_state_dict(self, state):
        self.cur, self.end = state["cur"], state["end"]


@pytest.mark.parametrize("name, execution", _cases())
def test_an_iterables_state_is_loaded_after_its_iterator_is_made(name, execution):
    make = _loaders(execution)[name]
    ds = Ranged(100)
    first = make(ds, collate_fn=lambda x: x)
    it = iter(first)
    got = [x for _ in range(70) for x in next(it)]
    state = plain(first.state_dict())
    _close(first)
    resumed = make(ds, collate_fn=lambda x: x)
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [x for _ in range(30) for x in next(it)]
    _close(resumed)
    assert sorted(got) == list(range(100))


class SlowFirst(torch.utils.data.Dataset):
    """Sample 0 takes a while: later samples overtake it with ``in_order=False``."""

    def __init__(self, n: int = 10, slow: float = 0.5) -> None:
        self.n, self.slow = n, slow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == 0:
            time.sleep(self.slow)
        return i


@pytest.mark.parametrize("execution", EXECUTIONS_RUN)
def test_out_of_order_with_a_checkpoint_delivers_each_sample_once(execution):
    """(StatefulDataLoader reorders only with worker processes: no oracle here.  With
    ``inline``, the consumer loads each sample when it asks for it: nothing overtakes.)"""
    make = _loaders(execution)["AsyncLoader"]
    first = make(SlowFirst(), in_order=False)
    got = []
    for i, b in enumerate(first):
        got += b.tolist()
        if i == 3:
            state = plain(first.state_dict())
            break
    _close(first)
    overtaken = execution != "inline"
    assert (0 not in got) if overtaken else got == [0, 1, 2, 3]
    resumed = make(SlowFirst(), in_order=False)
    resumed.load_state_dict(state)
    got += [x for b in resumed for x in b.tolist()]
    _close(resumed)
    assert sorted(got) == list(range(10))
    assert (got != list(range(10))) == overtaken


class Periodic(IterableDataset):
    """An iterable whose items depend on a state it keeps across items and passes."""

    def __init__(self) -> None:
        self.state = {0: 0, 1: 0, 2: 0, 3: 0}
        self.step, self.limit = 0, 100

    def __iter__(self):
        for _ in range(self.step, self.limit):
            self.step += 1
            k = self.step % len(self.state)
            self.state[k] = 1 - self.state[k]
            yield self.state[k]

    def state_dict(self):
        return {"state": dict(self.state), "step": self.step}

    def load_state_dict(self, state):
        self.state = {int(k): v for k, v in state["state"].items()}
        self.step = state["step"]


@pytest.mark.parametrize("name, execution", _cases())
@pytest.mark.parametrize("stop", [15, 19])
def test_a_state_asked_for_right_after_a_resume_says_where_it_stands(name, execution, stop):
    make = _loaders(execution)[name]
    first = make(Periodic(), batch_size=1, collate_fn=lambda x: x)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = plain(first.state_dict())
    for _ in range(2):
        next(it)
    two_later = plain(first.state_dict())
    rest = list(it)
    first.load_state_dict(state)          # the same loader, resumed
    it = iter(first)
    for _ in range(2):
        next(it)
    again = plain(first.state_dict())
    _close(first)
    assert _position(again) == _position(two_later)
    for state in (again, two_later):
        fresh = make(Periodic(), batch_size=1, collate_fn=lambda x: x)
        fresh.load_state_dict(state)
        assert list(fresh) == rest
        _close(fresh)


def _position(state: dict) -> object:
    """Where a state says the pass stands: AsyncLoader's position fields (the stream
    snapshot it keeps may be from one chunk earlier or later, as the pulling thread
    has run ahead: either resumes the same), or StatefulDataLoader's whole state."""
    if state.get("format") != "asyncfeed.AsyncLoader":
        return state
    return (state["epoch"], state["batches_taken"], state["offset"], state["stream"]["items"])
