"""The built-in synthetic ImageNet-like JPEG set the benchmarks run on.

``ensure_synthetic(n_images, n_classes)`` writes, once, a folder in
torchvision's ``ImageFolder`` layout (``root/<class>/<file>.JPEG``) into a cache
folder (``$ASYNCFEED_CACHE`` or ``~/.cache/asyncfeed``) and returns its path.

The files are made to cost what ImageNet's cost: about 110 KB on average, around
500x375 with a mix of the sizes and aspect ratios ImageNet has (landscape,
portrait, square, a few larger ones), about 4% grayscale and 10% progressive.
The pixels are photo-like rather than noise: a 1/f ("natural image") luminance
field, smooth colour regions, a few hard-edged shapes and a little sensor grain.
Pure noise would make 190 KB files that decode far slower than photos do, and
flat colour would make 10 KB files that decode far faster.

Generation is deterministic (image ``i`` depends only on ``seed`` and ``i``),
runs in a few worker processes, and is idempotent and crash-safe: files are
written into a temporary folder, a marker file is written last, and the folder
is renamed into place; a folder without the marker is regenerated.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import cv2
import numpy as np
import simplejpeg
from PIL import Image

FORMAT_VERSION = 1
MARKER = ".complete"

# (width, height, weight): ImageNet is dominated by 500x375 and 500x333 landscape
# photos, with portraits, squares and a tail of larger and smaller ones.
_SHAPES = (
    (500, 375, 36), (375, 500, 14), (500, 333, 14), (333, 500, 4), (500, 500, 8),
    (640, 480, 8), (400, 300, 6), (800, 600, 4), (300, 225, 3), (1024, 768, 3),
)
GRAYSCALE_FRACTION = 0.04
PROGRESSIVE_FRACTION = 0.10
QUALITY = 90
ALPHA = (1.0, 1.3)        # spectral slope of the luminance field (lower: more fine detail)
CONTRAST = (40, 56)       # its standard deviation, in grey levels


def cache_root() -> str:
    """Where generated data sets live: ``$ASYNCFEED_CACHE`` or ``~/.cache/asyncfeed``."""
    env = os.environ.get("ASYNCFEED_CACHE")
    return os.path.abspath(os.path.expanduser(env or os.path.join("~", ".cache", "asyncfeed")))


def dataset_name(n_images: int, n_classes: int, seed: int) -> str:
    return f"synthetic-v{FORMAT_VERSION}-n{n_images}-c{n_classes}-s{seed}"


def is_complete(root: str) -> bool:
    return os.path.isfile(os.path.join(root, MARKER))


def _pick_shape(rng: np.random.Generator) -> tuple[int, int]:
    w = np.array([s[2] for s in _SHAPES], dtype=np.float64)
    k = rng.choice(len(_SHAPES), p=w / w.sum())
    return _SHAPES[k][0], _SHAPES[k][1]


def _smooth(rng: np.random.Generator, h: int, w: int, cells: int, channels: int) -> np.ndarray:
    """A smooth random field: a coarse random grid upsampled with a cubic filter."""
    gh, gw = max(2, cells * h // max(h, w)), max(2, cells * w // max(h, w))
    grid = rng.standard_normal((gh, gw, channels), dtype=np.float32)
    out = cv2.resize(grid, (w, h), interpolation=cv2.INTER_LINEAR)
    return out.reshape(h, w, channels)


def render(seed: int, index: int) -> tuple[np.ndarray, bool, bool]:
    """Pixels of image ``index``: ``(uint8 HxWx3 or HxWx1, grayscale, progressive)``."""
    rng = np.random.default_rng([seed, index])
    w, h = _pick_shape(rng)
    grayscale = bool(rng.random() < GRAYSCALE_FRACTION)
    progressive = bool(rng.random() < PROGRESSIVE_FRACTION)
    # Luminance: a 1/f^alpha field, the power spectrum of natural images.
    alpha = rng.uniform(ALPHA[0], ALPHA[1])
    fy = np.fft.fftfreq(h).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(w).astype(np.float32)[None, :]
    f2 = fx * fx + fy * fy
    f2[0, 0] = 1.0
    weight = np.power(f2, np.float32(-alpha / 2))
    weight[0, 0] = 0
    spec = rng.standard_normal(f2.shape + (2,), dtype=np.float32).view(np.complex64)[..., 0]
    spec *= weight
    lum = np.fft.irfft2(spec, s=(h, w)).astype(np.float32)
    lum *= np.float32(rng.uniform(CONTRAST[0], CONTRAST[1]) / (lum.std() + 1e-6))
    # Objects: a few filled ellipses and polygons with hard edges, slightly softened.
    shapes: np.ndarray = np.zeros((h, w), np.float32)
    for _ in range(int(rng.integers(3, 9))):
        val = float(rng.uniform(-60, 60))
        if rng.random() < 0.5:
            center = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            axes = (int(rng.integers(w // 16, w // 3)), int(rng.integers(h // 16, h // 3)))
            cv2.ellipse(shapes, center, axes, float(rng.uniform(0, 180)), 0, 360, val, -1)
        else:
            pts = np.stack([rng.integers(0, w, 5), rng.integers(0, h, 5)], -1).astype(np.int32)
            cv2.fillPoly(shapes, [pts], val)
    shapes = cv2.GaussianBlur(shapes, (0, 0), 1.2)
    lum += shapes
    # Colour: smooth chroma regions on top of the luminance, then sensor grain.
    base = rng.uniform(80, 170, size=3).astype(np.float32)
    chroma = _smooth(rng, h, w, 6, 3) * np.float32(rng.uniform(10, 30))
    img = lum[..., None] + chroma + base
    img += rng.standard_normal((h, w, 1), dtype=np.float32) * np.float32(rng.uniform(2.0, 4.0))
    np.clip(img, 0, 255, out=img)
    pixels = img.astype(np.uint8)
    if grayscale:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY)[..., None]
    return pixels, grayscale, progressive


def encode(pixels: np.ndarray, progressive: bool, quality: int = QUALITY) -> bytes:
    """JPEG bytes of ``pixels``; progressive ones through Pillow (simplejpeg writes baseline)."""
    if progressive:
        mode = "L" if pixels.shape[2] == 1 else "RGB"
        im = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality, progressive=True, optimize=True)
        return buf.getvalue()
    colorspace = "GRAY" if pixels.shape[2] == 1 else "RGB"
    return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality,
                                  colorspace=colorspace, colorsubsampling="420")


def _class_name(c: int) -> str:
    return f"n{c:08d}"


def _write_chunk(args: tuple[str, int, int, int, int]) -> list[dict]:
    root, seed, n_classes, start, stop = args
    cv2.setNumThreads(1)
    out = []
    for i in range(start, stop):
        pixels, gray, prog = render(seed, i)
        data = encode(pixels, prog)
        cls = _class_name(i % n_classes)
        path = os.path.join(root, cls, f"{cls}_{i:07d}.JPEG")
        with open(path, "wb") as f:
            f.write(data)
        out.append({"bytes": len(data), "w": pixels.shape[1], "h": pixels.shape[0],
                    "gray": gray, "progressive": prog})
    return out


def ensure_synthetic(n_images: int = 2000, n_classes: int = 10, *, seed: int = 0,
                     root: str | None = None, workers: int | None = None,
                     progress: Callable[[int], None] | None = None) -> str:
    """Return the folder of the synthetic set, generating it first if it is not complete.

    ``root`` is the parent folder (default :func:`cache_root`).  ``progress`` is called
    with the number of images just written (for a progress bar).
    """
    if n_images < n_classes or n_classes < 1:
        raise ValueError(f"need n_images >= n_classes >= 1, got {n_images}, {n_classes}")
    parent = os.path.abspath(os.path.expanduser(root or cache_root()))
    final = os.path.join(parent, dataset_name(n_images, n_classes, seed))
    if is_complete(final):
        return final
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(final):  # an interrupted generation (no marker): start over
        shutil.rmtree(final, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final) + "-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        for c in range(n_classes):
            os.makedirs(os.path.join(tmp, _class_name(c)))
        workers = workers or min(os.cpu_count() or 1, 8)
        chunk = max(8, min(64, n_images // (workers * 4) or 1))
        jobs = [(tmp, seed, n_classes, s, min(s + chunk, n_images))
                for s in range(0, n_images, chunk)]
        meta: list[dict] = []
        if workers <= 1 or n_images <= 64:
            for job in jobs:
                meta += _write_chunk(job)
                if progress:
                    progress(job[4] - job[3])
        else:
            import multiprocessing as mp
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
                for job, res in zip(jobs, pool.map(_write_chunk, jobs)):
                    meta += res
                    if progress:
                        progress(job[4] - job[3])
        summary = {
            "format_version": FORMAT_VERSION, "n_images": n_images, "n_classes": n_classes,
            "seed": seed, "total_bytes": sum(m["bytes"] for m in meta),
            "mean_bytes": sum(m["bytes"] for m in meta) / n_images,
            "grayscale": sum(m["gray"] for m in meta),
            "progressive": sum(m["progressive"] for m in meta),
            "mean_width": sum(m["w"] for m in meta) / n_images,
            "mean_height": sum(m["h"] for m in meta) / n_images,
        }
        with open(os.path.join(tmp, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same set first: use theirs
            if not is_complete(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def summary(root: str) -> dict:
    """What ``ensure_synthetic`` recorded about the set (sizes, counts), or ``{}``."""
    try:
        with open(os.path.join(root, "summary.json")) as f:
            return json.load(f)
    except OSError:
        return {}
