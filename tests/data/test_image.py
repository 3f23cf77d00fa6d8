"""``asyncfeed._data.image``: real files on disk, Pillow as the reference decoder.

Tolerances, measured with simplejpeg 1.9 and Pillow 13 (both bundle libjpeg-turbo
3.x and decode with the accurate integer IDCT and fancy upsampling):

* ``decode_rgb`` is bit-identical to ``Image.open(p).convert("RGB")`` for baseline,
  4:4:4, grayscale, progressive JPEGs and every PNG (max abs diff 0).  CMYK JPEGs
  (simplejpeg converts them itself) differ by exactly 1 on every sample:
  libjpeg-turbo's CMYK->RGB and Pillow's ``cmyk2rgb`` round differently.  We allow
  ``JPEG_TOL = 2`` for JPEGs so that another libjpeg-turbo build (SIMD IDCT or
  colour conversion) does not fail the suite; a wrong colour space, a channel
  swap or a shifted image is off by tens.
* ``decode_image`` is compared with the pipeline torchvision users run: Pillow
  decode, antialiased bilinear resize of the short side, center crop.  We resize
  in the DCT domain first and with OpenCV, so the pixels differ a little: mean abs
  diff measured <= 1.1 for "area" and <= 1.6 for "linear" (worst: a PNG shrunk 7.5x:
  no DCT scaling, and bilinear without antialiasing aliases the noise; at 15x it
  reaches 2.0); bound 3.  DCT-scaled decodes (``min_side``) vs Pillow's full decode
  box-resized to the same shape: <= 0.93.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from asyncfeed import decode_image
from asyncfeed._data.image import decode_rgb, hwc_to_chw, resize_center_crop, resized_shape
from support.imagegen import BAD_KINDS, GOOD_KINDS, photo, write

JPEG_TOL = 2
MEAN_TOL = 3.0
PNG_KINDS = {"png_as_jpg", "rgba_png", "palette_png"}

SHAPES = {
    "regular": (48, 64),
    "odd_small": (13, 7),      # smaller than every target size: upscaled
    "wide": (20, 300),
    "tall": (300, 20),
    "large": (240, 320),       # DCT-domain downscaling kicks in (1/4 for size 32)
}


def pil_rgb(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def pil_reference(path, size: int) -> np.ndarray:
    """torchvision's pipeline: Pillow decode, antialiased bilinear short side -> size,
    center crop, CHW.  Long side rounded like ``resized_shape`` documents."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        if h <= w:
            nh, nw = size, max(size, round(w * size / h))
        else:
            nh, nw = max(size, round(h * size / w)), size
        arr = np.asarray(im.resize((nw, nh), Image.Resampling.BILINEAR))
    top, left = (nh - size) // 2, (nw - size) // 2
    return arr[top:top + size, left:left + size].transpose(2, 0, 1)


def absdiff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- 1. decode_rgb: every kind of file to the right RGB pixels -------------------------

@pytest.mark.parametrize("kind", GOOD_KINDS)
def test_decode_rgb_matches_pillow(tmp_path, kind):
    tol = 0 if kind in PNG_KINDS else JPEG_TOL  # PNGs go through Pillow on both sides
    for name, shape in SHAPES.items():
        path = write(kind, tmp_path / f"{name}.jpg", *shape, seed=1)
        got = decode_rgb(read(path))
        ref = pil_rgb(path)
        assert got.dtype == np.uint8 and got.shape == (*shape, 3) == ref.shape, name
        assert absdiff(got, ref).max() <= tol, name


@pytest.mark.parametrize("kind", ["baseline", "grayscale", "cmyk", "progressive", "extraneous"])
def test_decode_rgb_dct_scaling(tmp_path, kind):
    """With ``min_side`` a big JPEG comes out smaller but never below ``min_side``, and
    still shows the same picture (compared with Pillow's full decode, box-resized).
    ``extraneous`` is refused by simplejpeg's strict mode: it covers the Pillow
    fallback and its ``draft()`` scaling."""
    path = write(kind, tmp_path / "img.jpg", 480, 640, seed=2)
    got = decode_rgb(read(path), min_side=40)
    h, w = got.shape[:2]
    assert got.dtype == np.uint8 and got.shape[2] == 3
    assert 40 <= h < 480 and 40 <= w < 640   # 480/8 = 60 >= 40: it must have scaled
    assert abs(h / w - 480 / 640) < 0.05
    with Image.open(path) as im:
        ref = np.asarray(im.convert("RGB").resize((w, h), Image.Resampling.BOX))
    assert absdiff(got, ref).mean() < MEAN_TOL


@pytest.mark.parametrize("kind", ["baseline", "png_as_jpg"])
def test_decode_rgb_min_side_never_below(tmp_path, kind):
    # 97 x 131 has no power-of-two reduction >= 50 on the short side
    path = write(kind, tmp_path / "img.jpg", 97, 131)
    got = decode_rgb(read(path), min_side=50)
    assert min(got.shape[:2]) >= 50
    got = decode_rgb(read(path), min_side=200)   # larger than the image: full size
    assert got.shape == (97, 131, 3)


# -- 2. decode_image against the Pillow pipeline ---------------------------------------

@pytest.mark.parametrize("kind", ["baseline", "grayscale", "cmyk", "progressive",
                                  "png_as_jpg", "extraneous"])
def test_decode_image_matches_pillow_pipeline(tmp_path, kind):
    for name, shape in SHAPES.items():
        path = write(kind, tmp_path / f"{name}.jpg", *shape, seed=3)
        for interpolation in ("area", "linear"):
            for size in (32, 56):
                case = (name, interpolation, size)
                got = decode_image(read(path), size, interpolation=interpolation)
                assert got.dtype == np.uint8 and got.shape == (3, size, size), case
                assert got.flags.c_contiguous and got.flags.writeable, case  # from_numpy-ready
                assert absdiff(got, pil_reference(path, size)).mean() < MEAN_TOL, case


def test_decode_image_full_size(tmp_path):
    path = write("baseline", tmp_path / "img.jpg", 30, 50)
    got = decode_image(read(path), None)
    assert got.shape == (3, 30, 50) and got.flags.c_contiguous
    assert np.array_equal(got, pil_rgb(path).transpose(2, 0, 1))


def test_decode_image_solid_colour_exact(tmp_path):
    """A flat colour survives decode, resize and crop (catches channel order, offsets)."""
    path = tmp_path / "flat.png"
    Image.new("RGB", (90, 40), (200, 30, 120)).save(path, "PNG")
    for interpolation in ("area", "linear"):
        for size in (16, 64):  # down and up
            got = decode_image(read(path), size, interpolation=interpolation)
            assert np.array_equal(got, np.broadcast_to(
                np.array([200, 30, 120], np.uint8)[:, None, None], (3, size, size)))


@pytest.mark.parametrize("kind", ["baseline", "cmyk", "png_as_jpg"])
def test_decode_image_into_row_of_batch(tmp_path, kind):
    raw = read(write(kind, tmp_path / "img.jpg", 120, 90, seed=4))
    for interpolation in ("area", "linear"):
        slot = torch.full((4, 3, 32, 32), 7, dtype=torch.uint8)
        row = slot.numpy()[2]                      # a contiguous view into the slot
        res = decode_image(raw, 32, out=row, interpolation=interpolation)
        assert res is row
        assert np.array_equal(slot[2].numpy(),
                              decode_image(raw, 32, interpolation=interpolation))
        assert bool((slot[[0, 1, 3]] == 7).all()), "wrote outside its row"


def test_decode_image_into_full_size(tmp_path):
    path = write("progressive", tmp_path / "img.jpg", 30, 50)
    out = np.zeros((3, 30, 50), np.uint8)
    assert decode_image(read(path), None, out=out) is out
    assert np.array_equal(out, pil_rgb(path).transpose(2, 0, 1))


def test_decode_image_into_wrong_shape_raises(tmp_path):
    raw = read(write("baseline", tmp_path / "img.jpg"))
    with pytest.raises(ValueError):
        decode_image(raw, 32, out=np.zeros((3, 16, 16), np.uint8))


@pytest.mark.parametrize("out_kind", ["new", "row", "strided", "readonly_src", "four_channels"])
def test_hwc_to_chw_is_a_transpose_copy(out_kind):
    """OpenCV's split where it can write, NumPy elsewhere: the same pixels either way."""
    rng = np.random.default_rng(3)
    c = 4 if out_kind == "four_channels" else 3
    src = rng.integers(0, 256, (40, 50, c), dtype=np.uint8)[3:35, 5:45]  # an ROI, as a crop is
    want = src.transpose(2, 0, 1)
    if out_kind == "readonly_src":
        src = src.copy()
        src.setflags(write=False)
    if out_kind == "new":
        got = hwc_to_chw(src)
    elif out_kind == "strided":
        base = np.zeros((c, 32, 80), np.uint8)
        out = base[:, :, ::2]                      # planes OpenCV cannot write into
        got = hwc_to_chw(src, out)
        assert got is out and not base[:, :, 1::2].any()
    else:
        slot = np.full((3, c, 32, 40), 9, np.uint8)
        out = slot[1]
        got = hwc_to_chw(src, out)
        assert got is out and (slot[[0, 2]] == 9).all()
    assert got.shape == want.shape and np.array_equal(got, want)
    with pytest.raises(ValueError):
        hwc_to_chw(src, np.zeros((c, 16, 16), np.uint8))


# -- 3. bad files raise, and never leave partial pixels behind -------------------------

@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_files_raise(tmp_path, kind):
    raw = read(write(kind, tmp_path / "bad.jpg"))
    with pytest.raises((ValueError, OSError)):
        decode_rgb(raw)
    with pytest.raises((ValueError, OSError)):
        decode_rgb(raw, min_side=16)
    with pytest.raises((ValueError, OSError)):
        decode_image(raw, None)
    out = np.full((3, 32, 32), 7, np.uint8)
    with pytest.raises((ValueError, OSError)):
        decode_image(raw, 32, out=out)
    assert (out == 7).all(), "a failed decode wrote into out"


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_truncated_anywhere_raises(tmp_path, progressive):
    full = tmp_path / "full.jpg"
    Image.fromarray(photo(64, 80, seed=5)).save(full, "JPEG", quality=90,
                                                progressive=progressive)
    data = read(full)
    for frac in (0.01, 0.05, 0.3, 0.6, 0.9, 0.99):
        cut = data[:max(3, int(len(data) * frac))]
        with pytest.raises((ValueError, OSError)):
            decode_image(cut, 32)
    with pytest.raises((ValueError, OSError)):  # only the EOI marker missing
        decode_image(data[:-2], 32)


# -- 5. parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, -3, 2.5, "32", True], ids=repr)
def test_decode_image_rejects_bad_size(tmp_path, size):
    raw = read(write("baseline", tmp_path / "img.jpg"))
    with pytest.raises(ValueError, match="size"):
        decode_image(raw, size)


@pytest.mark.parametrize("interpolation", ["cubic", "AREA", None], ids=repr)
def test_decode_image_rejects_bad_interpolation(tmp_path, interpolation):
    raw = read(write("baseline", tmp_path / "img.jpg"))
    with pytest.raises(ValueError, match="interpolation"):
        decode_image(raw, 32, interpolation=interpolation)


# -- resize_center_crop / resized_shape properties (no files needed) --------------------

@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 300), w=st.integers(1, 300), size=st.integers(1, 64),
       interpolation=st.sampled_from(["area", "linear"]),
       colour=st.tuples(*[st.integers(0, 255)] * 3))
def test_resize_center_crop_shape_and_flat_colour(h, w, size, interpolation, colour):
    rgb = np.empty((h, w, 3), np.uint8)
    rgb[:] = colour
    out = resize_center_crop(rgb, size, interpolation=interpolation)
    assert out.shape == (3, size, size) and out.dtype == np.uint8
    assert np.array_equal(out, np.broadcast_to(np.array(colour, np.uint8)[:, None, None],
                                               out.shape))


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 400), w=st.integers(1, 400), size=st.integers(1, 300))
def test_resized_shape(h, w, size):
    nh, nw = resized_shape(h, w, size)
    assert min(nh, nw) == size
    if h <= w:
        assert nh == size and abs(nw - w * size / h) <= 0.5 + 1e-9
    else:
        assert nw == size and abs(nh - h * size / w) <= 0.5 + 1e-9


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 40), extra=st.integers(0, 60), seed=st.integers(0, 3),
       transpose=st.booleans())
def test_crop_is_centred_when_no_resize(size, extra, seed, transpose):
    """Short side already ``size``: no resampling, the crop is the exact middle."""
    rgb = np.random.default_rng(seed).integers(0, 256, (size, size + extra, 3), np.uint8)
    if transpose:
        rgb = np.ascontiguousarray(rgb.transpose(1, 0, 2))
    out = resize_center_crop(rgb, size)
    h, w = rgb.shape[:2]
    top, left = (h - size) // 2, (w - size) // 2
    assert np.array_equal(out, rgb[top:top + size, left:left + size].transpose(2, 0, 1))
