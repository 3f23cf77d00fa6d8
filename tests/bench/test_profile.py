"""``asyncfeed profile``: runs on a tiny real JPEG folder, on the built-in synthetic
set and on a ``module:factory``; ``--json`` parses; ``--plot`` writes a PNG.

Runs in process (``cli.main``) with passes of a fraction of a second; what the
figures are is not asserted, only that every one is there and well-formed.
"""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from asyncfeed._bench import cli
from asyncfeed._engine.accounting import STAGES
from support import imagegen

VERDICTS = {"consumer", "fetch", "decode", "gil", "h2d"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile-folder")
    for c in ("cat", "dog"):
        os.makedirs(root / c)
        for i in range(12):
            imagegen.write("baseline", root / c / f"{i}.jpg", h=120, w=160, seed=i)
    return root


def run_json(capsys, *args: str) -> dict:
    assert cli.main(["profile", *args, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def check_result(doc: dict, with_dataloader: bool = True) -> None:
    assert doc["batch_size"] >= 1 and doc["cores"] >= 1 and doc["device"] == "cpu"
    runs = doc["runs"]
    assert [r["loader"] for r in runs] == (["AsyncLoader", "DataLoader"] if with_dataloader
                                           else ["AsyncLoader"])
    for r in runs:
        assert r["samples"] > 0 and r["samples_per_s"] > 0 and r["first_batch_s"] > 0
        assert 0.0 <= r["wait_share"] <= 1.0
    af = runs[0]
    assert tuple(af["stages"]) == STAGES
    decode = af["stages"]["decode"]
    assert decode["count"] > 0
    if af["execution"].startswith(("threads", "inline")):
        assert decode["cpu_s"] >= 0
    else:  # rows decoded in worker processes: their CPU is not the stage's (None)
        assert af["execution"].startswith("processes") and \
            (decode["cpu_s"] is None or decode["cpu_s"] >= 0), af["execution"]
    assert 0.0 <= af["gil_share"] <= 1.0 and af["bottleneck"] in VERDICTS
    assert "docs/observability.md#" in af["advice"]


def test_profile_a_jpeg_folder_side_by_side(folder, capsys):
    doc = run_json(capsys, str(folder), "--seconds", "0.5", "--batch-size", "4",
                   "--size", "64", "--workers", "1")
    check_result(doc)
    assert doc["data"] == f"ImageFolder({folder})" and doc["samples_in_data"] == 24
    assert doc["runs"][1]["workers"] == 1


def test_profile_prints_the_table_and_writes_the_plot(folder, tmp_path, capsys):
    png = tmp_path / "stages.png"
    raw = tmp_path / "raw.json"
    assert cli.main(["profile", str(folder), "--seconds", "1.2", "--batch-size", "4",
                     "--size", "64", "--no-dataloader", "--model-ms", "5",
                     "--plot", str(png), "--json", str(raw)]) == 0
    out = capsys.readouterr().out
    for text in ("samples/s", "GIL share", "bottleneck", "advice:", "  decode", "  queue"):
        assert text in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(raw.read_text())
    check_result(doc, with_dataloader=False)
    assert doc["model_ms"] == 5.0 and doc["runs"][0]["timeline"], "no window for the plot"
    check_table_agrees_with_advice(out, doc)


def check_table_agrees_with_advice(out: str, doc: dict) -> None:
    """One reading: the table's wait share and bottleneck are the advice's."""
    af = doc["runs"][0]
    waited = re.search(r"^loop waited for data\s+(\d+)%", out, re.M)
    assert waited and int(waited.group(1)) == round(100 * af["wait_share"]), out
    said = re.search(r"waited for data (\d+)% of the time", af["advice"])
    if said:  # every verdict but the GIL's quotes the wait
        assert said.group(1) == waited.group(1), (out, af["advice"])
    assert re.search(rf"^bottleneck\s+{af['bottleneck']}\b", out, re.M), out
    section = {"consumer": "#consumer", "fetch": "#fetch", "decode": "#decode",
               "gil": "#gil", "h2d": "#h2d"}[af["bottleneck"]]
    assert section in af["advice"], (af["bottleneck"], af["advice"])


def test_profile_advice_on_an_imagefolder_names_its_arguments(folder, capsys):
    """The profiled data set is an ImageFolder: a decode verdict with the cores busy names
    interpolation="linear", never the DCT-scaled decode it already does."""
    assert cli.main(["profile", str(folder), "--seconds", "0.8", "--batch-size", "4",
                     "--size", "64", "--no-dataloader"]) == 0
    out = capsys.readouterr().out
    advice = out.split("advice: ", 1)[1]
    assert "DCT-scaled decode, a linear resize" not in advice, advice


def test_profile_without_data_uses_the_synthetic_set(tmp_path, capsys):
    doc = run_json(capsys, "--synthetic", "--images", "20", "--cache", str(tmp_path),
                   "--seconds", "0.3", "--batch-size", "4", "--size", "64",
                   "--no-dataloader")
    check_result(doc, with_dataloader=False)
    assert doc["data"].startswith("synthetic JPEG set (20 images")
    assert any(p.name.startswith("synthetic-") for p in tmp_path.iterdir())


def test_profile_a_module_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_data.py").write_text(textwrap.dedent("""
        import torch

        class Squares:
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return torch.full((4,), i * i), i

        def make():
            return Squares()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = run_json(capsys, "my_data:make", "--seconds", "0.3", "--batch-size", "8",
                   "--workers", "0")
    check_result(doc)
    assert doc["data"] == "my_data:make" and doc["samples_in_data"] == 64


@pytest.mark.parametrize("args,message", [
    (["no/such/dir"], "folder or module:factory"),
    (["--synthetic", "somewhere"], "not both"),
    (["--seconds", "0"], "must be positive"),
])
def test_profile_refuses_bad_arguments(args, message, capsys):
    assert cli.main(["profile", *args]) == 2
    assert message in capsys.readouterr().err
