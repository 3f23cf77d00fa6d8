"""Decoding only a region of a JPEG, at a DCT-domain scale: libjpeg-turbo's TurboJPEG 3 API.

A random-resized-crop keeps on average about half of an image, often much less.
libjpeg-turbo can decode just a region (``tj3SetCroppingRegion``: rows above it
are entropy-decoded and skipped without the inverse DCT, rows below it are never
read, and columns outside it skip the inverse DCT, upsampling and colour
conversion), combined with its 1/2, 1/4 and 1/8 scaled decoding.  On the
benchmark's ImageNet-like photos at the windows of torchvision's algorithm this
takes about a quarter off the decode (``docs/augmentation.md`` has the figures and
the command).  No maintained Python binding exposes that call (simplejpeg,
PyTurboJPEG, Pillow, OpenCV and torchvision decode whole images), so this module
binds the few TurboJPEG 3 functions it needs with ``ctypes``.  The decode itself
lets go of the GIL (``ctypes.CDLL``): decode threads run side by side as with
simplejpeg.  The calls that take a microsecond (the header, the parameters) keep
it (``ctypes.PyDLL``): each release lets a waiting thread take the GIL, and taking
it back waits until that thread lets go -- behind a thread running Python, a
switch interval (5 ms) -- so nine releases an image for microseconds of work cost
far more than they free (``bench/gil_releases.py`` measures it; the figures are in
``docs/augmentation.md``).

The library is looked for, once, in the ``turbojpeg`` distribution (the
``asyncfeed[turbo]`` extra: its wheels carry libjpeg-turbo 3), then as the
system's ``libturbojpeg``; either must export the TurboJPEG 3 API.  Without one,
:func:`read_header` returns None and callers decode the whole image with
simplejpeg: the same pixels, more work.

Pixels are the same as a whole decode's at the same scale, cut to the region:
the region asked of the library starts at least one iMCU column left of the wanted
one and ends a column right of it (libjpeg-turbo's "fancy" chroma upsampling
replicates the edge pixels of a cropped row, so the outermost columns of a tight
crop differ), and the margin is cut off again.  A file that does not end with the
JPEG end-of-image marker is left to the whole-image path, so a truncated file fails
as it always did instead of passing whenever its window lies above the cut.

Each thread keeps one decompressor handle (thread-local, destroyed when the
thread ends).  Every failure of the library (corrupt data: warnings are errors
here, as simplejpeg's ``strict`` makes them; CMYK; 12-bit; an unknown layout)
makes the call return None, and the caller's whole-image path then decodes the
file or says what is wrong with it.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import types
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Header", "available", "decode_region", "read_header"]

_TJINIT_DECOMPRESS = 1
_TJPARAM_STOPONWARNING = 0
_TJPARAM_SUBSAMP = 4
_TJPARAM_JPEGWIDTH = 5
_TJPARAM_JPEGHEIGHT = 6
_TJPARAM_COLORSPACE = 8
_TJPF_RGB = 0
#: TJCS_CMYK and TJCS_YCCK: four-channel files, left to Pillow
_FOUR_CHANNEL = (3, 4)
#: iMCU width in pixels by TurboJPEG subsampling code (444, 422, 420, GRAY, 440, 411, 441)
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)
_EOI = b"\xff\xd9"
#: bytes after the end-of-image marker tolerated as padding (some writers add a few)
_TAIL = 64
#: the library inside the ``turbojpeg`` wheels: Linux, macOS, Windows (not its Python module)
_LIBRARY_FILE = re.compile(r"(^|/)(libturbojpeg[^/]*\.(so[.\d]*|dylib)|turbojpeg-[0-9a-f]+\.dll)$")


class _ScalingFactor(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int),
                ("h", ctypes.c_int)]


_UNCROPPED = _Region(0, 0, 0, 0)


class Header(NamedTuple):
    """What a JPEG's header says: its full-size dimensions and the TurboJPEG
    subsampling code (-1: a layout TurboJPEG has no name for)."""

    height: int
    width: int
    subsampling: int


def _candidates() -> list[str]:
    """Paths or names to try, in order: the ``turbojpeg`` wheel's own library, then
    the system's."""
    import ctypes.util
    import importlib.metadata
    out: list[str] = []
    try:
        files = importlib.metadata.files("turbojpeg") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if _LIBRARY_FILE.search(str(f).replace("\\", "/")):
            out.append(str(f.locate()))
    system = ctypes.util.find_library("turbojpeg")
    if system:
        out.append(system)
    return out


#: the functions used and their signatures
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "tj3Init": ([ctypes.c_int], ctypes.c_void_p),
    "tj3Destroy": ([ctypes.c_void_p], None),
    "tj3Set": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "tj3Get": ([ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
    "tj3DecompressHeader": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
    "tj3SetScalingFactor": ([ctypes.c_void_p, _ScalingFactor], ctypes.c_int),
    "tj3SetCroppingRegion": ([ctypes.c_void_p, _Region], ctypes.c_int),
    "tj3Decompress8": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                        ctypes.c_int, ctypes.c_int], ctypes.c_int),
}
#: the calls that let go of the GIL: the one that does the work (see the module docstring)
RELEASING = frozenset({"tj3Decompress8"})


def _bind(name: str, releasing: frozenset[str] = RELEASING) -> Any:
    """The library ``name`` with the functions of ``_SIGNATURES`` bound: those in
    ``releasing`` let go of the GIL during the call, the others keep it.  OSError
    when it does not load, AttributeError when it lacks a function (a TurboJPEG 2
    library)."""
    free, held = ctypes.CDLL(name), ctypes.PyDLL(name)
    lib = types.SimpleNamespace(name=name)
    for fname, (args, res) in _SIGNATURES.items():
        fn = getattr(free if fname in releasing else held, fname)
        fn.argtypes, fn.restype = args, res
        setattr(lib, fname, fn)
    return lib


@functools.lru_cache(maxsize=1)
def _library() -> Any | None:
    """The bound TurboJPEG 3 library, or None where there is none (looked for once)."""
    for name in _candidates():
        try:
            return _bind(name)
        except (OSError, AttributeError):
            continue
    return None


def available() -> bool:
    """Whether region decoding is available in this process.  The first call looks
    for the library and loads it (a few milliseconds, holding the GIL): decoders
    call it when they are made, not in a pass's first rows."""
    return _library() is not None


class _Handle:
    """One thread's decompressor; destroyed with the thread's locals."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.ptr = lib.tj3Init(_TJINIT_DECOMPRESS)
        if not self.ptr:
            raise MemoryError("tj3Init failed")
        lib.tj3Set(self.ptr, _TJPARAM_STOPONWARNING, 1)

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            try:
                self.lib.tj3Destroy(ptr)
            except Exception:  # interpreter shutdown: the library may be gone already
                pass


_local = threading.local()


def _handle(lib: Any) -> _Handle:
    h: _Handle | None = getattr(_local, "handle", None)
    if h is None:
        h = _local.handle = _Handle(lib)
    return h


def _complete(raw: bytes) -> bool:
    """Whether ``raw`` ends with the end-of-image marker (allowing a little padding)."""
    return raw.rfind(_EOI, max(0, len(raw) - _TAIL)) >= 0


def read_header(raw: bytes) -> Header | None:
    """``raw``'s header when this module can decode a region of it: a complete
    three-channel or grayscale JPEG, and a library loaded; None otherwise (the
    caller decodes the whole image its own way).  ``raw`` is bytes."""
    lib = _library()
    if lib is None or not _complete(raw):
        return None
    h = _handle(lib)
    if lib.tj3DecompressHeader(h.ptr, raw, len(raw)) != 0:
        return None
    if lib.tj3Get(h.ptr, _TJPARAM_COLORSPACE) in _FOUR_CHANNEL:
        return None
    return Header(lib.tj3Get(h.ptr, _TJPARAM_JPEGHEIGHT), lib.tj3Get(h.ptr, _TJPARAM_JPEGWIDTH),
                  lib.tj3Get(h.ptr, _TJPARAM_SUBSAMP))


def decode_region(raw: bytes, header: Header, reduction: int,
                  rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray | None:
    """Rows ``[y0, y1)`` and columns ``[x0, x1)`` of ``raw`` decoded at ``1/reduction``
    scale (1, 2, 4 or 8; bounds in the scaled image, whose sides are the full ones
    divided by ``reduction``, rounded up) as a ``uint8`` RGB HWC view, pixel for
    pixel what a whole decode at that scale holds there; None when the library
    refuses the file (see the module docstring).  ``header`` is
    :func:`read_header`'s for ``raw``."""
    lib = _library()
    if lib is None:
        return None
    h = _handle(lib)
    (y0, y1), (x0, x1) = rows, cols
    scaled_w = -(-header.width // reduction)
    if 0 <= header.subsampling < len(_MCU_WIDTH):
        step = max(1, _MCU_WIDTH[header.subsampling] // reduction)
        left = (x0 - 1) // step * step if x0 > 0 else 0
        right = min(scaled_w, x1 + 1)
    else:
        left, right = 0, scaled_w
    out = np.empty((y1 - y0, right - left, 3), np.uint8)
    ptr = h.ptr
    try:
        if (lib.tj3DecompressHeader(ptr, raw, len(raw)) != 0
                or lib.tj3SetScalingFactor(ptr, _ScalingFactor(1, reduction)) != 0
                or lib.tj3SetCroppingRegion(ptr, _Region(left, y0, right - left, y1 - y0)) != 0
                or lib.tj3Decompress8(ptr, raw, len(raw), out.ctypes.data, 0, _TJPF_RGB) != 0):
            return None
    finally:
        lib.tj3SetCroppingRegion(ptr, _UNCROPPED)
    return out[:, x0 - left:x1 - left]
