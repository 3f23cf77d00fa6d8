"""The README's quick start and resume snippets run as written.

They are taken from README.md (the ``python`` blocks under their headings) and run in
a folder holding ``data/train/<class>/<image>.jpg`` of small generated JPEGs: enough
images for three batches of the snippets' 256, so that the resume snippet saves a
state mid-epoch and resumes from it.  The CUDA quick start runs on the GPU where
there is one, else with ``device="cuda"`` replaced by ``"cpu"`` (the only change).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from support import imagegen

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
N_PER_CLASS = 300  # 600 images: batches of 256, 256 and 88


def snippets(heading: str) -> list[str]:
    """The ``python`` code blocks of the README section under ``## heading``."""
    text = open(README, encoding="utf-8").read()
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return re.findall(r"^```python\n(.*?)^```", m.group(1), re.M | re.S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    for c in ("cat", "dog"):
        for i in range(N_PER_CLASS):
            imagegen.write("baseline", root / "data" / "train" / c / f"{i}.jpg", h=48, w=64,
                           seed=i)
    return root


def run(code: str, where, monkeypatch) -> dict:
    monkeypatch.chdir(where)
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_readme_has_a_cpu_and_a_cuda_quick_start_and_a_resume_snippet():
    quick = snippets("Quick start")
    assert len(quick) == 2 and 'device="cuda"' not in quick[0] and 'device="cuda"' in quick[1]
    assert len(snippets("Checkpoint and resume")) == 1


def test_cpu_quick_start_runs_as_written(workdir, monkeypatch):
    ns = run(snippets("Quick start")[0], workdir, monkeypatch)
    images, labels = ns["images"], ns["labels"]
    assert ns["epoch"] == 2 and images.dtype == torch.float32
    assert images.shape == (2 * N_PER_CLASS - 2 * 256, 3, 224, 224)  # the last batch
    assert labels.dtype == torch.int64
    ns["loader"].close()


def test_cuda_quick_start_runs(workdir, monkeypatch):
    code = snippets("Quick start")[1]
    if not torch.cuda.is_available():
        code = code.replace('device="cuda"', 'device="cpu"')
    ns = run(code, workdir, monkeypatch)
    assert ns["images"].device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    ns["loader"].close()


def test_resume_snippet_runs_and_resumes_where_it_saved(workdir, monkeypatch):
    ns = run(snippets("Checkpoint and resume")[0], workdir, monkeypatch)
    assert os.path.exists(workdir / "checkpoint.pt")
    # the resumed loader yielded only the third batch: that of an uninterrupted run
    with ns["make_loader"]() as whole:
        batches = [labels for _, labels in whole]
    assert len(batches) == 3 and torch.equal(ns["labels"], batches[2])
    ns["loader"].close()
    ns["resumed"].close()
