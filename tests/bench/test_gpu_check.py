"""``bench/gpu_check.py`` on a machine without CUDA: the CPU-feasible parts run,
the GPU sections are reported skipped, and the correctness check can fail.

The real run is on a GPU machine (docs/gpu.md); here the correctness section
drives the loader's plain CPU path and its CUDA path (slot ring, copy,
hand-over) behind a simulated copy stream.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc():
    return load_gpu_check()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``gpu_check.py --quick`` in a subprocess (a few seconds on 2 cores)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    env["PYTHONUNBUFFERED"] = "1"
    args = [sys.executable, SCRIPT, "--quick", "--out", str(out)]
    if torch.cuda.is_available():
        args += ["--sections", "a"]
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    data = json.loads(out.read_text()) if out.exists() else None
    return {"proc": proc, "json": data, "seconds": seconds}


def test_quick_run_exits_0_and_writes_json(quick):
    proc = quick["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = quick["json"]
    assert doc is not None, "no JSON written"
    assert doc["tool"] == "asyncfeed gpu_check" and doc["quick"] is True
    assert doc["ok"] is True
    assert set(doc["sections"]) == {"correctness", "bandwidth", "overlap", "training"}
    assert doc["targets"] == {"bandwidth_ratio": 0.90, "overlap_wait_fraction": 0.02}
    assert "cores_usable" in doc["machine"] and doc["elapsed_s"] >= 0
    assert quick["seconds"] < 60, f"--quick took {quick['seconds']:.0f} s"


def test_quick_run_prints_the_table_last(quick):
    out = quick["proc"].stdout
    table = out[out.index("section"):]
    for head in ("(a) correctness", "(b) bandwidth", "(c) overlap", "(d) training", "JSON:"):
        assert head in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_sections_are_skipped_without_cuda(quick):
    doc = quick["json"]
    assert doc["cuda"] is False
    for name in ("bandwidth", "overlap", "training"):
        assert doc["sections"][name] == {"status": "skipped", "reason": "no CUDA"}
    assert "skipped (no CUDA)" in quick["proc"].stdout


def test_correctness_passed_on_both_paths(quick):
    c = quick["json"]["sections"]["correctness"]
    assert c["status"] == "passed", c.get("problems")
    assert c["bad_rows"] == 0 and c["batches_checked"] >= 60
    want = {"cuda"} if torch.cuda.is_available() else {"cpu", "sim"}
    assert {r["variant"] for r in c["runs"]} == want
    assert {r["mode"] for r in c["runs"]} == {"getitem", "decode_into", "fetch"}
    for r in c["runs"]:
        assert r["batches_checked"] > 0 and r["bad_rows"] == 0 and r["host_errors"] == 0
        if r["variant"] != "cpu":
            assert r["ring_slots"] == (1 if r["mode"] == "decode_into" else 2), \
                "the ring path was not exercised"
            # a pass is cut short (break): its slots are lost, the ring makes new ones
            assert r["ring_made"] > r["ring_slots"]
    ring_runs = [r for r in c["runs"] if r["variant"] != "cpu"]
    assert sum(r["slot_waits"] for r in ring_runs) > 0, \
        "no slot was ever needed while its copy ran: the stress did not reach the race"
    control, = c["negative_control"]
    assert control["expected_bad_rows"] > 0
    assert control["bad_rows"] == control["expected_bad_rows"]
    assert control["caught_every_unwritten_row"] is True


# --------------------------------------------------- the check must be able to fail
SMALL = dict(n_items=1024, shape=(3, 8, 8), batch=8, n_batches=120, passes=3, prefetch=2,
             threads=2, seed=3, max_kernel_cycles=1)


def test_check_catches_a_ring_that_does_not_wait_for_copies(gc, monkeypatch):
    from asyncfeed._memory import slots as _slots

    def acquire_without_waiting(self):
        with self._lock:
            slot = self._free.popleft() if self._free else self._new_slot()
            slot.free = False
        slot.event = None
        if self.poison is not None:
            _slots.fill_poison(slot.bufs, self.poison)
        return slot

    monkeypatch.setattr(_slots.SlotRing, "acquire", acquire_without_waiting)
    with gc.poisoned_slots(gc.POISON):
        r = gc.correctness_run("decode_into", cuda=False, sim=True, sim_delay_s=0.002,
                               deadline=time.monotonic() + 30, **SMALL)
    assert r["batches_checked"] > 50
    assert r["bad_rows"] > 0, "a slot refilled under a running copy went unnoticed"


def test_check_passes_the_same_run_with_the_real_ring(gc):
    with gc.poisoned_slots(gc.POISON):
        r = gc.correctness_run("decode_into", cuda=False, sim=True, sim_delay_s=0.002,
                               deadline=time.monotonic() + 30, **SMALL)
    assert r["batches_checked"] > 50 and r["bad_rows"] == 0 and r["bad_rows_late"] == 0
    assert r["slot_waits"] > 0


def test_check_flags_every_unwritten_row(gc):
    skip = frozenset(range(0, 1024, 13))
    with gc.poisoned_slots(gc.POISON):
        r = gc.correctness_run("decode_into", cuda=False, sim=True, skip_write=skip,
                               deadline=time.monotonic() + 30, **{**SMALL, "passes": 1})
    assert r["expected_bad_rows"] > 10
    assert r["bad_rows"] == r["expected_bad_rows"]


def test_checker_reports_wrong_structure_on_the_host(gc):
    ds = gc.ChecksumSet(64, (3, 4, 4), slow_fraction=0)
    checker = gc.Checker(ds, torch.device("cpu"))
    expect = torch.tensor([1, 2])
    good = (torch.stack([ds.image(1), ds.image(2)]), expect.clone(),
            torch.stack([ds.tag(1), ds.tag(2)]))
    bad, why = checker.bad_rows(good, expect)
    assert why is None and int(bad) == 0
    swapped = (good[0].flip(0), good[1], good[2])
    assert int(checker.bad_rows(swapped, expect)[0]) == 2
    short = tuple(t[:1] for t in good)
    assert checker.bad_rows(short, expect)[0] is None
    assert "structure" in checker.bad_rows([good[0]], expect)[1]


def test_sections_option_and_default_out(gc, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = gc.main(["--quick", "--sections", "b", "--correct-batches", "30"])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0
    assert doc["sections"]["correctness"]["status"] == "skipped"
    assert "--sections" in doc["sections"]["correctness"]["reason"]
    with pytest.raises(SystemExit):
        gc.main(["--sections", "x"])


def test_wrapper_script_runs_the_check_into_out(tmp_path):
    """``bench/gpu_check.sh`` (what the device tool runs) end to end, correctness only."""
    wrapper = os.path.join(REPO, "bench", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", wrapper]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OUT"] = str(tmp_path)
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", wrapper, "--quick", "--sections", "a",
                           "--correct-batches", "60", "--correct-min-batches", "20"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["sections"]["correctness"]["status"] == "passed"
    assert "(a) correctness" in (tmp_path / "gpu_check.log").read_text()


# ------------------------------------- the GPU sections' plumbing, under a CUDA stand-in
STAND_IN = r'''
"""gpu_check's CUDA sections on the CPU: torch.cuda's stream/event API replaced by
host-clock stand-ins, pinning a no-op, the loader forced onto its CUDA path and a
tiny model standing in for ResNet-50. The figures mean nothing; the code paths,
the JSON and the table are what is checked."""
import contextlib, importlib.util, json, sys, time, types
import torch

class Event:
    def __init__(self, enable_timing=False, **kw):
        self.t, self.enable_timing = None, enable_timing
    def record(self, stream=None):
        self.t = time.perf_counter()
    def query(self):
        return True
    def synchronize(self):
        assert self.t is not None, "synchronize() on an event never recorded"
    def elapsed_time(self, other):
        assert self.enable_timing and other.enable_timing, "elapsed_time needs timing events"
        assert self.t is not None and other.t is not None, "elapsed_time on an unrecorded event"
        return (other.t - self.t) * 1e3

class Stream:
    def __init__(self, device=None, **kw):
        pass
    def wait_event(self, ev):
        pass

torch.cuda.Stream, torch.cuda.Event = Stream, Event
torch.cuda.stream = lambda s: contextlib.nullcontext()
torch.cuda.device = lambda d: contextlib.nullcontext()
torch.cuda.current_stream = lambda d=None: Stream()
torch.cuda.synchronize = lambda d=None: None
torch.cuda.empty_cache = lambda: None
torch.cuda._sleep = lambda cycles: None
_empty = torch.empty
torch.empty = lambda *a, pin_memory=False, **kw: _empty(*a, **kw)
tv = types.ModuleType("torchvision")
tv.__version__ = "stand-in"
tv.models = types.SimpleNamespace(resnet50=lambda num_classes=1000: torch.nn.Sequential(
    torch.nn.Conv2d(3, 4, 3, stride=8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
    torch.nn.Linear(4, num_classes)))
sys.modules["torchvision"] = tv

spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
import asyncfeed._engine.loader as L, asyncfeed._memory.device as D
D.pin = lambda obj: obj              # CopyStream.pin: no pinned memory without CUDA
_init = L.AsyncLoader.__init__
def init(self, *a, device=None, copy_stream=None, **kw):
    if device is not None and copy_stream is None:  # the CUDA path: ring, CopyStream, hand-over
        copy_stream = D.CopyStream(torch.device("cpu"))
    _init(self, *a, copy_stream=copy_stream, **kw)
L.AsyncLoader.__init__ = init
gc.AsyncLoader = L.AsyncLoader

args = gc.build_parser().parse_args([
    "--quick", "--threads", "2", "--image-size", "32", "--bw-batch", "16", "--bw-batches", "20",
    "--ov-batch", "16", "--ov-dim", "64", "--ov-steps", "8", "--train-batch", "8",
    "--train-images", "40", "--train-workers", "2", "--train-steps", "3", "--train-warmup", "1",
    "--data-root", sys.argv[3]])
gc.quick_defaults(args, True)
dev = torch.device("cpu")
doc = {"sections": {"correctness": gc.skipped("stand-in")}}
doc["sections"]["bandwidth"] = b = gc.section_bandwidth(args, dev)
doc["sections"]["overlap"] = gc.section_overlap(args, dev, 1e3 / b["loader_batches_per_s_host"])
doc["sections"]["training"] = gc.section_training(args, dev)
print(gc.summary_table(doc))
json.dump(doc, open(sys.argv[2], "w"), default=str)
'''


def test_gpu_sections_run_under_a_cuda_stand_in(tmp_path):
    """Catches what would otherwise first show on the GPU machine: a name, a key or
    a shape wrong in sections (b)-(d), or a table that cannot render."""
    harness = tmp_path / "stand_in.py"
    harness.write_text(STAND_IN)
    out = tmp_path / "doc.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(harness), SCRIPT, str(out), str(tmp_path / "data")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    S = json.loads(out.read_text())["sections"]
    b, o, t = S["bandwidth"], S["overlap"], S["training"]
    assert b["status"] in ("passed", "below target")
    assert b["copies_timed"] > 5 and b["ratio"] > 0 and b["plain_bytes_per_s_median"] > 0
    assert b["batch_bytes"] == 16 * 3 * 32 * 32 + 16 * 8
    assert o["status"] in ("passed", "below target") and 0 <= o["wait_fraction"] < 1
    assert o["with_loader"]["steps_timed"] > 0 and o["no_loader"]["steps_timed"] > 0
    assert o["with_loader"]["slot_waits"] is not None
    assert t["status"] in ("passed", "below target"), t
    names = [r["name"] for r in t["results"]]
    assert names == ["gpu only (no loader)", "asyncfeed", "DataLoader w=2"]
    for r in t["results"]:
        # cores_busy counts CPU in 10 ms ticks: a stand-in row this short may read 0
        assert r["images_per_s"] > 0 and r["cores_busy"] >= 0, r
    af = t["results"][1]
    assert af["path"] == "ring" and af["slot_waits"] >= 0
    assert set(t["verdict"]) == {"best_dataloader", "speed_vs_best", "matches_best", "fewer_cores"}
    for head in ("(b) bandwidth", "(c) overlap", "(d) training", "DataLoader w=2"):
        assert head in proc.stdout
