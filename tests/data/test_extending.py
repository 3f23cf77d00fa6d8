"""``docs/extending.md`` runs as written: a custom Source and a custom Decoder, each on real
JPEG files, through AsyncLoader, with DataLoader as the oracle.

The page's ``python`` blocks are executed in order in one namespace, in a directory that
holds ``train.zip`` (real JPEGs, flat class folders); the tests then use the classes the
page defined.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader, ImageFolder, SampleError
from asyncfeed.protocols import Decoder, DecoderInto, Source
from support.imagegen import write
from support.oracle import assert_parity, assert_same_batches

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
CLASSES = ("cat", "dog", "owl")
PER_CLASS = 7


def doc_blocks() -> list[str]:
    """The page's python blocks, each padded with blank lines so that tracebacks give
    the page's own line numbers."""
    text = DOC.read_text()
    return ["\n" * text.count("\n", 0, m.start(1)) + m.group(1)
            for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """``root/<class>/<n>.jpg`` (real JPEGs of varied sizes) and ``train.zip`` of the same."""
    base = tmp_path_factory.mktemp("extending")
    root = base / "root"
    k = 0
    for c in CLASSES:
        for n in range(PER_CLASS):
            write("baseline", root / c / f"{n:02d}.jpg", h=40 + 3 * k, w=56 + 2 * k, seed=k)
            k += 1
    with zipfile.ZipFile(base / "train.zip", "w") as zf:
        for c in CLASSES:
            for f in sorted(os.listdir(root / c)):
                zf.write(root / c / f, f"{c}/{f}")
    return base


@pytest.fixture(scope="module")
def doc(tree) -> dict:
    """Run every python block of docs/extending.md, in order, next to train.zip."""
    ns: dict = {"__name__": "extending_doc"}
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        for block in doc_blocks():
            exec(compile(block, str(DOC), "exec"), ns)
    finally:
        os.chdir(cwd)
    return ns


def test_the_page_has_the_examples():
    blocks = doc_blocks()
    assert len(blocks) == 3
    assert "class ZipSource" in blocks[0] and "class GrayDecoder" in blocks[1]
    assert "AsyncLoader(" in blocks[2]


def test_examples_fit_the_protocols(doc, tree):
    src = doc["ZipSource"](str(tree / "train.zip"))
    assert isinstance(src, Source)
    assert isinstance(doc["GrayDecoder"](), DecoderInto)
    assert isinstance(lambda raw: raw, Decoder)


def test_zip_source_gives_what_the_folder_gives(doc, tree):
    """Through AsyncLoader, the zip's dataset yields the batches DataLoader yields over the
    extracted folder (default decoder), and DataLoader over the zip agrees."""
    zipped = ImageFolder(tree / "train.zip", size=24, source=doc["ZipSource"](
        str(tree / "train.zip")))
    folder = ImageFolder(tree / "root", size=24)
    assert zipped.classes == folder.classes == list(CLASSES)
    assert [t for _, t in zipped.samples] == [t for _, t in folder.samples]
    want = list(DataLoader(folder, batch_size=5, shuffle=True,
                           generator=torch.Generator().manual_seed(3)))
    with AsyncLoader(zipped, batch_size=5, shuffle=True, num_threads=3,
                     generator=torch.Generator().manual_seed(3)) as al:
        got = list(al)
    assert_same_batches(got, want)
    assert_parity(zipped, batch_size=5, shuffle=True, num_threads=3)


def test_zip_source_reads_on_the_event_loop(doc, tree):
    zipped = ImageFolder(tree / "train.zip", size=24, io="async",
                         source=doc["ZipSource"](str(tree / "train.zip")))
    assert_parity(zipped, batch_size=4, num_threads=2)


def test_zip_source_pickles_for_dataloader_workers(doc, tree):
    zipped = ImageFolder(tree / "train.zip", size=24, source=doc["ZipSource"](
        str(tree / "train.zip")))
    want = list(DataLoader(zipped, batch_size=6))
    got = list(DataLoader(zipped, batch_size=6, num_workers=2))
    assert_same_batches(got, want)


def test_gray_decoder_matches_pillow_and_dataloader(doc, tree):
    ds = ImageFolder(tree / "root", decoder=doc["GrayDecoder"](16))
    img, label = ds[PER_CLASS + 2]
    with Image.open(ds.samples[PER_CLASS + 2][0]) as im:
        ref = np.asarray(im.convert("L").resize((16, 16), Image.BILINEAR))
    assert label == 1 and img.dtype == torch.uint8 and tuple(img.shape) == (1, 16, 16)
    assert np.array_equal(img[0].numpy(), ref)
    got = assert_parity(ds, batch_size=4, shuffle=True, num_threads=3)
    assert tuple(got[0][0].shape) == (4, 1, 16, 16)


def test_gray_decoder_writes_batch_rows_in_place(doc, tree):
    """After the first batch, rows are written by the decoder's decode_into (the ring)."""
    calls = []

    class Counting(doc["GrayDecoder"]):
        def decode_into(self, raw, out):
            calls.append(tuple(out.shape))
            return super().decode_into(raw, out)

    ds = ImageFolder(tree / "root", decoder=Counting(16))
    got = assert_parity(ds, batch_size=4, num_threads=2)
    assert len(got) == 6
    assert calls and set(calls) == {(1, 16, 16)}


def test_both_on_the_zip(doc, tree):
    ds = ImageFolder(tree / "train.zip", source=doc["ZipSource"](str(tree / "train.zip")),
                     decoder=doc["GrayDecoder"](32))
    got = assert_parity(ds, batch_size=8, shuffle=True, num_threads=2)
    assert sum(len(labels) for _, labels in got) == len(CLASSES) * PER_CLASS


def test_a_plain_function_is_a_decoder(tree):
    def mean_gray(raw: bytes) -> np.ndarray:  # a NumPy array is handed over as a tensor
        with Image.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("L").resize((8, 8)), dtype=np.uint8).copy()

    ds = ImageFolder(tree / "root", decoder=mean_gray)
    assert isinstance(ds[0][0], torch.Tensor)
    assert_parity(ds, batch_size=5, num_threads=2)


def test_a_bad_member_names_the_sample(doc, tree, tmp_path):
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(tree / "train.zip") as src, zipfile.ZipFile(bad, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            dst.writestr(name, data[: len(data) // 3] if name == "dog/03.jpg" else data)
    ds = ImageFolder(bad, size=24, source=doc["ZipSource"](str(bad)))
    with AsyncLoader(ds, batch_size=4, num_threads=2) as al:
        with pytest.raises(SampleError, match="dog/03.jpg") as info:
            list(al)
    assert info.value.index == PER_CLASS + 3


def test_size_with_a_decoder_is_an_error(doc, tree):
    with pytest.raises(TypeError, match="default decoder"):
        ImageFolder(tree / "root", size=32, decoder=doc["GrayDecoder"](32))


def test_not_a_source_is_named(tree):
    class Half:
        is_local = True

        def list_dirs(self):
            return ["cat"]

    with pytest.raises(TypeError, match="list_files.*read_sync.*read.*close_io"):
        ImageFolder(tree / "root", source=Half())
