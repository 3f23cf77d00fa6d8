"""Training augmentation fused into decoding: random-resized-crop and horizontal flip.

The crop window is torchvision's ``RandomResizedCrop``: up to ten tries of an
area drawn uniformly from ``scale`` (a share of the image) and an aspect ratio
drawn log-uniformly from ``ratio``, kept when it fits in the image, at a uniform
position; after ten misses, the central crop of the whole image clamped to
``ratio``.  A flip follows with probability ``hflip``.

Everything random about a sample comes from one counter-based generator (numpy's
Philox) keyed by ``(seed, epoch, key)`` (``key``: the sample's index, or a hash
naming it): a sample gets the same window and flip whichever thread, process or
loader decodes it and whenever (resumed or not), and another one each epoch.

The window is drawn from the dimensions in the JPEG header, before decoding, so
the decoder does only what the window needs: libjpeg-turbo decodes at 1/2, 1/4
or 1/8 scale (its DCT-domain reduction) whenever the window stays at least
``size`` on both sides at that scale.  Only those three reductions are used: the
other M/8 scales run libjpeg-turbo's plain-C IDCTs and decode slower than full
size (``docs/augmentation.md`` has the measurements).  Where libjpeg-turbo 3 is
installed (``asyncfeed[turbo]``), only the window's region is decoded
(:mod:`.jpegregion`); otherwise the whole image, and the window is cut out of it:
the same pixels either way.  The window is then resized with the chosen
interpolation, flipped, and written as CHW in place.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg

from . import jpegregion
from .image import (_JPEG_MAGIC, Interpolation, MaxPixels, _decode_pillow, _opencv,
                    check_pixels, hwc_to_chw, pixel_limit, preload_resize)

__all__ = ["RandomResizedCrop", "RandomResizedCropDecoder", "Window",
           "decode_random_resized_crop", "draw_window", "resolve_seed", "sample_uniforms"]

#: uniforms each sample draws: two per try, then top, left and the flip
TRIES = 10
N_UNIFORMS = 2 * TRIES + 3
_TOP, _LEFT, _FLIP = 2 * TRIES, 2 * TRIES + 1, 2 * TRIES + 2
_U64 = np.uint64(11)
_TO_UNIT = 1.0 / (1 << 53)
_MASK64 = (1 << 64) - 1
#: the DCT-domain reductions used (denominators); see the module docstring
_REDUCTIONS = (8, 4, 2)


def sample_uniforms(seed: int, epoch: int, key: int) -> list[float]:
    """``N_UNIFORMS`` floats in [0, 1) for sample ``key`` of ``epoch`` under ``seed``.

    Philox is counter-based: the key is the seed and the counter's upper words are
    ``(key, epoch)``, so every sample's stream is its own (the draws advance only
    the lowest word), with no state shared between samples.  Each thread keeps one
    generator and sets its whole state per sample: building a generator per sample
    draws OS entropy (its seed sequence) only to override it, and costs several
    times the draw (``bench/augment_decode_costs.py`` section 3 times both).
    """
    try:
        gen = _GENERATOR.philox
    except AttributeError:
        gen = _GENERATOR.philox = np.random.Philox(key=np.zeros(2, np.uint64))
    gen.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.array([0, int(key) & _MASK64, int(epoch) & _MASK64, 0],
                                      np.uint64),
                  "key": np.array([seed & _MASK64, (seed >> 64) & _MASK64], np.uint64)},
        "buffer": _NO_BUFFER, "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
    bits = gen.random_raw(N_UNIFORMS)
    out: list[float] = ((bits >> _U64) * _TO_UNIT).tolist()
    return out


#: each thread's Philox generator (see sample_uniforms)
_GENERATOR = threading.local()
_NO_BUFFER = np.zeros(4, np.uint64)  # an empty buffer: buffer_pos 4 reads none of it


@dataclass(frozen=True)
class Window:
    """A crop window in the full-size image, and whether to flip it."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def _pair(name: str, value: Any, positive: bool) -> tuple[float, float]:
    try:
        pair = tuple(value)
        if len(pair) != 2:
            raise ValueError
        lo, hi = float(pair[0]), float(pair[1])
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of numbers (low, high), got {value!r}") \
            from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi or (positive and lo <= 0) \
            or lo < 0:
        raise ValueError(f"{name} must be (low, high) with 0 {'<' if positive else '<='} low "
                         f"<= high, got {value!r}")
    return lo, hi


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` parameters.

    ``scale``: the window's area as a share of the image's, drawn uniformly;
    ``ratio``: its width / height, drawn log-uniformly; ``hflip``: the chance of a
    horizontal flip.  Raises ValueError for values torchvision would reject or
    that draw nothing (``hflip`` outside [0, 1]).
    """

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _pair("scale", self.scale, positive=False))
        object.__setattr__(self, "ratio", _pair("ratio", self.ratio, positive=True))
        if isinstance(self.hflip, bool) or not isinstance(self.hflip, numbers.Real) \
                or not 0.0 <= float(self.hflip) <= 1.0:
            raise ValueError(f"hflip must be a probability in [0, 1], got {self.hflip!r}")
        object.__setattr__(self, "hflip", float(self.hflip))


def draw_window(height: int, width: int, u: list[float], spec: RandomResizedCrop) -> Window:
    """The window for a ``height`` x ``width`` image from the uniforms ``u``
    (:func:`sample_uniforms`), by torchvision's algorithm (see the module docstring)."""
    area = height * width
    lo_s, hi_s = spec.scale
    lo_r, hi_r = math.log(spec.ratio[0]), math.log(spec.ratio[1])
    flip = u[_FLIP] < spec.hflip
    for t in range(TRIES):
        target = area * (lo_s + (hi_s - lo_s) * u[2 * t])
        aspect = math.exp(lo_r + (hi_r - lo_r) * u[2 * t + 1])
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = min(int(u[_TOP] * (height - h + 1)), height - h)
            left = min(int(u[_LEFT] * (width - w + 1)), width - w)
            return Window(top, left, h, w, flip)
    in_ratio = width / height
    if in_ratio < spec.ratio[0]:
        w, h = width, int(round(width / spec.ratio[0]))
    elif in_ratio > spec.ratio[1]:
        h, w = height, int(round(height * spec.ratio[1]))
    else:
        w, h = width, height
    return Window((height - h) // 2, (width - w) // 2, h, w, flip)


def _reduction(win: Window, size: int) -> int:
    """The largest DCT reduction (8, 4, 2 or 1) at which the window stays >= ``size``
    on both sides."""
    for k in _REDUCTIONS:
        if win.height // k >= size and win.width // k >= size:
            return k
    return 1


def _decode_window(raw: bytes, win_of: Callable[[int, int], Window], size: int, limit: int | None
                   ) -> tuple[np.ndarray, Window]:
    """Decode ``raw`` (at a reduced scale where the window allows) and cut out the
    window ``win_of(height, width)`` draws: ``(HWC pixels of the window, window)``.
    Only the window's region is decoded where :mod:`.jpegregion` can; otherwise
    the whole image, with the same pixels."""
    if raw[:3] == _JPEG_MAGIC:
        region = jpegregion.read_header(raw) if isinstance(raw, bytes) else None
        dims: tuple[int, int] | None = None
        if region is not None:
            dims = region.height, region.width
        else:
            try:
                header = simplejpeg.decode_jpeg_header(raw)
                dims = int(header[0]), int(header[1])
            except ValueError:
                pass  # Pillow reads the header below, or says what is wrong
        if dims is not None:
            height, width = dims
            check_pixels(height, width, limit)
            win = win_of(height, width)
            k = _reduction(win, size)
            oh, ow = -(-height // k), -(-width // k)
            if region is not None:
                y0, y1, x0, x1 = _bounds(win, height, width, oh, ow)
                crop = jpegregion.decode_region(raw, region, k, (y0, y1), (x0, x1))
                if crop is not None:
                    return crop, win
            kw = {} if k == 1 else {"min_height": oh, "min_width": ow}
            try:
                rgb = simplejpeg.decode_jpeg(raw, colorspace="RGB", strict=True, **kw)
            except ValueError:
                rgb = None  # CMYK/YCCK and other oddities: Pillow below
            if rgb is not None:
                return _cut(rgb, win, height, width), win
    rgb = _decode_pillow(raw, None, limit)
    height, width = rgb.shape[:2]
    win = win_of(height, width)
    return _cut(rgb, win, height, width), win


def _bounds(win: Window, height: int, width: int, oh: int, ow: int
            ) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the window of a full-size ``height`` x ``width`` image
    in that image decoded at ``oh`` x ``ow`` (rounded to its pixels, never empty)."""
    if (oh, ow) == (height, width):
        return win.top, win.top + win.height, win.left, win.left + win.width
    sy, sx = oh / height, ow / width
    y0, x0 = round(win.top * sy), round(win.left * sx)
    y1 = max(y0 + 1, min(oh, round((win.top + win.height) * sy)))
    x1 = max(x0 + 1, min(ow, round((win.left + win.width) * sx)))
    return y0, y1, x0, x1


def _cut(rgb: np.ndarray, win: Window, height: int, width: int) -> np.ndarray:
    """The window of a full-size ``height`` x ``width`` image in ``rgb``, which may be
    that image decoded at a reduced scale (:func:`_bounds`)."""
    y0, y1, x0, x1 = _bounds(win, height, width, rgb.shape[0], rgb.shape[1])
    return rgb[y0:y1, x0:x1]


def decode_random_resized_crop(raw: bytes, size: int, uniforms: list[float],
                               spec: RandomResizedCrop, out: np.ndarray | None = None,
                               interpolation: Interpolation = "area",
                               max_pixels: MaxPixels = "pillow") -> np.ndarray:
    """Bytes of an image file to a ``[3, size, size]`` ``uint8`` RGB training sample:
    the window ``uniforms`` draw (:func:`draw_window`), resized to ``size`` x ``size``
    (``"area"`` antialiases where the window shrinks; ``"linear"`` is bilinear
    without antialiasing), flipped if drawn, written into ``out`` when given.

    Raises ValueError (or Pillow's ``OSError``) for data that is not a complete
    image and ``PIL.Image.DecompressionBombError`` before decoding an image larger
    than ``max_pixels``, as :func:`asyncfeed.decode_image` does.
    """
    if not raw:
        raise ValueError("empty file")
    limit = pixel_limit(max_pixels)
    crop, win = _decode_window(raw, lambda h, w: draw_window(h, w, uniforms, spec), size, limit)
    cv2 = _opencv()
    crop = _resize(crop, size, interpolation, cv2)
    if win.flip:
        crop = cv2.flip(crop, 1)
    return hwc_to_chw(crop, out)


#: above this shrink factor the prefilter grows long: OpenCV's box filter (INTER_AREA)
#: antialiases instead
_PREFILTER_MAX_FACTOR = 4.0


@functools.lru_cache(maxsize=4096)
def _prefilter(side: int, size: int) -> np.ndarray | None:
    """The 1-D smoothing kernel for shrinking ``side`` pixels to ``size`` before
    bilinear sampling (None: nothing to smooth).

    torchvision's antialiased bilinear resize filters with a triangle of
    half-width ``f = side / size`` input pixels (variance ``f**2 / 6``); bilinear
    sampling alone is the triangle of half-width 1 (variance ``1 / 6``).  The
    kernel supplies the difference, ``v = (f**2 - 1) / 6``, as its discrete
    variance: ``[v/2, 1 - v, v/2]`` (exactly) up to ``v = 1/2``, where a Gaussian
    sampled that narrow would lose its variance between the taps; a sampled
    Gaussian of variance ``v`` (within a few percent) beyond.  Cached and shared
    between threads, so read-only.
    """
    f = side / size
    v = (f * f - 1.0) / 6.0
    if v < 1e-3:
        return None
    if v <= 0.5:
        k = np.array([v / 2, 1.0 - v, v / 2], np.float32)
    else:
        r = math.ceil(3.0 * math.sqrt(v))
        x = np.arange(-r, r + 1, dtype=np.float64)
        g = np.exp(-x * x / (2.0 * v))
        k = (g / g.sum()).astype(np.float32)
    k.flags.writeable = False
    return k


_IDENTITY = np.ones(1, np.float32)
_IDENTITY.flags.writeable = False


def _resize(crop: np.ndarray, size: int, interpolation: Interpolation, cv2: Any) -> np.ndarray:
    """``crop`` (HWC) resized to ``size`` x ``size``.

    ``"linear"``: bilinear.  ``"area"``: antialiased along each axis the window
    shrinks on, approximating torchvision's ``antialias=True``: :func:`_prefilter`
    per axis, then bilinear (about half the CPU of OpenCV's ``INTER_AREA`` at the
    fractional factors a random crop has, and nearer torchvision's pixels); beyond
    a ``_PREFILTER_MAX_FACTOR`` shrink, ``INTER_AREA``.  Axes that grow are
    interpolated bilinearly either way."""
    ch, cw = crop.shape[:2]
    if (ch, cw) == (size, size):
        return crop
    if interpolation == "area":
        if max(ch, cw) > _PREFILTER_MAX_FACTOR * size:
            flag = cv2.INTER_AREA if min(ch, cw) >= size else cv2.INTER_LINEAR
            return cv2.resize(crop, (size, size), interpolation=flag)
        ky, kx = _prefilter(ch, size), _prefilter(cw, size)
        if ky is not None or kx is not None:
            crop = cv2.sepFilter2D(crop, -1, _IDENTITY if kx is None else kx,
                                   _IDENTITY if ky is None else ky,
                                   borderType=cv2.BORDER_REFLECT_101)
    return cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)


def resolve_seed(seed: object) -> int:
    """``seed`` as the augmentation seed: a non-negative int below 2**128 as it is;
    None: ``torch.initial_seed()``, so ``torch.manual_seed`` fixes it as it fixes
    DataLoader's worker seeds (read when the dataset is made: pass ``seed=`` to
    resume in another process with the same windows when torch is not seeded)."""
    if seed is None:
        import torch
        return int(torch.initial_seed())
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
            or not 0 <= int(seed) < 1 << 128:
        raise ValueError(f"seed must be an int in [0, 2**128) or None, got {seed!r}")
    return int(seed)


class RandomResizedCropDecoder:
    """Image bytes to a training sample, drawn per sample from ``(seed, epoch, key)``.

    ``decode(raw, key, out)`` gives ``[3, size, size]`` ``uint8`` (written into
    ``out`` when given: a NumPy array of that shape, e.g. a batch row) through
    :func:`decode_random_resized_crop`.  ``set_epoch`` selects the epoch; the
    decoder holds no other state and is thread-safe.
    """

    def __init__(self, size: int, crop: RandomResizedCrop | None = None, *,
                 interpolation: Interpolation = "area", max_pixels: MaxPixels = "pillow",
                 seed: int | None = None) -> None:
        from .image import check_interpolation, check_size
        check_size(size, allow_none=False)
        check_interpolation(interpolation)
        pixel_limit(max_pixels)
        self.size = int(size)
        self.crop = crop if crop is not None else RandomResizedCrop()
        self.interpolation: Interpolation = interpolation
        self.max_pixels: MaxPixels = max_pixels
        self.seed = resolve_seed(seed)
        self.epoch = 0
        preload_resize()
        jpegregion.available()  # finds and loads the library now, not in a pass
        import numpy.random  # noqa: F401 (numpy loads it on first use: now, not in a pass)

    def set_epoch(self, epoch: int) -> None:
        """Draw the windows of ``epoch`` from now on (a non-negative int)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = int(epoch)

    def window(self, height: int, width: int, key: int) -> Window:
        """The window and flip sample ``key`` gets in this epoch, for an image of
        ``height`` x ``width`` (what :meth:`decode` uses)."""
        return draw_window(height, width, sample_uniforms(self.seed, self.epoch, key),
                           self.crop)

    def decode(self, raw: bytes, key: int, out: np.ndarray | None = None) -> np.ndarray:
        return decode_random_resized_crop(raw, self.size,
                                          sample_uniforms(self.seed, self.epoch, key),
                                          self.crop, out, self.interpolation, self.max_pixels)

    def __repr__(self) -> str:
        c = self.crop
        return (f"RandomResizedCropDecoder(size={self.size}, scale={c.scale}, ratio={c.ratio}, "
                f"hflip={c.hflip}, interpolation={self.interpolation!r}, seed={self.seed}, "
                f"epoch={self.epoch})")


def training_decoder(train: bool, size: int | None, *, scale: tuple[float, float] | None,
                     ratio: tuple[float, float] | None, hflip: float | None,
                     seed: int | None, interpolation: Interpolation,
                     max_pixels: MaxPixels) -> RandomResizedCropDecoder | None:
    """The decoder ``train=True`` asks for (None without it), from the keywords a
    dataset takes.  TypeError for augmentation keywords without ``train``;
    ValueError for ``train`` without a ``size`` (the crops are resized to it)."""
    if not train:
        if (scale, ratio, hflip, seed) != (None, None, None, None):
            raise TypeError("scale, ratio, hflip and seed configure the training "
                            "augmentation: pass them with train=True")
        return None
    if size is None:
        raise ValueError("train=True needs a size (the crops are resized to it)")
    given = {k: v for k, v in (("scale", scale), ("ratio", ratio), ("hflip", hflip))
             if v is not None}
    return RandomResizedCropDecoder(size, RandomResizedCrop(**given),  # type: ignore[arg-type]
                                    interpolation=interpolation, max_pixels=max_pixels,
                                    seed=seed)
