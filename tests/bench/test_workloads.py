"""The benchmark's added workloads (f, g, ceiling, overhead) and its headline.

No timing is asserted: the data sets do what their docstrings say, the runner plans
each workload, and the headline compares the rows it should.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncfeed._bench.config import Config, Settings
from asyncfeed._bench.report import render
from asyncfeed._bench.runner import Bench
from asyncfeed._bench.summary import headline
from asyncfeed._bench.workloads import (SLEEP_S, CifarLike, NoopDataset, PilAugment,
                                        SleepDataset, build_dataset, random_resized_crop_box)
from support import imagegen


def test_cifar_like_crops_and_flips_in_numpy():
    ds = CifarLike(64, seed=1)
    assert len(ds) == 64 and ds.images.shape == (64, 32, 32, 3)
    np.random.seed(0)
    img, label = ds[3]
    assert img.shape == (3, 32, 32) and img.dtype == np.uint8 and img.flags.c_contiguous
    assert label == ds.labels[3]
    # every output is a 32x32 window of the zero-padded image, maybe mirrored
    padded = np.pad(ds.images[3], ((4, 4), (4, 4), (0, 0))).transpose(2, 0, 1)
    windows = [padded[:, y:y + 32, x:x + 32] for y in range(9) for x in range(9)]
    hwc = [w for w in windows] + [w[:, :, ::-1] for w in windows]
    assert any(np.array_equal(img, w) for w in hwc)


def test_random_resized_crop_box_stays_inside_the_image():
    rng = random.Random(5)
    for w, h in ((500, 375), (64, 640), (640, 64), (1, 1)):
        for _ in range(50):
            left, top, cw, ch = random_resized_crop_box(rng, w, h)
            assert 0 <= left and 0 <= top and cw > 0 and ch > 0
            assert left + cw <= w and top + ch <= h


def test_pil_augment_is_normalised_float_and_deterministic_per_index(tmp_path):
    root = tmp_path / "imgs"
    for k in range(6):
        imagegen.write("baseline", root / f"c{k % 2}" / f"{k}.jpg", h=70, w=90, seed=k)
    ds, order = build_dataset({"kind": "pil", "root": str(root), "size": 48, "samples": 6,
                               "seed": 2, "listing": None})
    assert isinstance(ds, PilAugment) and sorted(order) == list(range(6))
    x, label = ds[4]
    assert x.shape == (3, 48, 48) and x.dtype == torch.float32 and label in (0, 1)
    assert float(x.min()) < 0 < float(x.max())  # normalised around ImageNet's mean
    assert torch.equal(ds[4][0], x)              # same crop for the same index
    assert not torch.equal(ds[1][0], x)


def test_sleep_and_noop_return_their_preallocated_sample():
    s = SleepDataset(3)
    a, b = s[0][0], s[1][0]
    assert a is b and a.shape == (3, 224, 224) and SLEEP_S == 0.005
    n = NoopDataset(5)
    assert n[2][0] is n[4][0] and n[2][1] == 2 and len(n) == 5


def test_runner_plans_the_new_workloads(tmp_path):
    s = Settings(root=str(tmp_path), synthetic=True, cores=2,
                 workloads=("f", "g", "ceiling", "overhead"), ceiling_threads=(8, 64))
    bench = Bench(s)
    bench.plan()
    f = bench.configs["f"]
    assert {c.knob for c in f if c.family == "dataloader"} == set(s.workers)
    assert any(c.family == "asyncfeed" and c.knob is None for c in f)
    assert {(c.family, c.knob) for c in bench.configs["ceiling"]} >= {
        ("asyncfeed", 8), ("asyncfeed", 64), ("torchdata", 8), ("torchdata", 64)}
    spec = bench._spec(next(c for c in f if c.family == "dataloader"))
    assert spec["batch_size"] == 128 and spec["dataset"]["samples"] == 20_000
    ceil = bench._spec(next(c for c in bench.configs["ceiling"] if c.knob == 64))
    assert ceil["dataset"]["samples"] == int(64 / SLEEP_S * s.ceiling_seconds)
    assert {c.family for c in bench.configs["overhead"]} == {"dataloader", "asyncfeed"}


def _row(rate: float) -> dict:
    return {"ok": True, "rate": rate, "cpu_per_sample_ms": 0.05, "other_load": 0.0}


def test_headline_is_asyncfeed_default_against_the_best_dataloader(tmp_path):
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2))
    bench.configs["f"] = [
        Config("f", "dataloader", 0, dataset="cifar", runs=[_row(20_000)]),
        Config("f", "dataloader", 2, dataset="cifar", runs=[_row(30_000)]),
        Config("f", "asyncfeed", None, dataset="cifar", role="default", runs=[_row(33_000)]),
        Config("f", "asyncfeed", 1, dataset="cifar", runs=[_row(90_000)]),  # not the default
    ]
    bench.configs["ceiling"] = [
        Config("ceiling", "asyncfeed", 8, dataset="sleep", runs=[_row(1500)]),
        Config("ceiling", "asyncfeed", 64, dataset="sleep", runs=[_row(11_000)]),
        Config("ceiling", "torchdata", 64, dataset="sleep", runs=[_row(10_000)]),
    ]
    results = bench.results()
    by = {h["workload"]: h for h in results["headline"]}
    assert by["f"]["ratio"] == pytest.approx(1.1) and by["f"]["versus"] == "DataLoader w=2"
    assert by["ceiling"]["ratio"] == pytest.approx(1.1)
    assert by["ceiling"]["vs_ideal"] == pytest.approx(11_000 / (64 / SLEEP_S))
    assert headline({"d": []}) == []
    results.update(machine={"cores_usable": 2, "cpu_model": "x", "memory_bytes": 2**30,
                            "python": "3", "torch": "2"}, data={})
    text = render(results)
    assert "headline" in text and "1.10x" in text and "ideal T/5ms" in text
