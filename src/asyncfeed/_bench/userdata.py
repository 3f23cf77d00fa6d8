"""Data sets written the way users write them, for the outcome bench (``bench/outcome.py``).

Each is a plain ``torch.utils.data.Dataset`` (``__getitem__`` and ``__len__``, nothing
asyncfeed-specific), held in RAM or generated on disk, and deterministic: sample ``i``
depends only on the set's seed and ``i`` (per-sample randomness comes from a generator
seeded by the index), so every loader yields the same batches for the same order.

* ``detection``: dict samples, a 3x96x96 uint8 image from RAM, 0-20 boxes (float Nx4,
  flipped with the image for half the samples) and a string id; :func:`detection_collate`
  stacks the images and lists the boxes and ids; batch 32.
* ``text``: text lines tokenised in Python (lower-case, split, dict look-ups into a
  vocabulary), dict samples; :func:`pad_collate` pads to the batch's longest; batch 64.
* ``cifar-rng``: CIFAR-like 32x32 arrays, a per-sample ``np.random.default_rng``, pad-4
  crop and flip, tensors out; default collate; batch 128.
* ``npy``: ``.npy`` files (192x192x3 uint8) written once into a work folder; load, crop
  160x160 at a per-sample offset, normalise to float32 CHW; batch 32.
* ``gil-python``: a pure-Python per-sample function (the GIL held throughout): only worker
  processes run it in parallel; batch 32.
* ``gil-free``: SHA-256 over a 512 KiB window of a buffer in RAM (hashlib releases the GIL
  for the whole digest): threads run it in parallel without worker processes; batch 32.
* ``png-augment``: 64x64 PNGs held in RAM, decoded by Pillow, rotated by a per-sample
  angle and flipped for half the samples, float32 CHW out; Pillow releases the GIL for
  part of each sample; batch 64.
* ``audio``: 1 s waveforms (float32, 16 kHz) in RAM; a per-sample generator picks a
  0.5 s crop and a gain, and NumPy makes a log-magnitude spectrogram (400-sample Hann
  frames, hop 160, ``rfft``): small NumPy calls, the GIL released inside each; batch 32.
* ``tensors``: ``torch.utils.data.TensorDataset`` over features in RAM (64 float32 a
  row) and an int64 label, default collate; batch 256: a row is two tensor indexings,
  so the loader's own cost per batch is a large share of an epoch.
* ``slow-reads``: rows that block 3 ms in ``__getitem__`` (a read from slow storage or
  the network, the GIL released), then turn 4 KiB of per-sample bytes into float32:
  the rate grows with the rows in flight, not with the cores; batch 32.
* ``sqlite``: 64x64x3 uint8 images stored as blobs in a SQLite file written once into a
  work folder, read through a ``sqlite3`` connection the data set opens in ``__init__``
  (usable only in the thread that opened it, and in a child forked from it), flipped
  for half the samples and normalised to float32 CHW; batch 64.
* ``phased``: an epoch whose first half (in time, with ``num_workers=0``) is
  ``cifar-rng``'s cheap rows and whose second half is the pure-Python function: the cost changes mid-epoch
  (the sample order puts the cheap indices first); batch 32.

:func:`build` returns a :class:`Built` (data set, sample order, batch size, collate
function).  Sizes are chosen so that one ``DataLoader(num_workers=0)`` epoch takes one
to two seconds on a 2-core machine; ``quick=True`` gives tiny sets for smoke tests.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import sqlite3
import string
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


@dataclass(frozen=True)
class Built:
    """A data set ready to load: every contender gets the same order and collate."""

    dataset: Dataset
    order: list[int]
    batch_size: int
    collate_fn: Callable[[list[Any]], Any] | None  # None: the loader's default collate


def sample_order(n: int, samples: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(n)``, cycled to ``samples`` indices."""
    perm = np.random.default_rng(seed).permutation(n).tolist()
    return (perm * -(-samples // n))[:samples]


def _coin(seed: int, index: int) -> bool:
    """A fair coin per sample, the same in every process (no shared generator)."""
    return random.Random(seed * 1_000_003 + index).random() < 0.5


# ----------------------------------------------------------------- detection

class DetectionSet(Dataset):
    """Images 3x96x96 uint8 in one array, each with 0-20 boxes (x0, y0, x1, y1) kept as
    lists of Python floats (as parsed from an annotation file) and a string id.

    A sample is ``{"image": uint8 3x96x96, "boxes": float32 Nx4, "image_id": str}``;
    half of them (by a per-index coin) are mirrored left-right, boxes with them.
    """

    SIZE = 96

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.images = rng.integers(0, 256, (n, 3, self.SIZE, self.SIZE), dtype=np.uint8)
        counts = rng.integers(0, 21, n)
        self.boxes: list[list[list[float]]] = []
        for k in counts.tolist():
            xy = rng.uniform(0, self.SIZE - 20, (k, 2))
            wh = rng.uniform(4, 20, (k, 2))
            self.boxes.append(np.concatenate([xy, xy + wh], 1).round(2).tolist())
        self.ids = [f"img_{seed:02d}_{i:06d}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = torch.from_numpy(self.images[index])
        boxes = torch.tensor(self.boxes[index], dtype=torch.float32).reshape(-1, 4)
        if _coin(self.seed, index):
            image = image.flip(-1)
            boxes = torch.stack([self.SIZE - boxes[:, 2], boxes[:, 1],
                                 self.SIZE - boxes[:, 0], boxes[:, 3]], 1)
        return {"image": image, "boxes": boxes, "image_id": self.ids[index]}


def detection_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack the images; boxes and ids stay lists (their lengths differ per image)."""
    return {"image": torch.stack([s["image"] for s in samples]),
            "boxes": [s["boxes"] for s in samples],
            "image_id": [s["image_id"] for s in samples]}


# ---------------------------------------------------------------------- text

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class TextLines(Dataset):
    """Lines of words (Zipf-distributed over a made-up vocabulary, some capitalised,
    commas and full stops, about 3% of words unknown) and a label per line.

    A sample tokenises its line in Python: lower-case, split punctuation off, split on
    spaces, look each word up in the vocabulary (``UNK`` when absent), add ``BOS`` and
    ``EOS``: ``{"input_ids": int64 tensor, "label": int}``.
    """

    def __init__(self, n: int, seed: int = 0, vocab_size: int = 8000,
                 words: tuple[int, int] = (8, 60)) -> None:
        rng = random.Random(seed)
        letters = string.ascii_lowercase
        known: set[str] = set()
        while len(known) < vocab_size:
            known.add("".join(rng.choices(letters, k=rng.randint(2, 10))))
        vocab = sorted(known)
        rng.shuffle(vocab)  # rank order for the Zipf weights
        self.vocab = {w: i + 4 for i, w in enumerate(vocab)}
        self.vocab.update({",": len(self.vocab) + 4, ".": len(self.vocab) + 5})
        cum, total = [], 0.0
        for rank in range(vocab_size):
            total += 1.0 / (rank + 1)
            cum.append(total)
        self.lines: list[str] = []
        for _ in range(n):
            out = []
            for w in rng.choices(vocab, cum_weights=cum, k=rng.randint(*words)):
                r = rng.random()
                if r < 0.03:
                    w = w[::-1] + "q"  # not in the vocabulary (almost surely)
                elif r < 0.10:
                    w = w.capitalize()
                out.append(w + ("," if rng.random() < 0.06 else ""))
            self.lines.append(" ".join(out) + ".")
        self.labels = [rng.randrange(5) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> dict[str, Any]:
        text = self.lines[index].lower().replace(",", " ,").replace(".", " .")
        vocab = self.vocab
        ids = [BOS] + [vocab.get(t, UNK) for t in text.split()] + [EOS]
        return {"input_ids": torch.tensor(ids, dtype=torch.int64), "label": self.labels[index]}


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad ``input_ids`` to the batch's longest with ``PAD``; a mask marks the tokens."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD, dtype=torch.int64)
    mask = torch.zeros((len(samples), longest), dtype=torch.bool)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = s["input_ids"]
        mask[row, :n] = True
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.tensor([s["label"] for s in samples], dtype=torch.int64)}


# --------------------------------------------------------------------- cifar

class CifarRng(Dataset):
    """32x32 RGB uint8 images in one array; each sample draws its augmentation from
    ``np.random.default_rng((seed, index))``: zero-pad 4, crop 32x32, flip half.
    Returns ``(uint8 3x32x32 tensor, int64 label tensor)``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, n)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, index))
        img = np.pad(self.images[index], ((4, 4), (4, 4), (0, 0)))
        dy, dx = rng.integers(0, 9, 2)
        img = img[dy:dy + 32, dx:dx + 32]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
                torch.tensor(self.labels[index]))


# ----------------------------------------------------------------------- npy

NPY_SHAPE = (192, 192, 3)
NPY_CROP = 160
_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def ensure_npy_files(parent: str, n: int, seed: int = 0) -> str:
    """Write ``n`` deterministic ``.npy`` images into a folder under ``parent`` once
    (a marker file written last; a folder without it is rewritten) and return it."""
    root = os.path.join(parent, f"outcome-npy-v1-n{n}-s{seed}")
    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return root
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng((seed, i))
        base = rng.integers(0, 256, (1, 1, 3))
        noise = rng.integers(-40, 41, NPY_SHAPE)
        np.save(os.path.join(root, f"{i:06d}.npy"),
                np.clip(base + noise, 0, 255).astype(np.uint8))
    with open(marker, "w") as f:
        f.write("ok\n")
    return root


class NpyFiles(Dataset):
    """``.npy`` HxWx3 uint8 files: load, crop ``NPY_CROP`` square at a per-sample
    offset, to float32 in [0, 1], normalise by ImageNet's mean and std, CHW.
    Returns ``(float32 3xCxC tensor, int label)``."""

    def __init__(self, root: str, seed: int = 0) -> None:
        self.paths = sorted(os.path.join(root, n) for n in os.listdir(root)
                            if n.endswith(".npy"))
        self.seed = seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        arr = np.load(self.paths[index])
        rng = random.Random(self.seed * 1_000_003 + index)
        top = rng.randint(0, arr.shape[0] - NPY_CROP)
        left = rng.randint(0, arr.shape[1] - NPY_CROP)
        crop = arr[top:top + NPY_CROP, left:left + NPY_CROP].transpose(2, 0, 1)
        out = crop.astype(np.float32)
        out *= 1 / 255
        out -= _MEAN
        out /= _STD
        return torch.from_numpy(out), index % 10


# ------------------------------------------------------- GIL-bound / GIL-free

def python_features(seed: int, length: int) -> list[float]:
    """Eight summary statistics of ``length`` pseudo-random values, all in pure Python
    (generation, a sort, a running pass): the GIL is held from start to end."""
    rng = random.Random(seed)
    values = [rng.random() for _ in range(length)]
    values.sort()
    total = sq = peak = 0.0
    runs = 0
    prev = 0.0
    for v in values:
        total += v
        sq += v * v
        d = v - prev
        if d > peak:
            peak = d
        if d > 1.0 / length:
            runs += 1
        prev = v
    mean = total / length
    return [mean, sq / length - mean * mean, values[length // 2], values[length // 10],
            values[-length // 10], peak, runs / length, float(length)]


class PythonRows(Dataset):
    """Samples computed by :func:`python_features` (about 1 ms of pure Python each):
    ``(float32 tensor of 8, int label)``."""

    def __init__(self, n: int, seed: int = 0, length: int = 4000) -> None:
        self.n, self.seed, self.length = n, seed, length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        feats = python_features(self.seed * 1_000_003 + index, self.length)
        return torch.tensor(feats, dtype=torch.float32), index % 10


class PngAugment(Dataset):
    """64x64 RGB PNGs encoded once into RAM (``images`` distinct ones, posterised so
    they compress), each sample decoded by Pillow, rotated by a per-sample angle in
    [-15, 15) degrees, flipped for half the samples, and returned as float32 CHW in
    [0, 1] with an int label: Pillow's C code releases the GIL for part of each
    sample (the inflate, the rotation), Python holds it for the rest."""

    SIDE = 64

    def __init__(self, n: int, seed: int = 0, images: int = 256) -> None:
        from PIL import Image
        rng = np.random.default_rng(seed)
        self.n = n
        self.blobs = []
        for _ in range(min(images, n)):
            pixels = rng.integers(0, 256, (self.SIDE, self.SIDE, 3), dtype=np.uint8) // 32 * 32
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            self.blobs.append(buf.getvalue())
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # the bench's extra: imported where the set is used
        image = Image.open(io.BytesIO(self.blobs[i % len(self.blobs)])).convert("RGB")
        angle = float(np.random.default_rng((self.seed, i)).uniform(-15.0, 15.0))
        image = image.rotate(angle, resample=Image.Resampling.BILINEAR)
        if _coin(self.seed, i):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))), i % 10


class AudioClips(Dataset):
    """One-second waveforms (float32 at 16 kHz) in one array in RAM; each sample draws
    a 0.5 s crop and a gain in [0.5, 1.5) from ``np.random.default_rng((seed, index))``
    and returns the crop's log-magnitude spectrogram (Hann frames of ``FRAME`` samples,
    hop ``HOP``, ``np.fft.rfft``) as a float32 ``(frames, FRAME // 2 + 1)`` tensor, with
    an int label.  Many small NumPy calls: each releases the GIL inside, Python holds
    it between them."""

    RATE, FRAME, HOP = 16000, 400, 160

    def __init__(self, n: int, seed: int = 0, clips: int = 512) -> None:
        rng = np.random.default_rng(seed)
        self.n = n
        self.seed = seed
        self.waves = rng.standard_normal((min(clips, n), self.RATE), dtype=np.float32)
        self.window = np.hanning(self.FRAME).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng((self.seed, i))
        half = self.RATE // 2
        start = int(rng.integers(0, self.RATE - half + 1))
        wave = self.waves[i % len(self.waves), start:start + half] * np.float32(
            rng.uniform(0.5, 1.5))
        frames = np.lib.stride_tricks.sliding_window_view(wave, self.FRAME)[::self.HOP]
        spectrum = np.abs(np.fft.rfft(frames * self.window, axis=1))
        return torch.from_numpy(np.log1p(spectrum).astype(np.float32)), i % 10


class HashChunks(Dataset):
    """SHA-256 of a ``chunk``-byte window of one random buffer in RAM (hashlib releases
    the GIL while it digests more than 2 KiB), plus the window's first 4 KiB as data:
    ``(uint8 tensor of 32, uint8 tensor of 4096)``."""

    def __init__(self, n: int, seed: int = 0, chunk: int = 512 << 10,
                 buffer: int = 32 << 20) -> None:
        self.n, self.chunk = n, chunk
        self.buffer = np.random.default_rng(seed).integers(0, 256, buffer, dtype=np.uint8)
        self.stride = 4099 * 16  # windows at scattered offsets

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (index * self.stride) % (len(self.buffer) - self.chunk)
        window = self.buffer[start:start + self.chunk]
        digest = hashlib.sha256(window.data).digest()
        return (torch.frombuffer(bytearray(digest), dtype=torch.uint8),
                torch.from_numpy(window[:4096].copy()))


class SlowReads(Dataset):
    """Rows read from slow storage: each ``__getitem__`` blocks ``wait_s`` (a read
    that waits on a device or the network, the GIL released), then turns 4 KiB of
    bytes from a per-sample generator into float32 in [0, 1]."""

    def __init__(self, n: int, seed: int = 0, wait_s: float = 0.003) -> None:
        self.n, self.seed, self.wait_s = n, seed, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        raw = np.random.default_rng((self.seed, index)).bytes(4096)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.float32) / 255)


class PhasedCost(Dataset):
    """Indices below ``cheap`` are cheap rows (:class:`CifarRng`'s, about 0.06 ms
    each); the others run :func:`python_features` (pure Python, about 1 ms) and pack
    the result into the same row shape.  ``(uint8 3x32x32 tensor, int64 label
    tensor)`` either way."""

    def __init__(self, cheap: int, costly: int, seed: int = 0, length: int = 4000) -> None:
        self.cheap, self.costly, self.seed, self.length = cheap, costly, seed, length
        self.rows = CifarRng(min(cheap, 4096), seed)

    def __len__(self) -> int:
        return self.cheap + self.costly

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < self.cheap:
            return self.rows[index % len(self.rows)]
        feats = python_features(self.seed * 1_000_003 + index, self.length)
        row = np.full((3, 32, 32), int(feats[0] * 255), np.uint8)
        row[0, 0, :8] = [int(min(255, max(0, f * 255))) for f in feats]
        return torch.from_numpy(row), torch.tensor(index % 10)

    def order(self, seed: int) -> list[int]:
        """The cheap indices (shuffled) first, then the costly ones (shuffled)."""
        rng = np.random.default_rng(seed)
        return (rng.permutation(self.cheap).tolist()
                + (self.cheap + rng.permutation(self.costly)).tolist())


SQLITE_SHAPE = (64, 64, 3)


def ensure_sqlite_file(parent: str, n: int, seed: int = 0) -> str:
    """A SQLite file of ``n`` rows ``(i, label, pixels)`` (64x64x3 uint8 blobs from
    ``seed``) under ``parent``, written once (renamed into place when complete)."""
    path = os.path.join(parent, f"rows-{n}-{seed}.sqlite")
    if not os.path.exists(path):
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        rng = np.random.default_rng(seed)
        conn = sqlite3.connect(tmp)
        conn.execute("create table rows (i integer primary key, label integer, pixels blob)")
        conn.executemany("insert into rows values (?, ?, ?)",
                         ((i, int(rng.integers(10)),
                           rng.integers(0, 256, SQLITE_SHAPE, dtype=np.uint8).tobytes())
                          for i in range(n)))
        conn.commit()
        conn.close()
        os.replace(tmp, path)
    return path



class SqliteRows(Dataset):
    """Images read from a SQLite file through a connection opened in ``__init__``, as
    users write it: ``sqlite3`` lets only the thread that opened a connection use it.
    Flipped for half the samples (by the index), normalised to float32 CHW."""

    def __init__(self, path: str, seed: int = 0) -> None:
        self.seed = seed
        self.conn = sqlite3.connect(path)
        (self.n,) = self.conn.execute("select count(*) from rows").fetchone()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label, blob = self.conn.execute("select label, pixels from rows where i = ?",
                                        (index,)).fetchone()
        img = np.frombuffer(blob, dtype=np.uint8).reshape(SQLITE_SHAPE)
        if _coin(self.seed, index):
            img = img[:, ::-1]
        chw = np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)
        return torch.from_numpy(chw / 255.0 - 0.5), label


def tensor_rows(n: int, seed: int = 0, features: int = 64) -> TensorDataset:
    """``TensorDataset(features, labels)``: ``n`` rows of ``features`` float32 values
    and an int64 label in ten classes, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g),
                         torch.randint(0, 10, (n,), generator=g))


# ------------------------------------------------------------------ registry

@dataclass(frozen=True)
class UserSet:
    """One data set of the outcome bench: how to build it, full-size and quick."""

    name: str
    description: str
    batch_size: int
    samples: int        # samples per epoch (full size)
    quick_samples: int  # samples per epoch with ``quick``
    expect: str         # the clear-cut outcome it stands for, or "" (for the report)
    # DataLoader num_workers a user would try on this set besides the bench's own
    # (rows that wait: more workers than cores overlap more waits)
    more_workers: tuple[int, ...] = ()


DATASETS: dict[str, UserSet] = {s.name: s for s in (
    UserSet("detection", "dict samples: 3x96x96 image from RAM, 0-20 boxes, string id; "
            "collate stacks images, lists boxes and ids", 32, 32768, 256, ""),
    UserSet("text", "text lines tokenised in Python (split, vocab look-ups), dict samples, "
            "pad-to-longest collate", 64, 49152, 512, ""),
    UserSet("cifar-rng", "CIFAR-like 32x32, per-sample np.random.default_rng, "
            "pad/crop/flip, tensors out", 128, 24576, 512, ""),
    UserSet("npy", ".npy files from disk (192x192x3 uint8), crop 160 + normalise", 32,
            3072, 128, ""),
    UserSet("gil-python", "pure-Python per-sample function (GIL held)", 32, 1536, 64,
            "processes"),
    UserSet("gil-free", "SHA-256 over a 512 KiB window in RAM (GIL released)", 32, 3072, 64,
            "threads"),
    UserSet("png-augment", "64x64 PNGs from RAM decoded by Pillow, rotated and flipped per "
            "sample, float CHW out (the GIL released for part of each sample)", 64, 4096,
            128, ""),
    UserSet("audio", "1 s waveforms from RAM: a per-sample 0.5 s crop and gain, a NumPy "
            "log spectrogram (small NumPy calls, the GIL released inside each)", 32, 4096,
            128, ""),
    UserSet("tensors", "TensorDataset: 64 float32 features and an int64 label a row, "
            "default collate", 256, 327680, 1024, ""),
    UserSet("slow-reads", "rows that block 3 ms in __getitem__ (a read from slow storage, "
            "the GIL released), then 4 KiB to float32", 32, 1536, 64, "threads", (8, 16)),
    UserSet("sqlite", "64x64x3 images from a SQLite file through a sqlite3 connection "
            "opened in __init__ (usable only in the thread that opened it), flipped, "
            "float CHW out", 64, 16384, 256, "inline"),
    UserSet("phased", "first half of the epoch cheap numpy rows, second half pure Python "
            "(the cost changes mid-epoch)", 32, 12288 + 768, 256 + 32, ""),
)}


def build(name: str, *, quick: bool = False, workdir: str | None = None,
          seed: int = 0) -> Built:
    """Build data set ``name`` of :data:`DATASETS` in this process.  ``workdir`` holds
    generated files (the ``npy`` and ``sqlite`` sets; default: the system's temporary folder)."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    samples = spec.quick_samples if quick else spec.samples
    # where the sets that live in files (npy, sqlite) write them
    parent = workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "asyncfeed-outcome")
    ds: Dataset
    collate: Callable[[list[Any]], Any] | None = None
    if name == "detection":
        ds, collate = DetectionSet(min(samples, 2048), seed), detection_collate
    elif name == "text":
        ds, collate = TextLines(min(samples, 12288), seed), pad_collate
    elif name == "cifar-rng":
        ds = CifarRng(samples, seed)
    elif name == "npy":
        ds = NpyFiles(ensure_npy_files(parent, min(samples, 1024), seed), seed)
    elif name == "gil-python":
        ds = PythonRows(samples, seed)
    elif name == "gil-free":
        ds = HashChunks(samples, seed)
    elif name == "png-augment":
        ds = PngAugment(samples, seed)
    elif name == "audio":
        ds = AudioClips(samples, seed)
    elif name == "tensors":
        ds = tensor_rows(samples, seed)
    elif name == "slow-reads":
        ds = SlowReads(samples, seed)
    elif name == "sqlite":
        ds = SqliteRows(ensure_sqlite_file(parent, min(samples, 2048), seed), seed)
    else:  # phased
        costly = 768 if not quick else 32
        phased = PhasedCost(samples - costly, costly, seed)
        return Built(phased, phased.order(seed), spec.batch_size, None)
    return Built(ds, sample_order(len(ds), samples, seed), spec.batch_size,
                 collate)


def pinned_kwargs(mode: str, count: int) -> dict[str, Any]:
    """``AsyncLoader`` keywords that fix its execution to ``mode`` (``inline``,
    ``threads`` or ``processes``) with ``count`` threads or workers (ignored inline):
    what the bench scripts pin a candidate with."""
    kw: dict[str, Any] = {"execution": mode}
    if mode == "threads":
        kw["num_threads"] = count
    elif mode == "processes":
        kw["num_workers"] = count
    return kw
