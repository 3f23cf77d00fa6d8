"""Region decoding (``_data/jpegregion.py``): the same pixels as a whole decode, cut.

The oracle is simplejpeg's whole-image decode at the same DCT scale (both are
libjpeg-turbo with its default, accurate IDCT and fancy upsampling), cut to the
region.  The ``turbojpeg`` wheel that carries the library is in the test
environment wherever it has a build (``asyncfeed[turbo]``); elsewhere the region
tests skip with that reason and the whole-image path is what runs.
"""

from __future__ import annotations

import ctypes.util
import io
import platform
import sys
import threading

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from asyncfeed import AsyncLoader, ImageFolder, SampleError
from asyncfeed._data import augment, jpegregion
from asyncfeed._data.augment import RandomResizedCrop, Window, sample_uniforms
from support.imagegen import encode, photo, write

pytestmark = pytest.mark.timeout(120)

#: where the turbojpeg wheels exist (the extra's markers in pyproject.toml)
WHEEL_PLATFORM = sys.version_info < (3, 14) and (
    (sys.platform == "linux" and platform.machine() == "x86_64")
    or sys.platform in ("darwin", "win32"))


@pytest.fixture
def region_library():
    if not jpegregion.available():
        if WHEEL_PLATFORM:
            pytest.fail("the turbojpeg wheel (asyncfeed[turbo]) is not installed")
        pytest.skip("no TurboJPEG 3 library on this platform: the whole-image path runs")


def subsampled(h: int, w: int, seed: int, sub: str) -> bytes:
    return simplejpeg.encode_jpeg(photo(h, w, seed), quality=90, colorspace="RGB",
                                  colorsubsampling=sub)


#: (name, bytes): every chroma layout simplejpeg writes, Pillow's 4:2:0, gray, progressive;
#: odd sizes, so the last iMCU column and row are partial
FILES = [(f"sub{sub}", subsampled(203, 317, 1, sub)) for sub in ("444", "422", "420", "440", "411")]
FILES += [(kind, encode(kind, 197, 263, seed=2)) for kind in ("baseline", "grayscale",
                                                             "progressive")]


def whole(raw: bytes, k: int) -> np.ndarray:
    h, w = simplejpeg.decode_jpeg_header(raw)[:2]
    kw = {} if k == 1 else {"min_height": -(-h // k), "min_width": -(-w // k)}
    return simplejpeg.decode_jpeg(raw, colorspace="RGB", **kw)


def regions(oh: int, ow: int) -> list[tuple[int, int, int, int]]:
    """Regions touching each edge, starting on and just off iMCU boundaries, tiny and whole."""
    out = [(0, oh, 0, ow), (0, 1, 0, 1), (oh - 1, oh, ow - 1, ow)]
    for x0 in (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33):
        for y0 in (0, 5, 16):
            if x0 < ow - 1 and y0 < oh - 1:
                out.append((y0, min(oh, y0 + 1 + (oh - y0) // 2), x0, ow if x0 % 2 else
                            min(ow, x0 + 1 + (ow - x0) // 3)))
    return out


@pytest.mark.parametrize("name,raw", FILES, ids=[n for n, _ in FILES])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_region_is_the_whole_decode_cut(region_library, name, raw, k):
    header = jpegregion.read_header(raw)
    assert header is not None and (header.height, header.width) == \
        simplejpeg.decode_jpeg_header(raw)[:2]
    full = whole(raw, k)
    oh, ow = full.shape[:2]
    for y0, y1, x0, x1 in regions(oh, ow):
        got = jpegregion.decode_region(raw, header, k, (y0, y1), (x0, x1))
        assert got is not None, (y0, y1, x0, x1)
        assert np.array_equal(got, full[y0:y1, x0:x1]), (name, k, y0, y1, x0, x1)


def test_only_the_decode_lets_go_of_the_gil(region_library):
    """The decode call releases the GIL, so decode threads run side by side; the calls
    that take a microsecond keep it (each release would let a thread running Python
    take the GIL, and taking it back waits for that thread): ``ctypes.PyDLL``'s
    functions carry the Python-API flag, ``ctypes.CDLL``'s do not."""
    lib = jpegregion._library()
    keep = {name for name in jpegregion._SIGNATURES
            if getattr(lib, name)._flags_ & ctypes._FUNCFLAG_PYTHONAPI}
    assert keep == set(jpegregion._SIGNATURES) - {"tj3Decompress8"}
    assert jpegregion.RELEASING == {"tj3Decompress8"}


def test_the_margin_is_what_makes_the_edges_right(region_library, monkeypatch):
    """Asking the library for the region itself, without the margin, changes the
    outermost columns of a 4:2:0 image (the upsampler replicates the crop's edge):
    the test above can tell the difference."""
    raw = FILES[2][1]
    header = jpegregion.read_header(raw)
    assert header is not None and header.subsampling == 2
    full = whole(raw, 1)
    lib = jpegregion._library()
    h = jpegregion._handle(lib)
    assert lib.tj3DecompressHeader(h.ptr, raw, len(raw)) == 0
    assert lib.tj3SetScalingFactor(h.ptr, jpegregion._ScalingFactor(1, 1)) == 0
    assert lib.tj3SetCroppingRegion(h.ptr, jpegregion._Region(32, 20, 100, 100)) == 0
    tight = np.empty((100, 100, 3), np.uint8)
    assert lib.tj3Decompress8(h.ptr, raw, len(raw), tight.ctypes.data, 0, 0) == 0
    lib.tj3SetCroppingRegion(h.ptr, jpegregion._UNCROPPED)
    assert not np.array_equal(tight, full[20:120, 32:132])
    got = jpegregion.decode_region(raw, header, 1, (20, 120), (32, 132))
    assert np.array_equal(got, full[20:120, 32:132])


@pytest.mark.parametrize("kind", ["cmyk", "cmyk_noadobe", "png_as_jpg", "truncated",
                                  "truncated_progressive", "truncated_header", "empty",
                                  "random_jpeg_magic"])
def test_files_it_does_not_take_are_left_to_the_whole_image_path(region_library, kind):
    assert jpegregion.read_header(encode(kind, 60, 80, seed=3)) is None


def test_corrupt_data_inside_the_region_is_refused(region_library):
    """A warning is an error here (as simplejpeg's ``strict``): a stray marker in the
    scan makes a region that covers it None, not pixels.  Rows above the damage
    decode (as Pillow, the whole-image path's last resort, decodes such a file)."""
    raw = encode("baseline", 120, 160, seed=4)
    mid = (raw.find(b"\xff\xda") + len(raw)) // 2
    bad = raw[:mid] + b"\xff\xd3" + raw[mid + 2:]
    with pytest.raises(ValueError, match="Corrupt JPEG"):
        simplejpeg.decode_jpeg(bad, strict=True)
    header = jpegregion.read_header(bad)
    assert header is not None
    assert jpegregion.decode_region(bad, header, 1, (0, 120), (0, 160)) is None
    top = jpegregion.decode_region(bad, header, 1, (0, 8), (0, 160))
    assert top is not None and np.array_equal(top, whole(raw, 1)[:8])


def test_a_truncated_file_fails_even_when_its_window_lies_above_the_cut(region_library):
    """Region decoding would never read the missing tail; the file is refused and the
    whole-image path reports it."""
    raw = encode("baseline", 400, 300, seed=5)
    cut = raw[:int(len(raw) * 0.7)]
    assert jpegregion.read_header(cut) is None
    top = Window(0, 0, 64, 64, False)  # decoded at 1/2: 32 x 32
    assert augment._decode_window(raw, lambda h, w: top, 32, None)[0].shape == (32, 32, 3)
    with pytest.raises(Exception):
        augment._decode_window(cut, lambda h, w: top, 32, None)


def test_threads_decode_side_by_side_with_a_handle_each(region_library):
    raw = FILES[2][1]
    header = jpegregion.read_header(raw)
    want = whole(raw, 2)[10:90, 20:140]
    got: list[bool] = []

    def work() -> None:
        for _ in range(20):
            r = jpegregion.decode_region(raw, header, 2, (10, 90), (20, 140))
            got.append(r is not None and np.array_equal(r, want))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [True] * 80


def test_without_a_turbojpeg_3_library_nothing_is_loaded(monkeypatch):
    """No candidate, or only a library without the TurboJPEG 3 functions (libc here):
    unavailable, and the training decode still works (whole images)."""
    libc = ctypes.util.find_library("c")
    for candidates in ([], [libc] if libc else [], ["/nonexistent/libturbojpeg.so.0"]):
        monkeypatch.setattr(jpegregion, "_candidates", lambda c=candidates: c)
        jpegregion._library.cache_clear()
        try:
            assert not jpegregion.available()
            assert jpegregion.read_header(FILES[0][1]) is None
            out = augment.decode_random_resized_crop(FILES[0][1], 32, sample_uniforms(0, 0, 1),
                                                     RandomResizedCrop())
            assert out.shape == (3, 32, 32)
        finally:
            jpegregion._library.cache_clear()


# -- the training decode, region or whole ----------------------------------------------
@pytest.fixture(params=["region", "whole"])
def decode_path(request, monkeypatch):
    """The training decode through region decoding, or with it switched off."""
    if request.param == "region":
        request.getfixturevalue("region_library")
    else:
        monkeypatch.setattr(jpegregion, "read_header", lambda raw: None)
    return request.param


def test_training_samples_are_the_same_by_either_path(region_library, monkeypatch):
    """Every kind of file, many windows at every reduction: identical rows, except
    where the whole-image path hands a file to Pillow that the region path decodes:
    stray bytes before the end marker, which libjpeg reports after the last row (the
    region path stops reading at its window) -- a few levels apart there."""
    same = [raw for _, raw in FILES]
    same += [encode(kind, 150, 210, seed=6) for kind in ("cmyk", "png_as_jpg")]
    same.append(subsampled(600, 800, 7, "420"))
    near = [encode("extraneous", 150, 210, seed=6)]
    spec = RandomResizedCrop()

    def rows(files: list[bytes]) -> list[np.ndarray]:
        return [augment.decode_random_resized_crop(raw, 48, sample_uniforms(9, 0, key), spec)
                for raw in files for key in range(12)]
    region_same, region_near = rows(same), rows(near)
    monkeypatch.setattr(jpegregion, "read_header", lambda raw: None)
    assert all(np.array_equal(a, b) for a, b in zip(region_same, rows(same)))
    diffs = [np.abs(a.astype(int) - b.astype(int)) for a, b in zip(region_near, rows(near))]
    assert max(d.mean() for d in diffs) < 1.0 and max(d.max() for d in diffs) <= 16


def test_the_reduction_is_the_same_by_either_path(decode_path, monkeypatch):
    """An 800x600 window decodes at 1/8 for 64 pixels, a 400x300 one at 1/4, a tiny
    one at full size, whichever path decodes it."""
    seen: list[int] = []
    real_region, real_whole = jpegregion.decode_region, augment.simplejpeg.decode_jpeg

    def spy_region(raw, header, k, rows, cols):
        seen.append(k)
        return real_region(raw, header, k, rows, cols)

    def spy_whole(raw, **kw):
        seen.append(600 // kw["min_height"] if "min_height" in kw else 1)
        return real_whole(raw, **kw)
    monkeypatch.setattr(jpegregion, "decode_region", spy_region)
    monkeypatch.setattr(augment.simplejpeg, "decode_jpeg", spy_whole)
    raw = subsampled(600, 800, 2, "420")
    for scale, k in ((1.0, 8), (0.25, 4), (0.01, 1)):
        spec = RandomResizedCrop(scale=(scale, scale), ratio=(4 / 3, 4 / 3), hflip=0.0)
        augment.decode_random_resized_crop(raw, 64, sample_uniforms(0, 0, 0), spec)
        assert seen[-1] == k


def test_a_broken_file_names_the_sample_by_either_path(decode_path, tmp_path):
    """A truncated file fails naming the sample, whichever path decodes it and
    wherever its window lies."""
    root = tmp_path / "root"
    write("baseline", root / "a" / "good.jpg", 200, 260, seed=1)
    write("truncated", root / "a" / "half.jpg", 200, 260, seed=2)
    ds = ImageFolder(root, 32, train=True, seed=0, scale=(0.01, 0.02))
    for epoch in range(3):  # small windows anywhere: some above the cut
        ds.set_epoch(epoch)
        with pytest.raises(SampleError) as exc:
            ds[1]
        assert exc.value.index == 1 and exc.value.source.endswith("half.jpg")
    with AsyncLoader(ds, batch_size=2) as loader, pytest.raises(SampleError) as exc:
        list(loader)
    assert exc.value.index == 1


def test_pillow_agrees_on_what_a_region_shows(region_library):
    """A last sanity check against another decoder: the region matches Pillow's
    whole decode within JPEG's decoder differences."""
    raw = FILES[2][1]
    header = jpegregion.read_header(raw)
    got = jpegregion.decode_region(raw, header, 1, (30, 130), (40, 200))
    ref = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))[30:130, 40:200]
    assert np.abs(got.astype(int) - ref.astype(int)).mean() < 1.0
