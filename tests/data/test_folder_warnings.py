"""``ImageFolder`` warns when its root looks one level too high (class folders named
like splits) and, with ``allow_empty=True``, names the class folders holding no image."""

from __future__ import annotations

import warnings

import pytest

from asyncfeed import ImageFolder
from support.imagegen import write

pytestmark = pytest.mark.timeout(60)


def test_split_names_as_classes_warn(tmp_path):
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            write("baseline", tmp_path / split / cls / "a.jpg", 20, 24, seed=1)
    with pytest.warns(UserWarning, match=r"train, val look like the splits") as rec:
        ds = ImageFolder(tmp_path, 16)
    assert str(tmp_path / "train") in str(rec[0].message)
    assert ds.classes == ["train", "val"]  # still torchvision's classes, as asked
    (tmp_path / "Test").mkdir()
    write("baseline", tmp_path / "Test" / "x" / "b.jpg", 20, 24, seed=2)
    with pytest.warns(UserWarning, match=r"Test, train, val"):
        ImageFolder(tmp_path, 16)


def test_a_plain_tree_does_not_warn(tmp_path):
    for cls in ("cat", "dog", "trainer", "valley"):
        write("baseline", tmp_path / cls / "a.jpg", 20, 24, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageFolder(tmp_path, 16)
        ImageFolder(tmp_path, 16, train=True, seed=0)


def test_empty_class_folders_raise_or_warn(tmp_path):
    write("baseline", tmp_path / "a" / "x.jpg", 20, 24, seed=1)
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("no image here")
    with pytest.raises(FileNotFoundError, match="b, c"):
        ImageFolder(tmp_path, 16)
    with pytest.warns(UserWarning, match=r"the class folders b, c hold no image"):
        ds = ImageFolder(tmp_path, 16, allow_empty=True)
    assert ds.classes == ["a", "b", "c"] and ds.class_to_idx["c"] == 2 and len(ds) == 1
    (tmp_path / "b" / "d").mkdir()  # a root whose only class is empty: nothing to load
    with pytest.warns(UserWarning, match="hold no image"), \
            pytest.raises(FileNotFoundError, match="no image found"):
        ImageFolder(tmp_path / "b", 16, allow_empty=True)
