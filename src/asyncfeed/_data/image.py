"""Decoding one image file to a fixed-size ``uint8`` CHW array.

The per-sample function every contender in the benchmarks runs: JPEG bytes in,
``[3, size, size]`` RGB out (short side resized to ``size``, then a center crop).
libjpeg-turbo through simplejpeg does the decode, with DCT-domain downscaling so
the resize starts from the smallest image that is still at least ``size`` on the
short side; Pillow decodes whatever simplejpeg cannot (CMYK, PNG, GIF, WebP...).
Everything heavy releases the GIL.
"""

from __future__ import annotations

import io
import numbers
from types import ModuleType
from typing import Literal

import numpy as np
import simplejpeg

Interpolation = Literal["area", "linear"]

_cv2: ModuleType | None = None


def _opencv() -> ModuleType:
    """OpenCV, imported on first use: it is the costliest import of ``import asyncfeed``
    otherwise (~15-30 ms and ~4,000 objects here), and a loader with ``size=None``
    never needs it.  Racing threads both import it (Python's import lock serialises
    that) and both set the thread count: harmless."""
    global _cv2
    if _cv2 is None:
        import cv2
        cv2.setNumThreads(1)  # parallelism comes from the loader's threads, not OpenCV's pool
        _cv2 = cv2
    return _cv2


_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_rgb(raw: bytes, min_side: int | None = None) -> np.ndarray:
    """Decode ``raw`` to an RGB ``uint8`` array of shape ``[H, W, 3]``.

    With ``min_side``, a JPEG may be downscaled in the DCT domain (by 1/2, 1/4 or
    1/8) as long as both sides stay at least ``min_side``.  Grayscale, CMYK and
    progressive JPEGs and any other format Pillow reads (a PNG named ``.jpg``)
    come out as RGB.  Raises ``ValueError`` (or Pillow's ``OSError``) for data that
    is not a complete image; never returns a partial one.
    """
    if not raw:
        raise ValueError("empty file")
    if raw[:3] == _JPEG_MAGIC:
        try:
            kw = {}
            if min_side:
                kw = {"min_height": min_side, "min_width": min_side}
            return simplejpeg.decode_jpeg(raw, colorspace="RGB", strict=True, **kw)
        except ValueError:
            pass  # CMYK/YCCK and other oddities: Pillow knows them, or says what is wrong
    return _decode_pillow(raw, min_side)


def _decode_pillow(raw: bytes, min_side: int | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # imported on first use: only odd files
    try:
        im = Image.open(io.BytesIO(raw))
    except UnidentifiedImageError:
        raise ValueError(f"not an image file Pillow or simplejpeg can read "
                         f"({len(raw)} bytes starting {raw[:8]!r})") from None
    with im:
        if min_side and im.format == "JPEG":
            im.draft("RGB", (min_side, min_side))
        im.load()  # raises on truncated data: Pillow is strict unless told otherwise
        if im.mode != "RGB":
            im = im.convert("RGB")
        return np.asarray(im)


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """The ``(h, w)`` with short side ``size`` and the aspect ratio kept (rounded)."""
    if height <= width:
        return size, max(size, round(width * size / height))
    return max(size, round(height * size / width)), size


def resize_center_crop(rgb: np.ndarray, size: int, out: np.ndarray | None = None,
                       interpolation: Interpolation = "area") -> np.ndarray:
    """Resize the short side of ``rgb`` (HWC) to ``size``, center-crop, write CHW.

    The result (``[3, size, size]`` ``uint8``) goes into ``out`` when given (any
    writable array of that shape, e.g. a row of a pinned batch slot), else into a
    new array.  ``"area"`` antialiases on downscaling (OpenCV ``INTER_AREA``),
    ``"linear"`` is bilinear without antialiasing: several times cheaper, fine when
    the DCT scaling already brought the image within 2x of ``size``.
    """
    h, w = rgb.shape[:2]
    nh, nw = resized_shape(h, w, size)
    if (nh, nw) != (h, w):
        shrink = nh < h
        cv2 = _opencv()
        flag = cv2.INTER_AREA if (shrink and interpolation == "area") else cv2.INTER_LINEAR
        rgb = cv2.resize(rgb, (nw, nh), interpolation=flag)
    top, left = (nh - size) // 2, (nw - size) // 2
    return hwc_to_chw(rgb[top:top + size, left:left + size], out)


def hwc_to_chw(hwc: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Copy an ``[H, W, C]`` ``uint8`` image into ``out`` (``[C, H, W]``, new if None).

    OpenCV's ``split`` writes each channel plane 3-4x faster than NumPy's
    strided transpose copy (17 vs 55 us for 224x224); ``out`` arrays it cannot
    write into (planes that are not contiguous) go through NumPy.  Same pixels
    either way.
    """
    h, w, c = hwc.shape
    if out is None:
        out = np.empty((c, h, w), np.uint8)
    if c > 1 and hwc.dtype == np.uint8 and out.dtype == np.uint8 \
            and out.shape == (c, h, w) and out.flags.c_contiguous:
        planes = [out[k] for k in range(c)]
        got = _opencv().split(hwc, planes)
        if all(g is p for g, p in zip(got, planes)):
            return out
    np.copyto(out, hwc.transpose(2, 0, 1))
    return out


def check_size(size: object, allow_none: bool = True) -> None:
    """Raise ValueError unless ``size`` is a positive int (or None when allowed)."""
    if size is None and allow_none:
        return
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0:
        raise ValueError(f"size must be a positive int{' or None' if allow_none else ''}, "
                         f"got {size!r}")


def check_interpolation(interpolation: object) -> None:
    if interpolation not in ("area", "linear"):
        raise ValueError(f"interpolation must be 'area' or 'linear', got {interpolation!r}")


def decode_image(raw: bytes, size: int | None, out: np.ndarray | None = None,
                 interpolation: Interpolation = "area") -> np.ndarray:
    """Bytes of an image file to ``uint8`` CHW RGB: ``[3, size, size]``, or full size if None.

    Raises ValueError for a bad ``size``/``interpolation`` or undecodable data.
    """
    check_size(size)
    check_interpolation(interpolation)
    if size is None:
        return hwc_to_chw(decode_rgb(raw), out)
    return resize_center_crop(decode_rgb(raw, size), size, out, interpolation)
