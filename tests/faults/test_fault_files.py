"""Hostile files in an ImageFolder: every good sample arrives once, every bad one is named.

The folder holds good JPEGs (and a PNG named ``.jpg``, and a good file inside a
folder named like a file) next to a zero-byte file, a truncated JPEG, random
bytes, text named ``.png``, JPEG and PNG decompression bombs, a file deleted
after listing, one replaced by a folder after listing, a dangling symlink, two
symlinks pointing at each other and a symlink back to its own folder.  With
``on_error="skip"`` each good sample must arrive exactly once and each bad one
be recorded with its path and the reason; with ``"raise"`` the error names the
path and the reason.  Nothing may hang, no thread, descriptor, child process or
shared-memory segment may be left, and memory stays flat over repeated epochs.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch

from asyncfeed import AsyncLoader, ImageFolder, SampleError, decode_image
from support.faults import Resources, assert_released, bomb_jpeg, bomb_png, rss_mb
from support.imagegen import encode

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]

# name -> (bytes or a marker, regex the skip record / error must contain)
BAD = {
    "c0/empty.jpg": (b"", "empty file"),
    "c0/truncated.jpg": ("truncated", r"(?i)truncat|unexpected|premature|incomplete|broken"),
    "c0/random.jpg": ("random", "not an image file"),
    "c1/text.png": (b"just some text, not an image\n", "not an image file"),
    "c1/bomb.jpg": ("bomb_jpeg", "DecompressionBombError"),
    "c1/bomb.png": ("bomb_png", "DecompressionBombError"),
    "c0/deleted.jpg": ("delete", "FileNotFoundError"),
    "c1/became_dir.jpg": ("to_dir", "IsADirectoryError"),
    "c0/dangling.jpg": ("dangling", "FileNotFoundError"),
    "c1/loop_a.jpg": ("loop", "Too many levels of symbolic links"),
    "c1/loop_b.jpg": ("loop", "Too many levels of symbolic links"),
}


def _build(root: str) -> tuple[dict[str, bytes], list[str]]:
    """Write the folder; returns (good path -> file bytes, paths to break after listing)."""
    good: dict[str, bytes] = {}
    for i in range(10):
        path = os.path.join(root, f"c{i % 2}", f"good{i}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        good[path] = encode("baseline", 40 + i, 56, seed=i)
    good[os.path.join(root, "c0", "png_named.jpg")] = encode("png_as_jpg", 44, 52, seed=50)
    good[os.path.join(root, "c1", "folder.jpg", "inner.jpg")] = encode("baseline", 36, 60, seed=51)
    for path, raw in good.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(raw)
    later = []
    for name, (what, _) in BAD.items():
        path = os.path.join(root, name)
        if isinstance(what, bytes):
            data = what
        elif what in ("truncated", "random"):
            data = encode(what, 48, 64, seed=7)
        elif what == "bomb_jpeg":
            data = bomb_jpeg()
        elif what == "bomb_png":
            data = bomb_png()
        elif what == "dangling":
            os.symlink(os.path.join(root, "nowhere.jpg"), path)
            continue
        elif what == "loop":
            other = "loop_b.jpg" if name.endswith("loop_a.jpg") else "loop_a.jpg"
            os.symlink(other, path)
            continue
        else:  # broken after listing
            data = encode("baseline", 40, 40, seed=99)
            later.append(path)
        with open(path, "wb") as f:
            f.write(data)
    os.symlink("..", os.path.join(root, "c0", "up"))  # a folder loop
    return good, later


def _break_after_listing(later: list[str]) -> None:
    for path in later:
        os.remove(path)
        if "became_dir" in path:
            os.mkdir(path)


def _digest(img: torch.Tensor) -> str:
    return hashlib.sha1(img.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile"))
    good, later = _build(root)
    listed = {size: ImageFolder(root, size=size, io="thread") for size in (None, 32)}
    _break_after_listing(later)
    return root, good, listed


def test_listing_sees_each_file_once(hostile):
    root, good, listed = hostile
    paths = [p for p, _ in listed[32].samples]
    assert len(paths) == len(set(paths)), "a folder loop listed files twice"
    assert set(paths) == set(good) | {os.path.join(root, n) for n in BAD}


@pytest.mark.parametrize("io", ["thread", "async"])
@pytest.mark.parametrize("size", [None, 32])
def test_skip_delivers_every_good_sample_once_and_names_every_bad_one(hostile, io, size):
    root, good, listed = hostile
    ds = listed[size]
    ds.io = io
    want = sorted(_digest(torch.from_numpy(decode_image(raw, size))) for raw in good.values())
    before = Resources.snapshot()
    collate = (lambda samples: samples) if size is None else None
    rss = []
    for epoch in range(4):
        loader = AsyncLoader(ds, batch_size=4, shuffle=True, seed=epoch, num_threads=2,
                             on_error="skip", collate_fn=collate)
        got = []
        for batch in loader:
            imgs = [img for img, _ in batch] if size is None else list(batch[0])
            got.extend(_digest(img) for img in imgs)
        skipped = {s.source: s.error for s in loader.stats().skipped}
        loader.close()
        assert sorted(got) == want, "a good sample was lost or delivered twice"
        assert set(skipped) == {os.path.join(root, n) for n in BAD}
        for name, (_, reason) in BAD.items():
            assert re.search(reason, skipped[os.path.join(root, name)]), \
                (name, skipped[os.path.join(root, name)])
        rss.append(rss_mb())
    assert_released(before)
    assert rss[-1] - rss[1] < 40, f"memory grew over epochs: {rss}"


@pytest.mark.parametrize("size", [None, 32])
def test_raise_names_the_path_and_the_reason(hostile, size):
    root, _, listed = hostile
    ds = listed[size]
    ds.io = "thread"
    for i, (path, _) in enumerate(ds.samples):
        name = os.path.relpath(path, root)
        if name not in BAD:
            continue
        with pytest.raises(SampleError) as info:
            ds[i]
        msg = str(info.value)
        assert path in msg and re.search(BAD[name][1], msg), msg
    before = Resources.snapshot()
    first_bad = min(i for i, (p, _) in enumerate(ds.samples)
                    if os.path.relpath(p, root) in BAD)
    loader = AsyncLoader(ds, batch_size=2, num_threads=2,
                         collate_fn=(lambda s: s) if size is None else None)
    with pytest.raises(SampleError) as info:
        for _ in loader:
            pass
    assert ds.samples[first_bad][0] in str(info.value)
    loader.close()
    assert_released(before)
