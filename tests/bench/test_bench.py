"""``asyncfeed bench``: the quick run end to end, and the pieces it is made of.

No timing is asserted: only that every contender ran (or is reported skipped
with a reason), that the JSON holds every figure, and that nothing is left
running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from asyncfeed._bench import synthetic as _synthetic
from asyncfeed._bench import contenders
from asyncfeed._bench.child import _slope
from asyncfeed._bench.report import QUICK_NOTICE
from asyncfeed._bench.runner import Bench, Settings, default_threads, default_workers
from asyncfeed._bench.tuning import knee
from asyncfeed._bench.workloads import gil_bound_transform, sample_order

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


# the quick run takes 20-30 s on an idle 2-core machine, several times that when the
# machine is shared: the tests that wait for it get more than the default 120 s
pytestmark = pytest.mark.timeout(300)


#: every workload: a user's ``--quick`` runs (a) only, the tests smoke-run them all
ALL_WORKLOADS = "a,b,c,d,e,f,g,overhead,ceiling"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One real ``asyncfeed bench --quick`` of every workload in a subprocess (about
    15-30 s on 2 cores)."""
    tmp = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env["TMPDIR"] = str(tmp)  # the fork server's working folder lands here: see no_leftovers
    env["ASYNCFEED_CACHE"] = str(tmp / "cache")
    out_json, out_png = tmp / "out.json", tmp / "out.png"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncfeed._bench.cli", "bench", "--quick", "--workloads",
         ALL_WORKLOADS, "--json", str(out_json), "--plot", str(out_png)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=280)
    data = json.loads(out_json.read_text()) if out_json.exists() else None
    return {"proc": proc, "json": data, "png": out_png, "tmp": tmp}


def test_quick_run_succeeds(quick):
    proc = quick["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for head in ("(a) JPEG folder", "(b) data set held in RAM", "(c) pure-Python",
                 "(d) time to first batch", "(e) the folder on remote storage", "limit"):
        assert head in proc.stdout
    assert "asyncfeed bench" in proc.stderr  # the progress bar


def test_every_contender_ran_or_is_skipped_with_a_reason(quick):
    data = quick["json"]
    ran = {c["family"] for c in data["runs"]["a"] if c["runs"] and all(r["ok"] for r in c["runs"])}
    for fam in contenders.FAMILIES:
        if fam in data["skipped"]:
            assert data["skipped"][fam], f"{fam} skipped without a reason"
        else:
            assert fam in ran, f"{fam} neither ran nor was reported skipped"
    # every configuration of every workload ran, and ran without error
    for wl, cfgs in data["runs"].items():
        for cfg in cfgs:
            assert cfg["runs"], f"{wl}: {cfg['label']} never ran"
            for run in cfg["runs"]:
                assert run["ok"], f"{wl}: {cfg['label']}: {run.get('error')}"


def test_json_holds_every_figure(quick):
    data = quick["json"]
    for key in ("cores_usable", "memory_bytes", "python", "torch", "cuda", "versions"):
        assert key in data["machine"]
    assert data["settings"]["quick"] is True
    assert data["data"]["n_images"] > 0 and data["data"]["mean_bytes"] > 0
    summ = data["summary"]
    assert set(summ) >= {"a", "step", "b", "c", "d", "e"}
    for row in summ["a"]:
        for fig in ("rate", "cpu_per_sample_ms", "peak_rss_sum_bytes"):
            assert row[fig] is not None and row[fig] > 0, (row["label"], fig)
        if row["family"] != "limit":
            assert row["ttfb_s"] > 0 and row["peak_pss_bytes"] > 0 and row["vs_limit"] > 0
    assert any(r["family"] == "limit" for r in summ["a"])
    for row in summ["step"]:
        assert 0 <= row["wait_fraction"] <= 1
    for row in summ["b"]:
        if row["family"] != "limit":
            assert row["peak_pss_bytes"] > 0 and row["memory_vs_w0"] > 0
    for row in summ["d"]:
        assert row["ttfb_s"] > 0 and row["ttfb_vs_fork"] > 0 and row["ttfb_vs_spawn"] > 0
    assert {r["context"] for r in summ["d"] if r["family"] == "dataloader"} == {"fork", "spawn"}
    for row in summ["e"]:
        assert row["rate"] > 0 and row["vs_dataloader_ref"] > 0
        if row["dataset"] == "remote":  # against the same loader at zero latency
            assert row["vs_zero_latency"] > 0
    assert {r["dataset"] for r in summ["e"]} == {"remote", "remote0"}
    # the raw figures of every run are there, not only the medians
    run = data["runs"]["a"][1]["runs"][0]
    for fig in ("arrivals_s", "batch_waits_s", "cpu_user_s", "cpu_sys_s", "pss_samples",
                "other_load", "samples", "sample_shape"):
        assert fig in run
    assert run["sample_shape"][:3] == [3, 224, 224]
    assert data["tuning"]["a"]  # the tuning curves and their knees
    for fam, t in data["tuning"]["a"].items():
        assert t["knee"]["knob"] in [p[0] for p in t["points"]]


def test_plot_is_a_png(quick):
    png = quick["png"]
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_left_running(quick):
    assert quick["proc"].returncode is not None
    tmp = str(quick["tmp"])
    deadline = time.monotonic() + 5
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                if (p.info["cwd"] or "").startswith(tmp) and p.pid != os.getpid():
                    left.append((p.pid, p.info["cmdline"]))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind by the benchmark: {left}"


# -- the pieces ------------------------------------------------------------------------

def test_knee_is_the_first_setting_within_five_percent():
    assert knee([(0, 100), (1, 300), (2, 580), (4, 600)])["knob"] == 2
    assert knee([(1, 500), (2, 400)])["knob"] == 1
    assert knee([]) is None


def test_steady_rate_is_the_slope():
    times = [0.1 * i for i in range(1, 11)]
    assert _slope(times, [32] * 10) == pytest.approx(320.0)
    assert _slope([0.1, 0.2], [1, 1]) is None


def test_steady_against_the_limit_is_the_steady_rate_over_the_limits():
    """(a)'s "steady x limit": the limit's rate is a row's rate over its x limit."""
    from asyncfeed._bench.report import _steady_vs_limit
    row = {"family": "asyncfeed", "rate": 860.0, "vs_limit": 0.91, "steady_rate": 895.0}
    assert _steady_vs_limit(row) == pytest.approx(895.0 / (860.0 / 0.91))
    assert _steady_vs_limit({**row, "family": "limit"}) is None
    assert _steady_vs_limit({**row, "steady_rate": None}) is None


def test_sweeps_reach_twice_the_cores():
    assert default_workers(2) == (0, 1, 2, 4)
    assert default_threads(2) == (1, 2, 4)
    assert default_workers(8) == (0, 1, 2, 4, 8, 12, 16)


def test_sample_order_is_seeded_and_covers_the_set():
    a = sample_order(10, 25, seed=3)
    assert a == sample_order(10, 25, seed=3) and a != sample_order(10, 25, seed=4)
    assert sorted(a[:10]) == list(range(10)) and len(a) == 25


def test_gil_transform_keeps_shape_and_dtype():
    import torch
    img = torch.randint(40, 200, (3, 32, 32), dtype=torch.uint8)
    out = gil_bound_transform(img)
    assert out.shape == img.shape and out.dtype == torch.uint8
    assert int(out.max()) > 200 and int(out.min()) < 40  # stretched


def test_missing_contender_is_reported_skipped(monkeypatch, tmp_path):
    monkeypatch.setitem(contenders.REQUIRES, "spdl", "no_such_module_for_asyncfeed_tests")
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2))
    bench.plan()
    assert bench.skipped["spdl"].startswith("skipped (not installed)")
    assert all(c.family != "spdl" for cfgs in bench.configs.values() for c in cfgs)
    assert "dataloader" in bench.available


def test_synthetic_set_is_deterministic_and_regenerated_after_a_crash(tmp_path):
    root = _synthetic.ensure_synthetic(12, 3, root=str(tmp_path), workers=1)
    assert _synthetic.is_complete(root)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".JPEG"))
    assert len(files) == 12 and len(os.listdir(root)) == 3 + 2  # classes, marker, summary
    first = open(files[0], "rb").read()
    assert first[:3] == b"\xff\xd8\xff"
    again = _synthetic.ensure_synthetic(12, 3, root=str(tmp_path), workers=1)
    assert again == root
    os.remove(os.path.join(root, _synthetic.MARKER))  # as if generation had been cut short
    os.remove(files[0])
    root2 = _synthetic.ensure_synthetic(12, 3, root=str(tmp_path), workers=1)
    assert root2 == root and _synthetic.is_complete(root)
    assert open(files[0], "rb").read() == first  # same seed, same bytes
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_cli_rejects_unknown_workload(capsys):
    from asyncfeed._bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workloads", "a,z"])
    assert e.value.code == 2
    assert "unknown z" in capsys.readouterr().err


def _run(rate: float, cpu: float, pss: float, threads: int | None = None) -> dict:
    run = {"ok": True, "rate": rate, "cpu_per_sample_ms": cpu, "peak_pss_bytes": pss * 2**20,
           "other_load": 0.0}
    if threads is not None:
        run["loader_info"] = {"resolved_threads": threads}
    return run


def test_a_default_measured_again_explicitly_is_pooled_as_twins(tmp_path):
    """asyncfeed's default resolves to t=4 here: the two rows are one configuration, and
    the report also gives the median over both rows' runs."""
    from asyncfeed._bench.config import Config
    from asyncfeed._bench.report import render
    bench = Bench(Settings(root=str(tmp_path), synthetic=True, cores=2))
    lim = Config("a", "limit", 2, mode="limit", role="limit",
                 runs=[_run(r, 2.8, 222) for r in (600, 650, 700)])
    dl = Config("a", "dataloader", 2, runs=[_run(r, 3.2, 285) for r in (550, 560, 570)])
    dflt = Config("a", "asyncfeed", None, role="default",
                  runs=[_run(r, c, 270, threads=4) for r, c in ((600, 3.1), (610, 3.0), (700, 2.7))])
    t4 = Config("a", "asyncfeed", 4, runs=[_run(r, c, 272) for r, c in ((680, 2.75), (690, 2.7),
                                                                         (560, 3.3))])
    t2 = Config("a", "asyncfeed", 2, runs=[_run(640, 2.9, 268)])
    bench.configs["a"] = [lim, dl, dflt, t4, t2]
    results = bench.results()
    (twin,) = results["twins"]
    assert (twin["label"], twin["twin"], twin["runs_in_median"]) == (
        dflt.label, t4.label, 6)
    assert twin["rate"] == 645 and twin["vs_limit"] == pytest.approx(645 / 650)
    assert twin["cpu_per_sample_ms"] == pytest.approx(2.875)
    assert twin["cpu_vs_w2"] == pytest.approx(2.875 / 3.2)
    results.update(machine={"cores_usable": 2, "cpu_model": "x", "memory_bytes": 2**30,
                            "python": "3", "torch": "2"}, data={})
    text = render(results)
    assert ("asyncfeed t=default and asyncfeed t=4 are the same configuration; over both "
            "rows' 6 runs: 645/s (0.99 of the limit), 2.88 ms CPU/sample (0.90x w=2)") in text


def test_quick_run_has_the_added_workloads_and_a_headline(quick):
    out, data = quick["proc"].stdout, quick["json"]
    for head in ("headline:", "(f) CIFAR-like", "(g) PIL decode", "(overhead)", "(ceiling)"):
        assert head in out
    summ = data["summary"]
    assert set(summ) >= {"f", "g", "ceiling", "overhead"}
    assert {h["workload"] for h in data["headline"]} >= {"a", "b", "c", "e", "f", "g",
                                                          "ceiling", "overhead"}
    for h in data["headline"]:
        assert h["rate"] > 0 and h["ratio"] > 0, h
    for row in summ["ceiling"]:
        assert row["ideal_rate"] == row["knob"] / 0.005 and row["vs_ideal"] > 0


def test_a_smoke_run_says_so_last_and_under_every_table(quick):
    """Its ratios are start-up costs: the notice is the last thing printed (after the JSON
    and plot paths), and every workload's table ends with who led, marked a smoke run."""
    out = quick["proc"].stdout.rstrip()
    assert out.endswith(QUICK_NOTICE), out[-600:]
    assert out.count(QUICK_NOTICE) == 1
    leads = [line for line in out.splitlines() if line.startswith("led: ")]
    assert len(leads) == len(quick["json"]["summary"]), leads  # one per workload table
    for line in leads:
        assert line.endswith("; a smoke run (--quick): not a comparison"), line
        assert re.search(r"(\d\.\d\dx the (rate|time) of|against) the best other loader",
                         line) or "no other loader" in line, line


def test_quick_alone_runs_workload_a_only_and_writes_no_png():
    from asyncfeed._bench.cli import _parser, _plot_path, _workloads
    args = _parser().parse_args(["bench", "--quick"])
    assert _workloads(args) == ("a",) and _plot_path(args) is None
    args = _parser().parse_args(["bench", "--quick", "--workloads", "a,c", "--plot", "x.png"])
    assert _workloads(args) == ("a", "c") and _plot_path(args) == "x.png"
    args = _parser().parse_args(["bench"])
    assert "e" in _workloads(args) and _plot_path(args) == "asyncfeed-bench.png"


def _rows(*rows: tuple) -> list[dict]:
    return [dict(zip(("label", "family", "dataset", "rate"), r)) for r in rows]


def test_lead_line_names_the_leader_and_the_best_other_loader():
    from asyncfeed._bench.report import lead_line
    rows = _rows(("limit", "limit", "folder", 900.0), ("DataLoader w=2", "dataloader", "folder", 400.0),
                 ("asyncfeed t=4", "asyncfeed", "folder", 500.0),
                 ("asyncfeed map-style", "asyncfeed-map", "folder", 450.0))
    assert lead_line("a", rows, quick=False) == (
        "led: asyncfeed t=4 (500/s), 1.25x the rate of the best other loader, "
        "DataLoader w=2 (400/s); a full run")
    rows[1]["rate"] = 600.0
    assert lead_line("a", rows, quick=True).startswith(
        "led: DataLoader w=2 (600/s), 1.20x the rate of the best other loader, asyncfeed t=4")
    ttfb = [{"label": "DataLoader w=2 fork", "family": "dataloader", "dataset": "folder",
             "ttfb_s": 0.2}, {"label": "asyncfeed", "family": "asyncfeed",
                              "dataset": "folder", "ttfb_s": 0.1}]
    assert lead_line("d", ttfb, quick=False).startswith(
        "led: asyncfeed (0.100 s), 0.50x the time of the best other loader")


def test_help_has_no_markup(capsys):
    from asyncfeed._bench.cli import main
    for argv in ([], ["bench", "--help"], ["profile", "--help"]):
        try:
            main(argv if argv else ["--help"])
        except SystemExit:
            pass
        text = capsys.readouterr().out
        assert "usage: asyncfeed" in text and "``" not in text and ":mod:" not in text, text


ROOT = os.path.dirname(SRC)


def test_the_benchmarks_page_is_generated_from_the_committed_json(capsys):
    """docs/benchmarks.md is what --markdown makes of docs/benchmarks-2core.json, a
    reference of at most about 250 lines with the machine, the command and a table and
    a lead line per workload."""
    from asyncfeed._bench.cli import main
    json_path = os.path.join("docs", "benchmarks-2core.json")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["bench", "--markdown", json_path]) == 0
    finally:
        os.chdir(cwd)
    page = capsys.readouterr().out
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert f.read() == page, "docs/benchmarks.md is stale: regenerate it with --markdown"
    # about 250 lines for the workloads (with the training-augmentation one and its
    # torchvision rows), the outcome bench's table after them (two rows and two lines
    # of choices for each of its ten data sets), and its stability table (two rows a
    # set)
    assert len(page.splitlines()) <= 370
    assert "## The execution choice on data sets written as users write them" in page
    assert "## How stable the choice is" in page
    data = json.load(open(os.path.join(ROOT, json_path)))
    assert "## Results: 2 cores" in page and "asyncfeed bench --markdown" in page
    assert page.count("\nLed: ") == len(data["summary"])
    assert not re.search(r"20\d\d-\d\d-\d\d|[Ii]ssue \d|\b[0-9a-f]{10,40}\b", page)


def test_markdown_of_a_missing_json_is_a_clear_error(tmp_path, capsys):
    from asyncfeed._bench.cli import main
    assert main(["bench", "--markdown", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_published_json_has_no_private_fields(quick):
    """A loader's private stats fields are not figures: the JSON leaves them out."""
    def keys(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from keys(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from keys(v)
    assert not [k for k in keys(quick["json"]) if str(k).startswith("_")]
    with open(os.path.join(ROOT, "docs", "benchmarks-2core.json")) as f:
        assert not [k for k in keys(json.load(f)) if str(k).startswith("_")]
