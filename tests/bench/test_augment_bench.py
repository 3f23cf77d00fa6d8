"""Workload (h), training augmentation: its plan, its figures, and real runs of its
data sets through the bench's run function (no timing asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncfeed._bench import augment
from asyncfeed._bench.child import execute
from asyncfeed._bench.config import Config
from asyncfeed._bench.report import render
from asyncfeed._bench.runner import Bench, Settings
from support.imagegen import write

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("h") / "root"
    for i in range(12):
        write("baseline", root / f"c{i % 2}" / f"{i:02d}.jpg", 40 + 4 * i, 60 - 2 * i, seed=i)
    return str(root)


def test_the_plan_compares_the_fused_path_with_every_pipeline(tmp_path, monkeypatch):
    monkeypatch.setattr(augment, "torchvision_missing", lambda: "skipped (not installed): x")
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("h",)))
    bench.plan()
    h = bench.configs["h"]
    got = {(c.family, c.knob, c.dataset) for c in h}
    assert got == {("limit", 1, "train"), ("limit", 2, "train"), ("asyncfeed", None, "train"),
                   ("asyncfeed", 2, "train"), ("asyncfeed", None, "pil")} | {
                       ("dataloader", w, ds) for w in (0, 2, 4) for ds in ("pil", "train")}
    assert bench.skipped["torchvision (h)"].startswith("skipped (not installed)")
    spec = bench._spec(next(c for c in h if c.family == "asyncfeed" and c.dataset == "train"))
    assert spec["dataset"]["normalize"] is True and spec["dataset"]["samples"] == 1920
    pil = bench._spec(next(c for c in h if c.dataset == "pil"))["dataset"]
    assert "normalize" not in pil and pil["samples"] == 1920  # (g)'s PIL set runs 320
    monkeypatch.setattr(augment, "torchvision_missing", lambda: None)
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("h",)))
    bench.plan()
    datasets = {c.dataset for c in bench.configs["h"] if c.family == "asyncfeed"}
    assert datasets == {"train", "pil", "tv-folder", "tv-decode"}
    assert "torchvision (h)" not in bench.skipped


def _row(rate: float, cpu: float) -> dict:
    return {"ok": True, "rate": rate, "cpu_per_sample_ms": cpu, "other_load": 0.0}


def test_figures_headline_and_table(tmp_path):
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("h",)))
    bench.configs["h"] = [
        Config("h", "limit", 2, mode="limit", dataset="train", role="limit",
               runs=[_row(1000, 1.8)]),
        Config("h", "asyncfeed", None, dataset="train", role="default", runs=[_row(900, 2.0)]),
        Config("h", "dataloader", 0, dataset="pil", role="reference", runs=[_row(250, 4.0)]),
        Config("h", "dataloader", 2, dataset="pil", role="reference", runs=[_row(400, 4.6)]),
        Config("h", "dataloader", 2, dataset="train", runs=[_row(800, 2.3)]),
    ]
    results = bench.results()
    rows = {(r["family"], r["knob"], r["dataset"]): r for r in results["summary"]["h"]}
    mine = rows[("asyncfeed", None, "train")]
    assert mine["vs_pil_best"] == pytest.approx(900 / 400)
    assert mine["cpu_vs_pil_w0"] == pytest.approx(2.0 / 4.0)
    assert mine["vs_limit"] == pytest.approx(0.9)
    assert "vs_tv_folder_best" not in mine
    head = next(h for h in results["headline"] if h["workload"] == "h")
    assert head["versus"] == "DataLoader w=2" and head["ratio"] == pytest.approx(2.25)
    results.update(machine={"cores_usable": 2, "cpu_model": "x", "memory_bytes": 2**30,
                            "python": "3", "torch": "2"}, data={})
    text = render(results)
    assert "(h) training augmentation" in text and "fused (uint8) + normalize" in text
    assert "2.25" in text and "0.50" in text
    assert "steady img/s" in text


def _spec(folder: str, kind: str, family: str, knob, mode="throughput", **ds) -> dict:
    return {"dataset": {"kind": kind, "root": folder, "size": 32, "samples": 16, "seed": 0,
                        "interpolation": "area", "listing": None, "io": "thread", **ds},
            "family": family, "knob": knob, "mode": mode, "batch_size": 8, "device": "cpu",
            "seed": 0, "context": None, "pause": False, "procs": 2}


def _round(rate: float, rnd: int) -> dict:
    return {**_row(rate, 2.0), "round": rnd}


def test_each_round_is_read_against_the_limit_of_that_round(tmp_path):
    # the machine ran slower in round 1: the medians' ratio mixes a fast limit with a
    # slow run (and the reverse); each round's pair reads the loader within its limit
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("h",)))
    limit = Config("h", "limit", 2, mode="limit", dataset="train", role="limit",
                   runs=[_round(1000, 0), _round(600, 1), _round(900, 2)])
    mine = Config("h", "asyncfeed", None, dataset="train", role="default",
                  runs=[_round(980, 0), _round(540, 1), {"ok": False, "round": 2}])
    bench.configs["h"] = [limit, mine]
    results = bench.results()
    rows = {r["family"]: r for r in results["summary"]["h"]}
    got = rows["asyncfeed"]
    assert got["vs_limit_rounds"] == pytest.approx([0.98, 0.9])
    assert got["vs_limit_round_median"] == pytest.approx(0.94)
    assert got["vs_limit_round_worst"] == pytest.approx(0.9)
    assert got["vs_limit"] == pytest.approx(760 / 900)  # medians: 760 against 900
    assert "vs_limit_rounds" not in rows["limit"]
    results.update(machine={"cores_usable": 2, "cpu_model": "x", "memory_bytes": 2**30,
                            "python": "3", "torch": "2"}, data={})
    text = render(results)
    assert "x limit by round" in text and "0.94 (0.90)" in text


def test_a_round_that_other_load_disturbed_is_paired_as_the_medians_read_it(tmp_path):
    # round 1's run shared the machine with another process: the medians leave it out
    # (the row has undisturbed runs), and so do the pairs
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("h",)))
    limit = Config("h", "limit", 2, mode="limit", dataset="train", role="limit",
                   runs=[_round(1000, 0), _round(1000, 1)])
    mine = Config("h", "asyncfeed", None, dataset="train", role="default",
                  runs=[_round(950, 0), {**_round(500, 1), "other_load": 0.6}])
    bench.configs["h"] = [limit, mine]
    got = {r["family"]: r for r in bench.results()["summary"]["h"]}["asyncfeed"]
    assert got["rate"] == 950 and got["vs_limit_rounds"] == pytest.approx([0.95])


def test_h_runs_as_many_rounds_as_a(tmp_path):
    s = Settings(root=str(tmp_path), synthetic=True, cores=2, workloads=("a", "h", "c", "d"))
    bench = Bench(s)
    assert bench.rounds("h") == bench.rounds("a") == bench.rounds("c") == s.repeats
    assert s.repeats > bench.rounds("d") == s.repeats_other


def test_real_runs_give_normalized_float_batches(folder):
    fused = execute(_spec(folder, "train", "asyncfeed", None, normalize=True))
    assert fused["samples"] == 16 and fused["sample_shape"] == [3, 32, 32, "torch.float32"]
    pil = execute(_spec(folder, "pil", "dataloader", 0))
    assert pil["sample_shape"] == [3, 32, 32, "torch.float32"]
    loader_over_fused = execute(_spec(folder, "train", "dataloader", 2, normalize=True))
    assert loader_over_fused["sample_shape"] == fused["sample_shape"]
    limit = execute(_spec(folder, "train", "limit", 2, mode="limit"))
    assert limit["samples"] == 16 and limit["rate"] > 0


def test_the_consumers_normalize_is_asyncfeeds_on_one_thread_into_one_buffer(monkeypatch):
    """On the CPU the bench's consumer normalizes on one thread, into one reused
    float buffer per row shape (as a CPU training loop keeps its input), whose
    start serves a shorter batch, and which ``reserve`` makes before a run."""
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    from asyncfeed import normalize
    from asyncfeed._data import normalize as module
    before = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(module, "normalize", lambda b, out=None: seen.append(
        torch.get_num_threads()) or normalize(b, out=out))
    torch.set_num_threads(2)
    try:
        first = augment.normalized(x)
        assert torch.equal(first, normalize(x))
        assert seen == [1] and torch.get_num_threads() == 2  # restored
        again = augment.normalized(x.flip(0))
        assert again.data_ptr() == first.data_ptr()         # the same buffer
        assert torch.equal(again, normalize(x.flip(0)))
        other = augment.normalized(x[:1])                   # a short batch: its start
        assert other.shape == (1, 3, 4, 4) and torch.equal(other, normalize(x[:1]))
        assert other.data_ptr() == first.data_ptr()
        augment.reserve(4, (3, 4, 4))                       # made before a run
        made = augment._OUT[(3, 4, 4)]
        assert made.shape == (4, 3, 4, 4) and not made.any()
        assert augment.normalized(x).data_ptr() == made.data_ptr()
        wide = augment.normalized(torch.zeros(1, 3, 5, 5, dtype=torch.uint8))  # other rows
        assert wide.shape == (1, 3, 5, 5)
    finally:
        torch.set_num_threads(before)
    f = torch.zeros(2, 3, 4, 4)
    assert augment.normalized(f) is f


def test_the_limit_of_h_normalizes_each_row_as_the_consumer_does():
    rows = augment.NormalizedRows([(torch.full((3, 2, 2), 255, dtype=torch.uint8), 7)])
    image, label = rows[0]
    assert label == 7 and image.shape == (1, 3, 2, 2) and image.dtype == torch.float32
    from asyncfeed import normalize
    assert torch.equal(image, normalize(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)))


def test_torchvision_that_does_not_import_is_told_apart_from_missing(monkeypatch):
    def fails(exc):
        def imp(name):
            raise exc
        return imp
    monkeypatch.setattr(augment.importlib, "import_module",
                        fails(ModuleNotFoundError("No module named 'torchvision'")))
    assert augment.torchvision_missing().startswith("skipped (not installed): torchvision")
    monkeypatch.setattr(augment.importlib, "import_module",
                        fails(RuntimeError("operator torchvision::nms does not exist")))
    why = augment.torchvision_missing()
    assert why.startswith("skipped (installed, but does not import with this torch")
    assert "torchvision::nms" in why


def test_the_row_overhead_script_prints_each_way_of_running_a_row(folder):
    """``bench/row_overhead.py`` runs its three contenders on a small folder and prints
    each one's CPU per row (the figures themselves are the machine's, not asserted)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "row_overhead.py"), folder,
         "--size", "32", "--samples", "12", "--rounds", "2", "--batch-size", "4"],
        env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == [
        "bare", "bare, rows of a batch", "loader thread", "loader consumer"]
    assert all(line.endswith(" ms/row") and len(line.split()) >= 4 for line in lines)


def test_the_threads_vs_processes_script_runs_each_way_side_by_side(folder):
    """``bench/threads_vs_processes.py`` runs the rows in processes, bare threads and
    the loader (and, with ``--normalize``, processes that normalize whole batches),
    each in a fresh process, and prints one line per way with its rate, CPU per row
    and ratio to the processes of the same round (the figures are the machine's, not
    asserted); a way that fails is an error, not a line."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "bench", "threads_vs_processes.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    for extra, ways in (([], ["processes", "threads", "loader"]),
                        (["--normalize"],
                         ["processes", "threads", "loader", "processes, batches"])):
        proc = subprocess.run(
            [sys.executable, script, folder, "--workers", "2", "--size", "32", "--samples",
             "18", "--rounds", "1", "--batch-size", "4", *extra],
            env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        head, *lines = proc.stdout.splitlines()
        assert head == "18 rows, 2 side by side, 1 rounds" + (", normalized" if extra else "")
        assert [line[:20].strip() for line in lines] == ways
        assert all(" ms/row" in line and "x processes by round" in line for line in lines)
        assert "x processes by round 1.00 (worst 1.00)" in lines[0]
    broken = subprocess.run(
        [sys.executable, script, os.path.join(folder, "missing"), "--rounds", "1",
         "--samples", "4"], env=env, capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0 and "processes failed" in broken.stderr
