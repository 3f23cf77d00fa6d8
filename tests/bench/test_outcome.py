"""The outcome bench (``bench/outcome.py``): its data sets, its figures, and a quick run
end to end.

No timing is asserted: the data sets are deterministic and collate to the shapes their
docstrings give, the summary pairs rounds as documented, and a quick run measures every
contender in its own process and leaves nothing running.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from asyncfeed import AsyncLoader
from asyncfeed._bench import userdata
from asyncfeed._bench.neighbour import busy_neighbour
from asyncfeed._bench.outcome_report import (execution_key, markdown, stability_markdown,
                                              summarise)
from asyncfeed._bench.outcome_round import batch_len, execute, execution_fields
from asyncfeed._bench.workloads import build_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
SCRIPT = os.path.join(ROOT, "bench", "outcome.py")


def _equal(a, b) -> bool:
    """Deep equality of samples (tensors, dicts, tuples, plain values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


# ------------------------------------------------------------------ data sets

@pytest.mark.parametrize("name", list(userdata.DATASETS))
def test_every_set_is_deterministic_per_index(name, tmp_path):
    one = userdata.build(name, quick=True, workdir=str(tmp_path), seed=3)
    two = userdata.build(name, quick=True, workdir=str(tmp_path), seed=3)
    other = userdata.build(name, quick=True, workdir=str(tmp_path), seed=4)
    spec = userdata.DATASETS[name]
    assert len(one.order) == spec.quick_samples and one.order == two.order
    assert one.batch_size == spec.batch_size
    assert set(one.order) <= set(range(len(one.dataset)))
    picks = sorted(set(one.order))[:: max(1, len(set(one.order)) // 8)]
    for i in picks:
        assert _equal(one.dataset[i], two.dataset[i]), f"{name}[{i}] differs between builds"
        assert _equal(one.dataset[i], one.dataset[i]), f"{name}[{i}] differs between calls"
    assert not all(_equal(one.dataset[i], other.dataset[i]) for i in picks), \
        f"{name}: the seed changes nothing"


@pytest.mark.parametrize("name", list(userdata.DATASETS))
def test_dataloader_collates_every_set(name, tmp_path):
    built = userdata.build(name, quick=True, workdir=str(tmp_path))
    kwargs = {"collate_fn": built.collate_fn} if built.collate_fn else {}
    loader = DataLoader(built.dataset, batch_size=built.batch_size, sampler=built.order, **kwargs)
    sizes = [batch_len(b) for b in loader]
    assert sum(sizes) == len(built.order) and sizes[0] == min(built.batch_size, len(built.order))


def test_detection_samples_and_collate():
    ds = userdata.DetectionSet(40, seed=1)
    counts = [len(b) for b in ds.boxes]
    assert min(counts) >= 0 and max(counts) <= 20 and len(set(counts)) > 1
    flipped = [i for i in range(40) if userdata._coin(1, i)]
    assert 0 < len(flipped) < 40
    for i in range(40):
        s = ds[i]
        assert s["image"].shape == (3, 96, 96) and s["image"].dtype == torch.uint8
        assert s["boxes"].shape == (counts[i], 4) and s["boxes"].dtype == torch.float32
        assert s["image_id"] == f"img_01_{i:06d}"
        if counts[i]:
            assert bool((s["boxes"][:, 0] < s["boxes"][:, 2]).all())
            assert bool((s["boxes"] >= 0).all() and (s["boxes"] <= 96).all())
        raw = torch.from_numpy(ds.images[i])
        assert torch.equal(s["image"], raw.flip(-1) if i in flipped else raw)
    i = next(k for k in flipped if counts[k])
    x0 = torch.tensor(ds.boxes[i], dtype=torch.float32)[:, 0]
    assert torch.allclose(ds[i]["boxes"][:, 2], 96 - x0)
    batch = userdata.detection_collate([ds[k] for k in range(32)])
    assert batch["image"].shape == (32, 3, 96, 96) and batch["image"].dtype == torch.uint8
    assert [len(b) for b in batch["boxes"]] == counts[:32]
    assert batch["image_id"] == [f"img_01_{k:06d}" for k in range(32)]


def test_text_tokenises_in_python_and_pads_to_the_longest():
    ds = userdata.TextLines(200, seed=2)
    line = ds.lines[7]
    words = line.lower().replace(",", " ,").replace(".", " .").split()
    s = ds[7]
    assert s["input_ids"].tolist() == ([userdata.BOS] + [ds.vocab.get(w, userdata.UNK)
                                                         for w in words] + [userdata.EOS])
    assert s["label"] == ds.labels[7]
    ids = torch.cat([ds[i]["input_ids"] for i in range(200)])
    assert bool((ids == userdata.UNK).any())  # some words are not in the vocabulary
    samples = [ds[i] for i in range(64)]
    lengths = [len(x["input_ids"]) for x in samples]
    assert len(set(lengths)) > 1
    batch = userdata.pad_collate(samples)
    assert batch["input_ids"].shape == (64, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, x in enumerate(samples):
        n = lengths[row]
        assert torch.equal(batch["input_ids"][row, :n], x["input_ids"])
        assert bool((batch["input_ids"][row, n:] == userdata.PAD).all())
    assert batch["labels"].tolist() == [x["label"] for x in samples]


def test_cifar_rng_crops_a_window_of_the_padded_image_per_sample_generator():
    ds = userdata.CifarRng(16, seed=5)
    img, label = ds[3]
    assert img.shape == (3, 32, 32) and img.dtype == torch.uint8 and img.is_contiguous()
    assert int(label) == int(ds.labels[3])
    padded = np.pad(ds.images[3], ((4, 4), (4, 4), (0, 0))).transpose(2, 0, 1)
    rng = np.random.default_rng((5, 3))
    dy, dx = rng.integers(0, 9, 2)
    want = padded[:, dy:dy + 32, dx:dx + 32]
    if rng.random() < 0.5:
        want = want[:, :, ::-1]
    assert np.array_equal(img.numpy(), want)
    batch = default_collate([ds[i] for i in range(16)])
    assert batch[0].shape == (16, 3, 32, 32) and batch[1].shape == (16,)


def test_npy_files_are_written_once_and_cropped_and_normalised(tmp_path):
    root = userdata.ensure_npy_files(str(tmp_path), 6, seed=1)
    files = sorted(f for f in os.listdir(root) if f.endswith(".npy"))
    assert len(files) == 6
    stamp = os.stat(os.path.join(root, files[0])).st_mtime_ns
    assert userdata.ensure_npy_files(str(tmp_path), 6, seed=1) == root
    assert os.stat(os.path.join(root, files[0])).st_mtime_ns == stamp  # not rewritten
    ds = userdata.NpyFiles(root, seed=1)
    x, label = ds[2]
    assert x.shape == (3, 160, 160) and x.dtype == torch.float32 and label == 2
    arr = np.load(os.path.join(root, files[2]))
    assert arr.shape == userdata.NPY_SHAPE and arr.dtype == np.uint8
    lo = ((arr.astype(np.float32) / 255 - userdata._MEAN.reshape(1, 1, 3))
          / userdata._STD.reshape(1, 1, 3)).transpose(2, 0, 1)
    found = [(t, left) for t in range(33) for left in range(33)
             if np.allclose(lo[:, t:t + 160, left:left + 160], x.numpy(), atol=1e-5)]
    assert found, "the sample is not a normalised 160x160 crop of its file"


def test_gil_free_rows_are_the_sha256_of_their_window():
    ds = userdata.HashChunks(8, seed=0, chunk=64 << 10, buffer=1 << 20)
    digest, head = ds[5]
    start = (5 * ds.stride) % (len(ds.buffer) - ds.chunk)
    window = ds.buffer[start:start + ds.chunk].tobytes()
    assert bytes(digest.numpy()) == hashlib.sha256(window).digest()
    assert bytes(head.numpy()) == window[:4096]


def test_gil_bound_rows_are_pure_python_features():
    feats = userdata.python_features(11, 500)
    assert feats == userdata.python_features(11, 500) and len(feats) == 8
    assert 0 < feats[0] < 1 and feats[-1] == 500.0
    x, label = userdata.PythonRows(4, seed=2, length=500)[3]
    assert x.dtype == torch.float32 and x.shape == (8,) and label == 3
    assert x.tolist() == pytest.approx(userdata.python_features(2 * 1_000_003 + 3, 500))


def test_audio_rows_are_the_log_spectrogram_of_a_per_sample_crop():
    """Written out by hand for one index: the crop and gain from the sample's own
    generator, Hann frames of 400 samples every 160, the rfft's magnitude, log1p."""
    ds = userdata.AudioClips(6, seed=3, clips=4)
    spec, label = ds[5]
    rng = np.random.default_rng((3, 5))
    start = int(rng.integers(0, 8001))
    wave = ds.waves[1, start:start + 8000] * np.float32(rng.uniform(0.5, 1.5))
    frames = np.stack([wave[k:k + 400] for k in range(0, 8000 - 400 + 1, 160)])
    want = np.log1p(np.abs(np.fft.rfft(frames * np.hanning(400).astype(np.float32), axis=1)))
    assert spec.dtype == torch.float32 and spec.shape == (48, 201) and label == 5
    np.testing.assert_allclose(spec.numpy(), want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(ds[1][0], spec)  # same clip, its own crop and gain


def test_phased_order_runs_every_cheap_sample_before_the_costly_ones():
    ds = userdata.PhasedCost(40, 8, seed=1, length=300)
    order = ds.order(1)
    assert sorted(order[:40]) == list(range(40)) and sorted(order[40:]) == list(range(40, 48))
    assert order[:40] != list(range(40))  # shuffled within each phase
    cheap, costly = ds[order[0]], ds[order[-1]]
    assert cheap[0].shape == costly[0].shape == (3, 32, 32)
    assert cheap[0].dtype == costly[0].dtype == torch.uint8
    assert torch.equal(cheap[0], ds.rows[order[0] % len(ds.rows)][0])


def test_sample_order_and_unknown_names():
    order = userdata.sample_order(5, 12, seed=0)
    assert len(order) == 12 and sorted(order[:5]) == list(range(5)) and order[5:10] == order[:5]
    with pytest.raises(ValueError, match="'nope'"):
        userdata.build("nope")


def test_pinned_kwargs_fix_the_loader_to_one_candidate():
    """The bench scripts pin a candidate with these keywords, and the loader then runs
    it (its execution report names that mode and count)."""
    assert userdata.pinned_kwargs("inline", 0) == {"execution": "inline"}
    assert userdata.pinned_kwargs("threads", 3) == {"execution": "threads", "num_threads": 3}
    assert userdata.pinned_kwargs("processes", 2) == {"execution": "processes",
                                                      "num_workers": 2}
    b = userdata.build("detection", quick=True)
    with AsyncLoader(b.dataset, batch_size=b.batch_size, sampler=b.order[:64],
                     collate_fn=b.collate_fn, **userdata.pinned_kwargs("threads", 3)) as loader:
        for _ in loader:
            pass
        ex = loader.stats().execution
    assert (ex.mode.value, ex.count) == ("threads", 3)


def test_the_bench_workloads_build_the_user_sets_by_name(tmp_path):
    ds, order = build_dataset({"kind": "text", "quick": True, "workdir": str(tmp_path)})
    built = userdata.build("text", quick=True)
    assert isinstance(ds, userdata.TextLines) and order == built.order


# -------------------------------------------------------------- one round, in process

def test_a_round_runs_every_epoch_and_records_the_execution(tmp_path):
    dl = execute({"dataset": "detection", "quick": True, "family": "dataloader", "workers": 0,
                  "epochs": 2, "workdir": str(tmp_path)})
    assert [e["epoch"] for e in dl["epochs"]] == [1, 2]
    assert all(e["rate"] > 0 and "execution" not in e for e in dl["epochs"])
    af = execute({"dataset": "detection", "quick": True, "family": "asyncfeed",
                  "epochs": 2, "workdir": str(tmp_path)})
    assert dl["samples"] == af["samples"] == userdata.DATASETS["detection"].quick_samples
    assert all(e["execution"] and execution_key(e) != "?" for e in af["epochs"])


class _Mode(enum.Enum):
    THREADS = "threads"


@dataclass
class _Measured:
    candidate: str
    rate: float


@dataclass
class _Execution:
    mode: _Mode
    count: int
    reason: _Mode
    candidates: tuple[_Measured, ...] = ()

    def __str__(self) -> str:
        return "threads: 3 of 4 running"


def test_execution_fields_and_key_read_a_dataclass_or_the_sentence():
    fields = execution_fields(_Execution(_Mode.THREADS, 3, _Mode.THREADS,
                                         (_Measured("inline", 10.5),)))
    assert fields == {"execution": "threads: 3 of 4 running", "mode": "threads", "count": 3,
                      "reason": "threads",
                      "candidates": [{"candidate": "inline", "rate": 10.5}]}
    assert execution_key(fields) == "threads(3)"
    assert execution_key({"mode": "inline", "count": 0}) == "inline"
    assert execution_fields("threads: 8 (pinned)") == {"execution": "threads: 8 (pinned)"}
    for text, key in (("processes: 2 workers (rows hold the GIL)", "processes(2)"),
                      ("threads: 1 of 4 running (adaptive)", "threads(1)"),
                      ("threads: 8 (pinned)", "threads(8)"),
                      ("threads: none running, the consumer loads while it waits (x)", "inline")):
        assert execution_key({"execution": text}) == key


def test_batch_len_reads_dicts_tuples_and_tensors():
    assert batch_len({"image": torch.zeros(5, 3), "ids": ["a"] * 5}) == 5
    assert batch_len((torch.zeros(7, 2), torch.zeros(7))) == 7
    assert batch_len(torch.zeros(4, 1)) == 4


# --------------------------------------------------------------------- the summary

def _round(n, family, workers, rates, execution=None):
    epochs = [{"epoch": k + 1, "rate": r} for k, r in enumerate(rates)]
    if execution:
        for e in epochs:
            e["execution"] = execution
    return {"dataset": "x", "condition": "quiet", "round": n, "family": family,
            "workers": workers, "ok": True, "epochs": epochs}


def _three_rounds() -> list[dict]:
    rounds = []
    for n, (w0, w2, first, steady) in enumerate([(100, 90, 80, 120), (110, 95, 110, 110),
                                                  (90, 100, 99, 90)]):
        rounds += [_round(n, "dataloader", 0, [w0, w0 + 10]),
                   _round(n, "dataloader", 2, [w2, w2]),
                   _round(n, "asyncfeed", None, [first, steady, steady + 20],
                          "processes: 2 workers (x)" if n == 2 else "threads: 2 of 4 running")]
    return rounds


def test_summary_pairs_asyncloader_with_the_best_setting_in_the_same_round():
    s = summarise(_three_rounds())
    assert s["best_dl_first"] == "w=0" and s["best_dl_later"] == "w=0"
    assert s["first"]["ratios"] == pytest.approx([0.8, 1.0, 1.1])
    assert s["first"]["ratio_median"] == pytest.approx(1.0)
    assert s["first"]["ratio_worst"] == pytest.approx(0.8)
    assert s["first"]["slowest_over_median"] == pytest.approx(80 / 99)
    assert s["steady"]["ratios"] == pytest.approx([130 / 110, 120 / 120, 100 / 100])
    assert s["executions"]["most_common"] == "threads(2)"
    assert s["executions"]["most_common_rounds"] == 2
    table = markdown([{"dataset": "x", "condition": "neighbour", **s}])
    assert "| x | yes | w=0 100/s | 99/s | **1.00x** (0.80x) |" in table
    assert "threads(2) (2/3)" in table and "- x (neighbour): threads(2), threads(2), processes(2)" \
        in table


def test_summary_reads_the_best_setting_against_its_own_median():
    """The floor of the paired ratios: the best DataLoader setting's slowest round over
    its median (w=0: first epochs 100, 110, 90; later 110, 120, 100), beside
    AsyncLoader's (first 80, 110, 99; steady 130, 120, 100)."""
    s = summarise(_three_rounds())
    assert s["first"]["dl_slowest_over_median"] == pytest.approx(0.9)
    assert s["steady"]["dl_slowest_over_median"] == pytest.approx(100 / 110)
    table = markdown([{"dataset": "x", "condition": "quiet", **s}])
    assert "| 0.81, 0.83 (0.90, 0.91) |" in table
    old = {**s, "first": {k: v for k, v in s["first"].items() if k != "dl_slowest_over_median"}}
    assert "| 0.81, 0.83 (-, 0.91) |" in markdown([{"dataset": "x", "condition": "quiet", **old}])


@pytest.mark.timeout(60)
def test_report_summarises_stored_rounds_again_and_keeps_the_rest(tmp_path):
    """``--report`` runs nothing: a bench file's stored rounds get today's summary and
    table; its other keys stay as they were."""
    rounds = _three_rounds()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"settings": {"repeats": 3},
                                "outcome": {"argv": ["outcome.py"], "rounds": rounds,
                                            "summary": [], "table": "stale"}}))
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, SCRIPT, "--report", str(path)], env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert data["settings"] == {"repeats": 3} and data["outcome"]["rounds"] == rounds
    [summary] = data["outcome"]["summary"]
    assert (summary["dataset"], summary["condition"]) == ("x", "quiet")
    assert summary["first"]["ratios"] == pytest.approx([0.8, 1.0, 1.1])
    assert "| x | no | w=0 100/s | 99/s | **1.00x** (0.80x) |" in data["outcome"]["table"]
    assert "(0.90, 0.91)" in proc.stdout


def test_summary_reports_failed_rounds_and_survives_a_missing_contender():
    rounds = [_round(0, "dataloader", 0, [100]),
              {**_round(0, "asyncfeed", None, []), "ok": False, "error": "boom"}]
    s = summarise(rounds)
    assert "first" not in s and any("boom" in f for f in s["failed"])
    table = markdown([{"dataset": "x", "condition": "quiet", **s}])
    assert "no AsyncLoader/DataLoader pair" in table and "FAILED rounds" in table


def _alone() -> list[dict]:
    """Four rounds of AsyncLoader alone (``--workers ""``): three chose threads(2)."""
    runs = [([80, 120, 140], "threads: 2 of 4 running"), ([100, 100, 100], "threads: 2"),
            ([90, 110, 110], "processes: 2 workers (x)"), ([120, 90, 90], "threads: 2")]
    return [_round(n, "asyncfeed", None, rates, execution)
            for n, (rates, execution) in enumerate(runs)]


def test_asyncloader_alone_reports_how_stable_its_choice_is():
    """Without DataLoader rounds there is no ratio, but the executions and
    AsyncLoader's own medians and slowest round over them: first epochs 80, 100, 90,
    120 (median 95); steady 130, 100, 110, 90 (median 105)."""
    s = summarise(_alone())
    assert "first" not in s and "steady" not in s
    assert s["executions"]["most_common"] == "threads(2)"
    assert s["executions"]["most_common_rounds"] == 3
    assert s["own"]["first"] == pytest.approx({"median": 95, "slowest_over_median": 80 / 95})
    assert s["own"]["steady"] == pytest.approx({"median": 105, "slowest_over_median": 90 / 105})
    table = stability_markdown([{"dataset": "x", "condition": "neighbour", **s}])
    assert "| x | yes | **threads(2)** (3/4) | processes(2) (1) | threads(2) (3), processes(2) " \
        "(1) | 95/s (0.84) | 105/s (0.86) |" in table
    # and with DataLoader rounds, the comparison keeps them too
    assert summarise(_three_rounds())["own"]["first"]["median"] == 99


@pytest.mark.timeout(60)
def test_report_summarises_a_stored_stability_run_with_its_own_table(tmp_path):
    """``--report`` on a bench file with both keys writes each its own table: the
    comparison's and AsyncLoader alone's."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"outcome": {"rounds": _three_rounds(), "table": "stale"},
                                "stability": {"rounds": _alone(), "table": "stale"}}))
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, SCRIPT, "--report", str(path)], env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert "**1.00x** (0.80x)" in data["outcome"]["table"]
    assert "**threads(2)** (3/4)" in data["stability"]["table"]


@pytest.mark.timeout(120)
def test_a_run_of_asyncloader_alone_goes_under_the_stability_key(tmp_path):
    """``--workers ""`` runs AsyncLoader alone (not even the more workers a set's
    user would try: ``slow-reads``' 8 and 16) and ``--into`` stores it under
    ``stability``, leaving the comparison under ``outcome`` as it was."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"outcome": {"table": "kept"}}))
    env = dict(os.environ, PYTHONPATH=SRC, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--rounds", "2", "--epochs", "2", "--workers", "",
         "--datasets", "detection,slow-reads", "--into", str(bench),
         "--workdir", str(tmp_path / "w")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(bench.read_text())
    assert data["outcome"] == {"table": "kept"}
    rounds = data["stability"]["rounds"]
    assert len(rounds) == 4 and {r["family"] for r in rounds} == {"asyncfeed"}
    assert "| detection | no | **" in data["stability"]["table"]


# ------------------------------------------------------------- the quick run, end to end

@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``bench/outcome.py --quick`` over two sets, with the neighbour (10-30 s)."""
    tmp = tmp_path_factory.mktemp("outcome")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env["TMPDIR"] = str(tmp)
    out = tmp / "out.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--rounds", "1", "--epochs", "2", "--dl-epochs", "1",
         "--datasets", "detection,phased", "--neighbour", "--json", str(out),
         "--workdir", str(tmp / "work")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=100)
    return {"proc": proc, "json": json.loads(out.read_text()) if out.exists() else None,
            "tmp": tmp}


@pytest.mark.timeout(120)
def test_quick_run_measures_every_contender_in_its_own_process(quick):
    proc, data = quick["proc"], quick["json"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--quick: tiny data sets" in proc.stdout and "| detection | yes |" in proc.stdout
    rounds = data["rounds"]
    assert len(rounds) == 2 * 2 * 4 and all(r["ok"] for r in rounds)
    for r in rounds:
        want = 2 if r["family"] == "asyncfeed" else 1
        assert len(r["epochs"]) == want and all(e["rate"] > 0 for e in r["epochs"])
        if r["family"] == "asyncfeed":
            assert all(e["execution"] for e in r["epochs"])
        assert (r["neighbour_pid"] is not None) == (r["condition"] == "neighbour")
    assert {(r["family"], r["workers"]) for r in rounds} == {
        ("dataloader", 0), ("dataloader", 2), ("dataloader", 4), ("asyncfeed", None)}
    assert [(s["dataset"], s["condition"]) for s in data["summary"]] == [
        ("detection", "quiet"), ("detection", "neighbour"), ("phased", "quiet"),
        ("phased", "neighbour")]
    for s in data["summary"]:
        assert s["first"]["ratio_worst"] > 0 and s["steady"]["ratio_worst"] > 0
        assert s["executions"]["most_common_rounds"] == 1


@pytest.mark.timeout(120)
def test_quick_run_leaves_no_process_or_folder_behind(quick):
    data = quick["json"]
    assert data is not None, quick["proc"].stderr[-3000:]
    for pid in {r["neighbour_pid"] for r in data["rounds"] if r["neighbour_pid"]}:
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        assert "while True: pass" not in cmd, f"neighbour {pid} still running"
    assert not [p for p in os.listdir(quick["tmp"]) if p.startswith("asyncfeed-outcome-runs-")]


def test_device_script_runs_every_set_into_one_outcome_file(tmp_path):
    """``bench/outcome_device.sh`` (what the device tool runs on a many-core machine),
    as a smoke test: every set's round lands in one merged, re-summarised file."""
    script = os.path.join(os.path.dirname(SCRIPT), "outcome_device.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, QUICK="1")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "outcome.json").read_text())
    sets = {"gil-python", "text", "gil-free", "cifar-rng", "audio", "png-augment", "detection"}
    assert {r["dataset"] for r in doc["rounds"]} == sets
    assert {s["dataset"] for s in doc["summary"]} == sets
    assert not (tmp_path / "inflight.txt").exists()


@pytest.mark.timeout(120)
def test_pinned_rates_runs_each_candidate_beside_the_neighbour_and_leaves_none(tmp_path):
    """``bench/pinned_rates.py`` runs every candidate pinned, in its own process, each
    round, and prints one line per set and candidate; its neighbour is gone after."""
    script = os.path.join(os.path.dirname(SCRIPT), "pinned_rates.py")
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run(
        [sys.executable, script, "--datasets", "detection", "--candidates",
         "inline,threads:2,processes:2", "--rounds", "2", "--epochs", "2", "--quick",
         "--neighbour"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "detection inline 0", "detection threads 2", "detection processes 2"]
    assert all("first epoch" in line and "later epochs" in line for line in lines)
    busy = subprocess.run(["pgrep", "-f", "^[^ ]*python[^ ]* -c while True: pass$"],
                          capture_output=True, text=True)
    assert busy.returncode == 1, busy.stdout  # no busy loop left running
    bad = subprocess.run([sys.executable, script, "--candidates", "gpu:2"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown execution 'gpu'" in bad.stderr


@pytest.mark.timeout(120)
def test_explore_cost_counts_the_choices_after_the_epochs_asked(tmp_path):
    """``bench/explore_cost.py --choices-only --epochs N``: one auto run per round, its
    choice read after N epochs and tallied, with how many were still measuring."""
    script = os.path.join(os.path.dirname(SCRIPT), "explore_cost.py")
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run(
        [sys.executable, script, "--datasets", "detection", "--rounds", "2", "--epochs", "2",
         "--choices-only"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, *rounds = proc.stdout.splitlines()
    assert head.startswith("detection: choices after 2 epoch(s) ") and "still measuring)" in head
    assert "/2" in head and "pinned" not in proc.stdout
    # each mode's count, whatever the counts of threads or workers were
    assert re.search(r"\(by mode: (inline|threads|processes) [12]/2[;,]", head), head
    assert [r.split(":")[0].strip() for r in rounds] == ["round 0", "round 1"]


def test_the_busy_neighbour_runs_for_its_block_only_even_when_it_raises():
    """``busy_neighbour()``: a process loops while the block runs and is reaped when it
    ends, also by an exception; disabled, nothing runs."""
    with busy_neighbour(False) as none:
        assert none is None
    with pytest.raises(RuntimeError):
        with busy_neighbour() as proc:
            assert proc is not None and proc.poll() is None
            raise RuntimeError("the measurement failed")
    assert proc.returncode is not None  # killed and reaped, not left running


def test_the_benchmarks_page_shows_a_stored_stability_run_and_its_command():
    """The page's section for AsyncLoader alone: its table and the command that
    reruns it, the output flag replaced by ``--into results.json``; none without
    the key."""
    from asyncfeed._bench.markdown import _stability_section
    s = summarise(_alone())
    table = stability_markdown([{"dataset": "x", "condition": "quiet", **s}])
    lines = _stability_section({"stability": {
        "argv": ["bench/outcome.py", "--workers", "", "--rounds", "4", "--into", "b.json"],
        "table": table}})
    page = "\n".join(lines)
    assert page.startswith("## How stable the choice is")
    assert "PYTHONPATH=src python bench/outcome.py --workers '' --rounds 4 --into results.json" \
        in page
    assert "| x | no | **threads(2)** (3/4) |" in page
    assert _stability_section({}) == []
