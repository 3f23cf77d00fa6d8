"""``WebDatasetShards.state_dict()``: a pass resumes at its shard and sample, shuffle
buffer included, on its own and inside an ``AsyncLoader`` state (issue 12, item 2)."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from asyncfeed import AsyncLoader, WebDatasetShards

pytestmark = pytest.mark.timeout(60)

N_SHARDS, PER_SHARD = 5, 9


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("wds_state"))
    for s in range(N_SHARDS):
        with tarfile.open(os.path.join(root, f"s-{s}.tar"), "w") as tf:
            for i in range(PER_SHARD):
                for ext, data in (("txt", f"{s}:{i}".encode()), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"k{s}_{i:02d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return os.path.join(root, f"s-{{0..{N_SHARDS - 1}}}.tar")


class Recording(WebDatasetShards):
    """Records which shards were opened."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.opened: list[str] = []

    def iter_shard(self, url):
        self.opened.append(os.path.basename(url))
        return super().iter_shard(url)


def keys(samples) -> list[str]:
    return [s["__key__"] for s in samples]


def make(pattern: str, buf: int, cls=WebDatasetShards):
    ds = cls(pattern, shuffle_buffer=buf, seed=3, rank=0, world_size=1,
             decode=lambda s: s["txt"].decode())
    ds.set_epoch(1)
    return ds


@pytest.mark.parametrize("buf", [0, 6, 100])
@pytest.mark.parametrize("stop", [0, 1, 13, 40, 44])
def test_the_dataset_resumes_from_its_own_state(shards, buf, stop):
    full = keys(make(shards, buf).iter_raw())
    assert sorted(full) == sorted(f"k{s}_{i:02d}" for s in range(N_SHARDS)
                                  for i in range(PER_SHARD))
    ds = make(shards, buf)
    it = ds.iter_raw()
    head = [next(it)["__key__"] for _ in range(stop)]
    state = json.loads(json.dumps(ds.state_dict()))
    fresh = make(shards, buf)
    fresh.load_state_dict(state)
    assert head + keys(fresh.iter_raw()) == full
    assert fresh.state_dict()["position"] is None         # the pass ran to its end


def test_a_resume_does_not_read_the_shards_already_done(shards):
    ds = make(shards, 0)
    it = ds.iter_raw()
    for _ in range(3 * PER_SHARD + 2):
        next(it)
    order = ds.shards_for(0, 1)
    fresh = make(shards, 0, Recording)
    fresh.load_state_dict(ds.state_dict())
    rest = keys(fresh.iter_raw())
    assert len(rest) == N_SHARDS * PER_SHARD - (3 * PER_SHARD + 2)
    assert fresh.opened == [os.path.basename(u) for u in order[3:]]


def test_a_state_of_another_rank_is_refused(shards):
    ds = make(shards, 4)
    it = ds.iter_raw()
    next(it)
    state = ds.state_dict()
    other = WebDatasetShards(shards, shuffle_buffer=4, seed=3, rank=1, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        other.iter_raw()


@pytest.mark.parametrize("stop", [1, 4, 7])
def test_an_asyncloader_state_resumes_the_shards_mid_epoch(shards, stop):
    def loader(cls=WebDatasetShards):
        ds = make(shards, 6, cls)
        return AsyncLoader(ds, batch_size=3, num_threads=2, prefetch=4, collate_fn=list), ds

    al, _ = loader()
    full = [b for b in al]
    al.close()
    al, _ = loader()
    it = iter(al)
    head = [next(it) for _ in range(stop)]
    state = json.loads(json.dumps(al.state_dict()))
    al.close()
    assert state["stream"]["dataset"]["position"] is not None   # resumed from its state
    resumed, ds = loader(Recording)
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    assert head + rest == full
    assert len(ds.opened) < N_SHARDS + 3          # not a fast-forward through every shard
