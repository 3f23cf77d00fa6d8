"""The data sets the benchmark's workloads run, and the sample order they share.

Every contender of a workload runs the same per-sample function over the same
samples in the same order (a seeded permutation handed to each loader as its
sampler):

* ``folder`` (workload a): :class:`asyncfeed.ImageFolder` itself: read the file,
  decode, resize the short side, center-crop.  ``io`` picks its thread or async
  read path for ``AsyncLoader``; every other contender calls ``__getitem__``.
* ``ram`` (workloads b, d): :class:`InMemoryDataset`, the same images held in RAM
  as ``bytes`` plus a per-sample record of plain Python objects (path, label and
  an annotation list of floats, as detection and segmentation sets hold).  Each
  ``__getitem__`` touches its record: that is what makes forked DataLoader workers
  copy the pages the objects live on (copy-on-read, pytorch issue 13246).
* ``gil`` (workload c): the folder's samples followed by :func:`gil_bound_transform`,
  an auto-contrast written in pure Python that holds the GIL for about twice as
  long as the decode takes (about 4 ms per sample here); ``gil-numpy``: the same
  transform rewritten with numpy (same pixels), the remedy asyncfeed's docs give
  for GIL-bound code.
* workload (e) reads the ``folder`` set through ``ImageFolder(url)`` from the
  HTTP or S3 servers of :mod:`.remote`, or through a slow FUSE mount of it.
* ``cifar`` (workload f): :class:`CifarLike`, 32x32 uint8 images in one numpy
  array, pad-4 random crop and flip in numpy, as CIFAR training scripts write it:
  samples so small that the loader's own cost per sample decides the rate.
* ``pil`` (workload g): :class:`PilAugment`, the folder's files decoded by PIL
  and augmented the way torchvision does it on PIL images (RandomResizedCrop,
  horizontal flip, to float32, normalize), written with PIL and numpy.
* ``train``, ``tv-folder``, ``tv-decode`` (workload h): see :mod:`.augment`.
* ``sleep`` (workload ceiling): :class:`SleepDataset`, samples that "decode" by
  sleeping 5 ms (GIL released, no CPU) and return one preallocated 3x224x224
  image: what one process can feed when decoding costs it nothing.
* ``noop`` (workload overhead): :class:`NoopDataset`, samples that cost nothing
  (a preallocated 3x32x32 array and the index): the loader's own cost per sample.
* the outcome bench's data sets (``bench/outcome.py``), written as users write them, by
  name (``detection``, ``text``, ...): :mod:`.userdata`, each with its own sample order.

Data sets are built in the process that runs the loader (never inherited from
the benchmark's fork server), so every contender starts from the same state.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .._data.folder import ImageFolder
from .._data.image import decode_image
from .._io.local import LocalSource
from . import userdata

WORKLOADS = {
    "a": "JPEG folder in the page cache",
    "b": "data set held in RAM as Python objects",
    "c": "pure-Python per-sample transform (holds the GIL)",
    "d": "time to first batch, fork and spawn",
    "e": "the folder on remote storage (loopback HTTP, S3 through moto, a slow FUSE mount) "
         "with a latency model",
    "f": "CIFAR-like set in RAM (32x32 uint8, numpy pad-4 crop + flip)",
    "g": "PIL decode + RandomResizedCrop/flip/normalize to float32 (PIL + numpy)",
    "h": "training augmentation: ImageFolder(train=True) fused against PIL/torchvision "
         "pipelines",
    "ceiling": "one process's ceiling: samples sleep 5 ms (GIL released), T threads",
    "overhead": "the loader's own cost per sample (a no-op data set)",
}

#: the ``sleep`` data set's per-sample "decode" time (workload ceiling)
SLEEP_S = 0.005


class InMemoryDataset:
    """Encoded images and per-sample Python records, all held in RAM.

    ``records[i]`` is ``(path, label, annotations)`` with ``annotations`` a list of
    ``floats_per_sample`` Python floats; ``blobs[i]`` the JPEG bytes.  Sample ``i``
    sums its annotations (touching every object of its record, as converting
    annotations to a tensor does) and decodes its image like ``ImageFolder``.
    """

    def __init__(self, paths: list[str], labels: list[int], size: int,
                 floats_per_sample: int, seed: int = 0) -> None:
        self.size = size
        self.blobs: list[bytes] = []
        for p in paths:
            with open(p, "rb") as f:
                self.blobs.append(f.read())
        rng = np.random.default_rng(seed)
        self.records: list[tuple[str, int, list[float]]] = [
            (p, int(lab), rng.random(floats_per_sample).tolist())
            for p, lab in zip(paths, labels)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label, annotations = self.records[index]
        if sum(annotations) < 0:  # never true: the sum is what touches the record
            raise ValueError(f"negative annotations in {path}")
        return torch.from_numpy(decode_image(self.blobs[index], self.size)), label


def gil_bound_transform(img: torch.Tensor, stride: int = 2) -> torch.Tensor:
    """Auto-contrast whose statistics are computed in pure Python (GIL held throughout).

    A histogram of every ``stride``-th byte, counted in a Python loop, gives the
    1st and 99th percentiles; a lookup table stretches them to 0..255.  The loop is
    what user code written without numpy looks like; only the final table lookup
    (a numpy op) releases the GIL.
    """
    values = img.view(-1)[::stride].tolist()
    hist = [0] * 256
    for v in values:
        hist[v] += 1
    cut = len(values) // 100
    lo, acc = 0, 0
    while lo < 255 and acc + hist[lo] <= cut:
        acc += hist[lo]
        lo += 1
    hi, acc = 255, 0
    while hi > lo and acc + hist[hi] <= cut:
        acc += hist[hi]
        hi -= 1
    if hi <= lo:
        return img
    scale = 255.0 / (hi - lo)
    lut = np.array([min(255, max(0, round((v - lo) * scale))) for v in range(256)], np.uint8)
    return torch.from_numpy(np.take(lut, img.numpy()))


def vectorised_transform(img: torch.Tensor, stride: int = 2) -> torch.Tensor:
    """:func:`gil_bound_transform` with its loop moved into numpy: the same pixels out,
    but the GIL is released for the heavy part.  The fix ``docs/tuning.md`` recommends."""
    values = img.numpy().reshape(-1)[::stride]
    hist = np.bincount(values, minlength=256)
    cut = len(values) // 100
    low = np.cumsum(hist)
    lo = int(np.searchsorted(low, cut, side="right"))
    high = np.cumsum(hist[::-1])
    hi = 255 - int(np.searchsorted(high, cut, side="right"))
    if hi <= lo:
        return img
    scale = 255.0 / (hi - lo)
    lut = np.clip(np.rint((np.arange(256) - lo) * scale), 0, 255).astype(np.uint8)
    return torch.from_numpy(np.take(lut, img.numpy()))


class GilFolder(ImageFolder):
    """``ImageFolder`` whose samples go through :func:`gil_bound_transform`.

    Both of its paths do: ``__getitem__`` (DataLoader, map-style loaders) and
    ``decode`` (``AsyncLoader``'s split path, where the transform runs in the
    decode threads).
    """

    transform = staticmethod(gil_bound_transform)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        img, label = super().__getitem__(index)
        return self.transform(img), label

    def decode(self, raw: bytes, index: int) -> tuple[torch.Tensor, int]:
        img, label = super().decode(raw, index)
        return self.transform(img), label

    def decode_into(self, raw: bytes, index: int, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        img, label = super().decode_into(raw, index, out)
        img[...] = self.transform(img)
        return img, label


class VectorisedFolder(GilFolder):
    """:class:`GilFolder` with the transform rewritten in numpy (same output)."""

    transform = staticmethod(vectorised_transform)


class CifarLike:
    """``n`` random 32x32 RGB uint8 images in one numpy array, augmented per sample
    as CIFAR training scripts do: zero-pad 4 pixels, crop 32x32 at a random offset,
    flip half of them, return CHW uint8 and the label.  Randomness comes from
    numpy's global generator, as in those scripts (every loader does the same work;
    the exact crops differ between loaders, which the benchmark does not compare).
    """

    def __init__(self, n: int = 20_000, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, n).tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        img = np.pad(self.images[index], ((4, 4), (4, 4), (0, 0)))
        dy, dx = np.random.randint(0, 9, 2)
        img = img[dy:dy + 32, dx:dx + 32]
        if np.random.rand() < 0.5:
            img = img[:, ::-1]
        return np.ascontiguousarray(img.transpose(2, 0, 1)), self.labels[index]


_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


def random_resized_crop_box(rng: Any, width: int, height: int,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int,
                                                                                   int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` with a ``random.Random``:
    ``(left, top, width, height)`` of the crop."""
    import math
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height  # fallback: the central crop of the nearest ratio
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class PilAugment:
    """The folder's images through a torchvision-style training transform, written
    with PIL and numpy: decode, RandomResizedCrop to ``size`` (bilinear),
    horizontal flip with probability 1/2, to float32 in [0, 1], normalize with
    ImageNet's mean and std, CHW.  Each sample draws its crop from a
    ``random.Random`` seeded by (seed, index), so every loader does the same work.
    """

    def __init__(self, samples: list[tuple[str, int]], size: int, seed: int = 0) -> None:
        self.samples = samples
        self.size = size
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import random

        from PIL import Image
        path, label = self.samples[index]
        rng = random.Random(self.seed * 1_000_003 + index)
        with Image.open(path) as im:
            im = im.convert("RGB")
        left, top, w, h = random_resized_crop_box(rng, im.width, im.height)
        im = im.resize((self.size, self.size), Image.Resampling.BILINEAR,
                       box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(im, dtype=np.float32)
        arr *= 1 / 255
        arr -= _MEAN
        arr /= _STD
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))), label


class SleepDataset:
    """Samples that "decode" by sleeping ``SLEEP_S`` (GIL released, no CPU) and return
    one preallocated image: the ideal rate with T threads is T / ``SLEEP_S``."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 224, 224)) -> None:
        self.n = n
        self.image = torch.zeros(shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import time
        time.sleep(SLEEP_S)
        return self.image, index % 10


class NoopDataset:
    """Samples that cost nothing: a preallocated 3x32x32 uint8 array and the index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.row = np.zeros((3, 32, 32), np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.row, index


class ListedSource(LocalSource):
    """A local folder whose listing is given (a subset of a large ``--data`` tree).

    Listing ImageNet's 1.28 M files takes seconds; every run builds its data set
    afresh, so the benchmark lists the tree once, picks the files it will use,
    and hands each run that listing.  Reads are a plain ``LocalSource``'s.
    """

    def __init__(self, root: str, listing: dict[str, list[str]]) -> None:
        super().__init__(root)
        self.listing = listing

    def list_dirs(self) -> list[str]:
        return sorted(self.listing)

    def list_files(self, subdir: str) -> list[str]:
        return list(self.listing.get(subdir, []))


def write_subset_listing(root: str, n: int, seed: int, path: str) -> dict:
    """List ``root`` once (torchvision's order), pick ``n`` files at random, save to ``path``."""
    import json
    full = ImageFolder(root, None)
    idx = sorted(np.random.default_rng(seed).permutation(len(full))[:n].tolist())
    listing: dict[str, list[str]] = {}
    for i in idx:
        p, label = full.samples[i]
        listing.setdefault(full.classes[label], []).append(p)
    with open(path, "w") as f:
        json.dump(listing, f)
    return {"files_in_tree": len(full), "classes_in_tree": len(full.classes),
            "files_used": len(idx), "classes_used": len(listing)}


def _open_folder(cls: type, spec: dict) -> Any:
    kw: dict[str, Any] = {"interpolation": spec.get("interpolation", "area"),
                          "io": spec.get("io", "thread"), **spec.get("options", {})}
    if spec.get("listing"):
        import json
        with open(spec["listing"]) as f:
            kw["source"] = ListedSource(spec["root"], json.load(f))
    return cls(spec["root"], spec["size"], **kw)


def sample_order(n_available: int, n_samples: int, seed: int) -> list[int]:
    """The indices every contender visits, in order: a seeded shuffle, cycled if short."""
    perm = np.random.default_rng(seed).permutation(n_available).tolist()
    reps = -(-n_samples // n_available)
    return (perm * reps)[:n_samples]


def build_dataset(spec: dict) -> tuple[Any, list[int]]:
    """``(dataset, order)`` for a run's ``dataset`` spec (built in the running process)."""
    kind = spec["kind"]
    if kind in userdata.DATASETS:
        built = userdata.build(kind, quick=bool(spec.get("quick")), workdir=spec.get("workdir"),
                               seed=spec.get("seed", 0))
        return built.dataset, built.order
    size, seed = spec["size"], spec.get("seed", 0)
    if kind == "folder":
        ds = _open_folder(ImageFolder, spec)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind in ("gil", "gil-numpy"):
        ds = _open_folder(GilFolder if kind == "gil" else VectorisedFolder, spec)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind == "ram":
        folder = _open_folder(ImageFolder, {**spec, "io": "thread"})
        order = sample_order(len(folder), spec["samples"], seed)
        chosen = order[: min(len(order), len(folder))]
        paths = [folder.samples[i][0] for i in chosen]
        labels = [folder.samples[i][1] for i in chosen]
        del folder
        ds = InMemoryDataset(paths, labels, size, spec["floats_per_sample"], seed)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind == "cifar":
        ds = CifarLike(spec.get("n", spec["samples"]), seed)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind == "pil":
        folder = _open_folder(ImageFolder, {**spec, "io": "thread"})
        ds = PilAugment(list(folder.samples), size, seed)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind == "train":  # workload h: the fused training path
        ds = _open_folder(ImageFolder, {**spec, "options": {"train": True, "seed": seed}})
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind in ("tv-folder", "tv-decode"):  # workload h: torchvision's pipelines
        from .augment import build
        folder = _open_folder(ImageFolder, {**spec, "io": "thread"})
        ds = build(spec, folder)
        return ds, sample_order(len(ds), spec["samples"], seed)
    if kind in ("sleep", "noop"):
        ds = SleepDataset(spec["samples"]) if kind == "sleep" else NoopDataset(spec["samples"])
        return ds, sample_order(len(ds), spec["samples"], seed)
    raise ValueError(f"unknown data set kind {kind!r}")


def warm_page_cache(root: str, listing: str | None = None) -> int:
    """Read every file under ``root`` (or in ``listing``) once: workload (a) reads from
    the page cache."""
    if listing:
        import json
        with open(listing) as f:
            paths = [p for files in json.load(f).values() for p in files]
    else:
        paths = [os.path.join(d, n) for d, _, files in os.walk(root) for n in files]
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total
