"""``asyncfeed.ImageFolder`` on real folder trees.

The oracle for classes and sample order is torchvision's own algorithm
(``find_classes`` / ``make_dataset`` / ``has_file_allowed_extension``), restated
below because torchvision is not a dependency.
"""

from __future__ import annotations

import asyncio
import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import asyncfeed
from asyncfeed import ImageFolder, SampleError, decode_image
from support.imagegen import BAD_KINDS, write

SIZE = 16

# torchvision.datasets.folder.IMG_EXTENSIONS
TV_IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def tv_find_classes(directory):
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    return classes, {cls_name: i for i, cls_name in enumerate(classes)}


def tv_make_dataset(directory, class_to_idx, extensions=TV_IMG_EXTENSIONS):
    directory = os.path.expanduser(directory)
    instances, available = [], set()
    for target_class in sorted(class_to_idx.keys()):
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if path.lower().endswith(extensions):  # has_file_allowed_extension
                    instances.append((path, class_to_idx[target_class]))
                    available.add(target_class)
    empty = set(class_to_idx.keys()) - available
    if empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(empty))}.")
    return instances


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def tree(tmp_path):
    """A folder tree with the awkward corners torchvision's order depends on."""
    root = tmp_path / "root"
    files = {
        # upper case sorts before lower case; extensions in mixed case
        "B/x.JPG": "baseline", "B/y.jpeg": "progressive", "B/notes.txt": "text",
        "B/sub/z.Png": "png_as_jpg", "B/sub/deeper/b.jpg": "grayscale",
        "B/sub-2/a.jpg": "cmyk",            # "sub-2" < "sub/..." as strings ('-' < '/')
        "B/dir.jpg/inner.jpg": "baseline",  # a directory named like an image
        # string order of names: 1, 10, 2; hidden files count; no-extension files do not
        "a/1.jpg": "baseline", "a/10.jpg": "baseline", "a/2.jpg": "extraneous",
        "a/.hidden.jpg": "baseline", "a/README": "text", "a/img.jpg.txt": "text",
        "c d/q.jpeg": "palette_png",        # a space in the class name
        "c d/r.jpg": "rgba_png",
        "outside/s.jpg": "baseline",        # not a class: reached through a symlink below
    }
    for i, (rel, kind) in enumerate(sorted(files.items())):
        write(kind, root / rel if not rel.startswith("outside") else tmp_path / rel,
              20 + i, 28 + 3 * i, seed=i)
    os.symlink(tmp_path / "outside", root / "a" / "linked")   # os.walk(followlinks=True)
    (root / "loose_file.jpg").write_bytes(read(root / "a" / "1.jpg"))  # a file, not a class
    return root


def test_classes_and_samples_match_torchvision(tree):
    ds = ImageFolder(tree, size=SIZE)
    classes, class_to_idx = tv_find_classes(str(tree))
    samples = tv_make_dataset(str(tree), class_to_idx)
    assert ds.classes == classes == ["B", "a", "c d"]
    assert ds.class_to_idx == class_to_idx
    assert ds.samples == samples
    assert ds.targets == [t for _, t in samples]
    assert len(ds) == len(samples) == 13
    # the same order, spelled out: files of a directory come before its subdirectories,
    # which follow the string order of their paths ('-' < '/', so sub-2 before sub/deeper)
    assert [os.path.relpath(p, tree) for p, _ in ds.samples] == [
        "B/x.JPG", "B/y.jpeg", "B/dir.jpg/inner.jpg", "B/sub/z.Png", "B/sub-2/a.jpg",
        "B/sub/deeper/b.jpg", "a/.hidden.jpg", "a/1.jpg", "a/10.jpg", "a/2.jpg",
        "a/linked/s.jpg", "c d/q.jpeg", "c d/r.jpg"]
    assert asyncfeed.IMG_EXTENSIONS == TV_IMG_EXTENSIONS


def test_relative_root_same_order(tree, monkeypatch):
    monkeypatch.chdir(tree.parent)
    ds = ImageFolder("root", size=SIZE)
    classes, class_to_idx = tv_find_classes("root")
    assert ds.classes == classes
    assert ds.samples == [(os.path.abspath(p), t) for p, t in tv_make_dataset("root",
                                                                              class_to_idx)]


def test_custom_extensions(tree):
    ds = ImageFolder(tree, size=SIZE, extensions=(".png", ".jpg"))
    _, class_to_idx = tv_find_classes(str(tree))
    assert ds.samples == tv_make_dataset(str(tree), class_to_idx, (".png", ".jpg"))
    # class "a" holds no .png/.jpeg: both refuse
    with pytest.raises(FileNotFoundError):
        tv_make_dataset(str(tree), class_to_idx, (".png", ".jpeg"))
    with pytest.raises(FileNotFoundError, match="classes a "):
        ImageFolder(tree, size=SIZE, extensions=(".png", ".jpeg"))


def test_empty_class_dir_raises(tree):
    (tree / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        ImageFolder(tree, size=SIZE)


def test_class_with_only_non_images_raises(tree):
    (tree / "textonly").mkdir()
    write("text", tree / "textonly" / "a.txt")
    with pytest.raises(FileNotFoundError, match="textonly"):
        ImageFolder(tree, size=SIZE)


def test_no_class_dirs_or_no_root_raises(tmp_path):
    write("baseline", tmp_path / "only_a_file.jpg")
    with pytest.raises(FileNotFoundError):
        ImageFolder(tmp_path, size=SIZE)
    with pytest.raises(FileNotFoundError):
        ImageFolder(tmp_path / "missing", size=SIZE)


# -- the sample itself -------------------------------------------------------------------

def test_getitem(tree):
    ds = ImageFolder(tree, size=SIZE)
    for i, (path, label) in enumerate(ds.samples):
        img, lab = ds[i]
        assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8
        assert img.shape == (3, SIZE, SIZE)
        assert type(lab) is int and lab == label
        assert np.array_equal(img.numpy(), decode_image(read(path), SIZE))
        assert ds.sample_source(i) == path
    with pytest.raises(IndexError):  # not a SampleError: ends old-style iteration
        ds[len(ds)]


def test_linear_and_full_size(tree):
    ds = ImageFolder(tree, size=SIZE, interpolation="linear")
    path = ds.samples[3][0]
    assert np.array_equal(ds[3][0].numpy(), decode_image(read(path), SIZE,
                                                         interpolation="linear"))
    full = ImageFolder(tree, size=None)
    img, _ = full[3]
    assert img.shape == decode_image(read(path), None).shape
    assert img.shape[1:] != (SIZE, SIZE)


def test_fetch_decode_equals_getitem(tree):
    ds = ImageFolder(tree, size=SIZE)

    async def fetch_all():
        return await asyncio.gather(*(ds.fetch(i) for i in range(len(ds))))

    raws = asyncio.run(fetch_all())
    for i, raw in enumerate(raws):
        assert raw == read(ds.samples[i][0]) == ds.read(i)
        img, label = ds.decode(raw, i)
        ref_img, ref_label = ds[i]
        assert label == ref_label and torch.equal(img, ref_img)


def test_decode_into_row_of_slot(tree):
    ds = ImageFolder(tree, size=SIZE)
    slot = torch.full((len(ds) + 2, 3, SIZE, SIZE), 7, dtype=torch.uint8)
    for i in range(len(ds)):
        out = slot[i + 1]
        res, label = ds.decode_into(ds.read(i), i, out)
        assert res is out
        ref_img, ref_label = ds[i]
        assert label == ref_label and torch.equal(slot[i + 1], ref_img)
    assert bool((slot[0] == 7).all()) and bool((slot[-1] == 7).all())


def test_decode_into_other_shape_falls_back(tree):
    ds = ImageFolder(tree, size=SIZE)
    out = torch.full((3, SIZE + 1, SIZE + 1), 7, dtype=torch.uint8)
    img, label = ds.decode_into(ds.read(0), 0, out)
    assert img is not out and bool((out == 7).all())
    assert torch.equal(img, ds[0][0]) and label == ds[0][1]


def test_io_modes(tree):
    assert ImageFolder(tree, size=SIZE).io == "thread"           # auto, local
    assert not ImageFolder(tree, size=SIZE).use_async_fetch
    assert ImageFolder(tree, size=SIZE, io="async").use_async_fetch
    assert not ImageFolder(tree, size=SIZE, io="thread").use_async_fetch


def test_pickle_round_trip(tree):
    ds = ImageFolder(tree, size=SIZE, interpolation="linear", io="async")
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2.samples == ds.samples and ds2.classes == ds.classes
    assert ds2.class_to_idx == ds.class_to_idx and ds2.targets == ds.targets
    assert (ds2.size, ds2.interpolation, ds2.io) == (ds.size, ds.interpolation, ds.io)
    for i in (0, 5, len(ds) - 1):
        assert torch.equal(ds2[i][0], ds[i][0]) and ds2[i][1] == ds[i][1]


def test_dataloader_workers_match_single_process(tree):
    ds = ImageFolder(tree, size=SIZE)
    ref = list(DataLoader(ds, batch_size=5, num_workers=0))
    got = list(DataLoader(ds, batch_size=5, num_workers=2))
    assert len(got) == len(ref) == 3  # 13 samples
    for (gi, gl), (ri, rl) in zip(got, ref):
        assert gi.shape[1:] == (3, SIZE, SIZE) and gl.dtype == torch.int64
        assert torch.equal(gi, ri) and torch.equal(gl, rl)


# -- errors ------------------------------------------------------------------------------

@pytest.fixture
def bad_tree(tmp_path):
    root = tmp_path / "root"
    write("baseline", root / "a_good" / "ok.jpg")
    for kind in BAD_KINDS:
        write(kind, root / "b_bad" / f"{kind}.jpg")
    return root


def test_a_bad_file_in_a_dataloader_worker_is_a_sample_error_naming_it(bad_tree):
    # DataLoader re-raises a worker's exception as ``type(e)(message)``: SampleError
    # must be buildable from a message alone, or users get a bare RuntimeError
    ds = ImageFolder(bad_tree, size=SIZE)
    path = ds.samples[1][0]
    loader = DataLoader(torch.utils.data.Subset(ds, [1]), batch_size=1, num_workers=1)
    with pytest.raises(SampleError) as exc:
        next(iter(loader))
    assert path in str(exc.value) and "in DataLoader worker process 0" in str(exc.value)
    assert exc.value.index is None and exc.value.cause is None  # only the message crossed


def check_sample_error(err: SampleError, index: int, path: str, cause_type) -> None:
    assert isinstance(err, asyncfeed.AsyncFeedError)
    assert err.index == index and err.source == path
    assert str(index) in str(err) and path in str(err)
    assert err.__cause__ is err.cause and isinstance(err.__cause__, cause_type)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.index, copy.source, str(copy)) == (index, path, str(err))


def test_bad_files_raise_sample_error(bad_tree):
    ds = ImageFolder(bad_tree, size=SIZE)
    assert len(ds) == 1 + len(BAD_KINDS)
    img, label = ds[0]
    assert img.shape == (3, SIZE, SIZE) and label == 0
    for i in range(1, len(ds)):
        path = ds.samples[i][0]
        with pytest.raises((ValueError, OSError)) as direct:
            decode_image(read(path), SIZE)
        with pytest.raises(SampleError) as exc:
            ds[i]
        check_sample_error(exc.value, i, path, (ValueError, OSError))
        assert type(exc.value.__cause__) is type(direct.value)  # the original, unwrapped

        raw = asyncio.run(ds.fetch(i))
        with pytest.raises(SampleError) as exc:
            ds.decode(raw, i)
        check_sample_error(exc.value, i, path, (ValueError, OSError))

        out = torch.full((3, SIZE, SIZE), 7, dtype=torch.uint8)
        with pytest.raises(SampleError) as exc:
            ds.decode_into(raw, i, out)
        check_sample_error(exc.value, i, path, (ValueError, OSError))
        assert bool((out == 7).all()), "a failed decode wrote into the slot"


def test_missing_file_raises_sample_error(bad_tree):
    ds = ImageFolder(bad_tree, size=SIZE)
    path = ds.samples[0][0]
    os.remove(path)
    with pytest.raises(SampleError) as exc:
        ds[0]
    check_sample_error(exc.value, 0, path, FileNotFoundError)
    with pytest.raises(SampleError) as exc:
        ds.read(0)
    check_sample_error(exc.value, 0, path, FileNotFoundError)
    with pytest.raises(SampleError) as exc:
        asyncio.run(ds.fetch(0))
    check_sample_error(exc.value, 0, path, FileNotFoundError)


# -- parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, -1, 2.5, "224", True], ids=repr)
def test_bad_size(tree, size):
    with pytest.raises(ValueError, match=r"size.*" + repr(size).replace(".", r"\.")):
        ImageFolder(tree, size=size)


@pytest.mark.parametrize("interpolation", ["cubic", "AREA", None], ids=repr)
def test_bad_interpolation(tree, interpolation):
    with pytest.raises(ValueError, match=f"interpolation.*{interpolation!r}"):
        ImageFolder(tree, size=SIZE, interpolation=interpolation)


@pytest.mark.parametrize("io", ["sync", "Thread", None], ids=repr)
def test_bad_io(tree, io):
    with pytest.raises(ValueError, match=f"io.*{io!r}"):
        ImageFolder(tree, size=SIZE, io=io)


def test_remote_options_on_local_root(tree):
    with pytest.raises(TypeError, match="anon"):
        ImageFolder(tree, size=SIZE, anon=True)


def test_repr(tree):
    r = repr(ImageFolder(tree, size=SIZE))
    assert str(tree) in r and "samples=13" in r and "classes=3" in r
