"""Decoding one image file to a fixed-size ``uint8`` CHW array.

The per-sample function every contender in the benchmarks runs: JPEG bytes in,
``[3, size, size]`` RGB out (short side resized to ``size``, then a center crop).
libjpeg-turbo through simplejpeg does the decode, with DCT-domain downscaling so
the resize starts from the smallest image that is still at least ``size`` on the
short side; Pillow decodes whatever simplejpeg cannot (CMYK, PNG, GIF, WebP...).
Everything heavy releases the GIL.

Before any decoder allocates, the dimensions in the file's header are checked
against ``max_pixels`` (by default what Pillow refuses: more than twice
``PIL.Image.MAX_IMAGE_PIXELS``), so a small file that declares a huge image (a
decompression bomb) fails at once with ``PIL.Image.DecompressionBombError``.

OpenCV's own thread count is left as the process has it (``cv2.setNumThreads``
is process-wide: setting it here would change the user's own OpenCV calls).  At
the usual output sizes OpenCV runs ``resize`` and ``split`` on the calling
thread anyway: it splits a resize into one stripe per 64 Ki output pixels and
runs a single stripe serially.
"""

from __future__ import annotations

import io
import numbers
import os
import sys
import threading
from types import ModuleType
from typing import Literal, Union

import numpy as np
import simplejpeg

Interpolation = Literal["area", "linear"]
#: ``"pillow"`` (Pillow's own limit, read at each call), a number of pixels, or None (no limit)
MaxPixels = Union[int, None, Literal["pillow"]]

_cv2: ModuleType | None = None


def _opencv() -> ModuleType:
    """OpenCV, imported on first use: it is the costliest import of ``import asyncfeed``
    otherwise (~15-30 ms and ~4,000 objects here), and a loader with ``size=None``
    never needs it.  Its process-wide thread count is left alone (see the module
    docstring).  Decoders that resize import it when they are made
    (:func:`preload_resize`)."""
    global _cv2
    if _cv2 is None:
        with _CV2_IMPORT:
            if _cv2 is None:
                _cv2 = _import_opencv()
    return _cv2


def preload_resize() -> None:
    """Import OpenCV now, for a decoder that will resize.  Made with the data set, the
    import is done before any pass: in a pass's first rows it would hold the GIL
    (and the import lock) for every decode thread at once, and be part of what the
    first windows of the execution choice measure."""
    _opencv()


_CV2_IMPORT = threading.Lock()
#: OpenBLAS's wait before its idle threads sleep, as a power of two of CPU cycles
#: (its default is 28: ~0.1 s at 2.5 GHz)
_OPENBLAS_TIMEOUT = "4"


def _import_opencv() -> ModuleType:
    """``import cv2``, without its bundled OpenBLAS spinning a core for ~0.1 s.

    The opencv-python wheels carry their own OpenBLAS, whose thread pool starts at
    load and busy-waits for work ~2**28 cycles before it sleeps: a whole core for
    ~100 ms, measured here, in the first pass's first tasks (where this import
    happens) -- on two cores, half the machine while the tuner measures the rows.
    ``OPENBLAS_THREAD_TIMEOUT``, read once when that library loads, shortens the
    wait; it is set for the import only and only where the user has not set it
    (OpenCV's own BLAS calls then let their threads sleep sooner: nothing the
    loader's ``resize`` uses).  numpy's OpenBLAS is loaded already and unaffected."""
    if "cv2" in sys.modules or "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        import cv2
        return cv2
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = _OPENBLAS_TIMEOUT
    try:
        import cv2
    finally:
        os.environ.pop("OPENBLAS_THREAD_TIMEOUT", None)
    return cv2


_JPEG_MAGIC = b"\xff\xd8\xff"
_PILLOW_DEFAULT_MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3  # PIL.Image.MAX_IMAGE_PIXELS


def pixel_limit(max_pixels: MaxPixels) -> int | None:
    """The largest number of pixels ``max_pixels`` allows (None: no limit).

    ``"pillow"`` is what Pillow itself refuses to open: more than twice
    ``PIL.Image.MAX_IMAGE_PIXELS`` (it only warns between 1x and 2x), or no limit
    when that is None.  Pillow is not imported for this: until it is, nobody can
    have changed its limit from the default.
    """
    if max_pixels == "pillow":
        pil = sys.modules.get("PIL.Image")
        base = getattr(pil, "MAX_IMAGE_PIXELS", _PILLOW_DEFAULT_MAX_PIXELS) if pil \
            else _PILLOW_DEFAULT_MAX_PIXELS
        return None if base is None else 2 * int(base)
    if max_pixels is None:
        return None
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, numbers.Integral) \
            or max_pixels <= 0:
        raise ValueError(f"max_pixels must be a positive int, None or 'pillow', "
                         f"got {max_pixels!r}")
    return int(max_pixels)


def check_pixels(height: int, width: int, limit: int | None) -> None:
    """Raise ``PIL.Image.DecompressionBombError`` when a ``height`` x ``width`` image
    exceeds ``limit``."""
    if limit is not None and height * width > limit:
        from PIL import Image
        raise Image.DecompressionBombError(
            f"the header declares a {width}x{height} image ({width * height} pixels), more "
            f"than max_pixels={limit} (a decompression bomb?); pass a larger max_pixels, or "
            f"None, to decode it")


def decode_rgb(raw: bytes, min_side: int | None = None,
               max_pixels: MaxPixels = "pillow") -> np.ndarray:
    """Decode ``raw`` to an RGB ``uint8`` array of shape ``[H, W, 3]``.

    With ``min_side``, a JPEG may be downscaled in the DCT domain (by 1/2, 1/4 or
    1/8) as long as both sides stay at least ``min_side``.  Grayscale, CMYK and
    progressive JPEGs and any other format Pillow reads (a PNG named ``.jpg``)
    come out as RGB.  Raises ``ValueError`` (or Pillow's ``OSError``) for data that
    is not a complete image, never returns a partial one; raises
    ``PIL.Image.DecompressionBombError`` for an image larger than ``max_pixels``
    (see :func:`pixel_limit`) before decoding it.
    """
    if not raw:
        raise ValueError("empty file")
    limit = pixel_limit(max_pixels)
    if raw[:3] == _JPEG_MAGIC:
        try:
            header = simplejpeg.decode_jpeg_header(raw)
        except ValueError:
            header = None  # Pillow reads the header below, or says what is wrong
        if header is not None:
            check_pixels(header[0], header[1], limit)
        try:
            kw = {}
            if min_side:
                kw = {"min_height": min_side, "min_width": min_side}
            return simplejpeg.decode_jpeg(raw, colorspace="RGB", strict=True, **kw)
        except ValueError:
            pass  # CMYK/YCCK and other oddities: Pillow knows them, or says what is wrong
    return _decode_pillow(raw, min_side, limit)


def _decode_pillow(raw: bytes, min_side: int | None, limit: int | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # imported on first use: only odd files
    try:
        im: Image.Image = Image.open(io.BytesIO(raw))  # reads the header only
    except UnidentifiedImageError:
        raise ValueError(f"not an image file Pillow or simplejpeg can read "
                         f"({len(raw)} bytes starting {raw[:8]!r})") from None
    with im:
        check_pixels(im.height, im.width, limit)
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
                 interpolation: Interpolation = "area",
                 max_pixels: MaxPixels = "pillow") -> np.ndarray:
    """Bytes of an image file to ``uint8`` CHW RGB: ``[3, size, size]``, or full size if None.

    Raises ValueError for a bad ``size``/``interpolation``/``max_pixels`` or
    undecodable data, and ``PIL.Image.DecompressionBombError`` (before decoding)
    for an image whose header declares more than ``max_pixels`` pixels
    (``"pillow"``: what Pillow refuses, more than ``2 * Image.MAX_IMAGE_PIXELS``;
    None: no limit).
    """
    check_size(size)
    check_interpolation(interpolation)
    if size is None:
        return hwc_to_chw(decode_rgb(raw, max_pixels=max_pixels), out)
    return resize_center_crop(decode_rgb(raw, size, max_pixels), size, out, interpolation)
