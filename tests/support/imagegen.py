"""Real image files for the tests: photo-like pixels saved in the formats real folders hold.

Pixels are smooth gradients and low-frequency waves plus mild noise (sigma 3), so
JPEG artefacts and resampling differences stay small and comparable to what a
photo gives, and every image is deterministic for its seed.

``write(kind, path, h, w, seed)`` writes one file of ``kind``:

good kinds (``GOOD_KINDS``) -- all decodable, Pillow is the reference decoder:
  ``baseline``     RGB JPEG, 4:2:0 (Pillow's default subsampling)
  ``baseline444``  RGB JPEG without chroma subsampling
  ``grayscale``    one-channel JPEG
  ``cmyk``         CMYK JPEG as Pillow writes it: Adobe APP14 marker, inverted values
  ``cmyk_noadobe`` the same with the APP14 marker removed (Pillow and libjpeg-turbo both
                   still read the values as inverted, so they must still agree)
  ``progressive``  progressive RGB JPEG
  ``png_as_jpg``   RGB PNG (the path usually ends in ``.jpg``)
  ``rgba_png``     RGBA PNG
  ``palette_png``  palette (mode "P") PNG
  ``extraneous``   baseline JPEG with stray bytes before its EOI marker ("Corrupt JPEG
                   data: N extraneous bytes before marker 0xd9", common in ImageNet):
                   libjpeg warns, Pillow decodes it anyway

bad kinds (``BAD_KINDS``) -- no decoder may return pixels for them:
  ``truncated``    a baseline JPEG cut in the middle of its scan data
  ``truncated_header`` a baseline JPEG cut inside its headers
  ``truncated_progressive`` a progressive JPEG cut after its first scans
  ``empty``        zero bytes
  ``random``       random bytes
  ``random_jpeg_magic`` random bytes after a JPEG start-of-image marker
  ``text``         a text file
"""

from __future__ import annotations

import io
import os
from typing import Callable

import numpy as np
from PIL import Image

__all__ = ["BAD_KINDS", "GOOD_KINDS", "encode", "photo", "write"]


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Deterministic photo-like ``uint8`` RGB pixels, ``[h, w, 3]``."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, h)[:, None]
    x = np.linspace(0.0, 1.0, w)[None, :]
    chans = []
    for _ in range(3):
        a, b, c = rng.uniform(-1, 1, 3)
        fy, fx, ph = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0), rng.uniform(0, 2 * np.pi)
        v = 128 + 60 * a * x + 40 * b * y + 45 * c * np.sin(2 * np.pi * (fx * x + fy * y) + ph)
        chans.append(np.broadcast_to(v, (h, w)))
    img = np.stack(chans, axis=-1) + rng.normal(0.0, 3.0, (h, w, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _strip_app14(raw: bytes) -> bytes:
    """Remove the Adobe APP14 segment from a JPEG (libjpeg writes one for CMYK)."""
    i = raw.find(b"\xff\xee")
    assert i > 0 and raw[i + 4:i + 9] == b"Adobe", "no Adobe marker to strip"
    n = int.from_bytes(raw[i + 2:i + 4], "big")
    return raw[:i] + raw[i + 2 + n:]


def _jpeg(h: int, w: int, seed: int, **kw) -> bytes:
    return _save(Image.fromarray(photo(h, w, seed)), "JPEG", quality=90, **kw)


def _cut(raw: bytes, frac: float) -> bytes:
    return raw[:max(4, int(len(raw) * frac))]


_ENCODERS: dict[str, Callable[[int, int, int], bytes]] = {
    # good
    "baseline": lambda h, w, s: _jpeg(h, w, s),
    "baseline444": lambda h, w, s: _jpeg(h, w, s, subsampling=0),
    "grayscale": lambda h, w, s: _save(Image.fromarray(photo(h, w, s)).convert("L"), "JPEG",
                                       quality=90),
    "cmyk": lambda h, w, s: _save(Image.fromarray(photo(h, w, s)).convert("CMYK"), "JPEG",
                                  quality=90),
    "cmyk_noadobe": lambda h, w, s: _strip_app14(
        _save(Image.fromarray(photo(h, w, s)).convert("CMYK"), "JPEG", quality=90)),
    "progressive": lambda h, w, s: _jpeg(h, w, s, progressive=True),
    "png_as_jpg": lambda h, w, s: _save(Image.fromarray(photo(h, w, s)), "PNG"),
    "rgba_png": lambda h, w, s: _save(Image.fromarray(photo(h, w, s)).convert("RGBA"), "PNG"),
    "palette_png": lambda h, w, s: _save(
        Image.fromarray(photo(h, w, s)).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
    "extraneous": lambda h, w, s: _jpeg(h, w, s)[:-2] + b"\x00" * 7 + b"\xff\xd9",
    # bad
    "truncated": lambda h, w, s: _cut(_jpeg(h, w, s), 0.6),
    "truncated_header": lambda h, w, s: _jpeg(h, w, s)[:120],
    "truncated_progressive": lambda h, w, s: _cut(_jpeg(h, w, s, progressive=True), 0.4),
    "empty": lambda h, w, s: b"",
    "random": lambda h, w, s: np.random.default_rng(s).bytes(2000),
    "random_jpeg_magic": lambda h, w, s: b"\xff\xd8\xff" + np.random.default_rng(s).bytes(2000),
    "text": lambda h, w, s: b"this is not an image\n" * 20,
}

GOOD_KINDS = ("baseline", "baseline444", "grayscale", "cmyk", "cmyk_noadobe", "progressive",
              "png_as_jpg", "rgba_png", "palette_png", "extraneous")
BAD_KINDS = ("truncated", "truncated_header", "truncated_progressive", "empty", "random",
             "random_jpeg_magic", "text")


def encode(kind: str, h: int = 48, w: int = 64, seed: int = 0) -> bytes:
    """The bytes of a file of ``kind`` (see the module docstring)."""
    return _ENCODERS[kind](h, w, seed)


def write(kind: str, path: str | os.PathLike[str], h: int = 48, w: int = 64,
          seed: int = 0) -> str:
    """Write a file of ``kind`` to ``path`` (parents created); returns the path as str."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode(kind, h, w, seed))
    return path
