"""Training augmentation fused into decoding: ``ImageFolder(train=True)`` and
``ImageLabelDecoder(train=True)``.

The oracle for the crop windows is torchvision's ``RandomResizedCrop.get_params``,
restated below from its published definition (torchvision is not a dependency)
and drawn with torch's generator as torchvision draws it; the oracle for the
pixels is a plain full-size decode, crop, resize and flip.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import os
import tarfile

import numpy as np
import pytest
import simplejpeg
import torch
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader, ImageFolder, ImageLabelDecoder, \
    WebDatasetShards
from asyncfeed._data import augment
from asyncfeed._data.augment import (RandomResizedCrop, RandomResizedCropDecoder,
                                     decode_random_resized_crop, draw_window, sample_uniforms)
from support.imagegen import encode, write

pytestmark = pytest.mark.timeout(120)

SIZE = 32
# (height, width) of the tree's images: landscape, portrait, square, very wide
SHAPES = [(48, 64), (64, 48), (56, 56), (40, 120), (90, 60), (72, 96)]


# -- torchvision's RandomResizedCrop.get_params, from its definition -----------------------
def tv_get_params(height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def ks_statistic(a, b) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the ECDFs."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


N_DRAWS = 4000
# the KS critical value at alpha = 0.001 for two samples of N_DRAWS
KS_CRITICAL = 1.95 * math.sqrt(2 / N_DRAWS)


def _features(windows, height, width):
    """Per window: its area share, log aspect ratio, and its centre, as shares of the image."""
    w = np.array(windows, float)  # rows: top, left, h, w
    return {"scale": w[:, 2] * w[:, 3] / (height * width),
            "log_ratio": np.log(w[:, 3] / w[:, 2]),
            "cy": (w[:, 0] + w[:, 2] / 2) / height,
            "cx": (w[:, 1] + w[:, 3] / 2) / width}


def ours(height, width, spec, seed=0, epoch=0):
    out = []
    for k in range(N_DRAWS):
        win = draw_window(height, width, sample_uniforms(seed, epoch, k), spec)
        out.append((win.top, win.left, win.height, win.width))
    return out


def reference(height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), seed=0):
    torch.manual_seed(seed)
    return [tv_get_params(height, width, scale, ratio) for _ in range(N_DRAWS)]


@pytest.mark.parametrize("height,width,scale,ratio", [
    (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
    (500, 333, (0.08, 1.0), (3 / 4, 4 / 3)),
    (120, 600, (0.08, 1.0), (3 / 4, 4 / 3)),     # very wide: many tries miss
    (300, 300, (0.25, 0.5), (1 / 2, 2.0)),
])
def test_scales_ratios_and_positions_follow_torchvision(height, width, scale, ratio):
    spec = RandomResizedCrop(scale=scale, ratio=ratio)
    got = _features(ours(height, width, spec), height, width)
    want = _features(reference(height, width, scale, ratio), height, width)
    for name in got:
        d = ks_statistic(got[name], want[name])
        assert d < KS_CRITICAL, f"{name}: KS {d:.4f} >= {KS_CRITICAL:.4f}"


def test_the_distribution_test_tells_a_wrong_algorithm_apart():
    """A ratio drawn uniformly instead of log-uniformly fails the same check."""
    height, width, ratio = 375, 500, (1 / 3, 3.0)
    spec = RandomResizedCrop(ratio=ratio)
    want = _features(reference(height, width, ratio=ratio), height, width)
    wrong = []
    for k in range(N_DRAWS):
        u = sample_uniforms(0, 0, k)
        # the same algorithm but with the aspect ratio uniform in ratio
        u2 = list(u)
        for t in range(10):
            r = ratio[0] + (ratio[1] - ratio[0]) * u[2 * t + 1]
            u2[2 * t + 1] = (math.log(r) - math.log(ratio[0])) / (math.log(ratio[1])
                                                                 - math.log(ratio[0]))
        win = draw_window(height, width, u2, spec)
        wrong.append((win.top, win.left, win.height, win.width))
    d = ks_statistic(_features(wrong, height, width)["log_ratio"], want["log_ratio"])
    assert d > 3 * KS_CRITICAL


def test_windows_always_fit_and_the_fallback_rate_matches():
    height, width = 120, 600
    spec = RandomResizedCrop()
    got = ours(height, width, spec)
    for top, left, h, w in got:
        assert 0 <= top and 0 <= left and 0 < h and 0 < w
        assert top + h <= height and left + w <= width
    fallback = (0, (width - 160) // 2, 120, 160)  # the centre crop clamped to ratio 4/3
    rate = sum(w == fallback for w in got) / N_DRAWS
    ref = sum(w == fallback for w in reference(height, width)) / N_DRAWS
    assert rate > 0.01 and abs(rate - ref) < 4 * math.sqrt(2 * ref * (1 - ref) / N_DRAWS)


def test_the_fallback_is_the_centre_crop_at_the_nearest_ratio(tmp_path):
    """An image no try fits (wide, every try near the whole area at ratio 1):
    the centre square, pixel for pixel."""
    spec = RandomResizedCrop(scale=(0.9, 1.0), ratio=(1.0, 1.0), hflip=0.0)
    raw = encode("baseline", 48, 400, seed=3)
    for key in range(20):
        win = draw_window(48, 400, sample_uniforms(7, 0, key), spec)
        assert (win.top, win.left, win.height, win.width, win.flip) == (0, 176, 48, 48, False)
    full = simplejpeg.decode_jpeg(raw, colorspace="RGB")
    got = decode_random_resized_crop(raw, 48, sample_uniforms(7, 0, 0), spec)
    assert np.array_equal(got, full[:, 176:224].transpose(2, 0, 1))


def test_flip_rate_and_its_probability():
    for p in (0.0, 0.5, 0.25, 1.0):
        spec = RandomResizedCrop(hflip=p)
        flips = sum(draw_window(100, 100, sample_uniforms(1, 0, k), spec).flip
                    for k in range(N_DRAWS))
        sigma = math.sqrt(p * (1 - p) / N_DRAWS)
        assert abs(flips / N_DRAWS - p) <= 4 * sigma, (p, flips)


def tv_resize(hwc, size):
    """torchvision's ``Resize(antialias=True)`` of a ``uint8`` image tensor, which is
    torch's antialiased bilinear interpolation: the oracle for ``"area"``."""
    t = torch.from_numpy(np.ascontiguousarray(hwc)).permute(2, 0, 1).unsqueeze(0)
    out = torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear",
                                          antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


def mean_abs(a, b) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


def test_pixels_are_the_window_resized_and_flipped():
    """No DCT reduction (no window of 90 x 120 is twice 48): a full decode, the
    window, the resize, the flip.  ``"linear"`` is cv2's bilinear resize exactly;
    ``"area"`` is torchvision's antialiased resize within a grey level on average."""
    import cv2
    size = 48
    raw = encode("baseline444", 90, 120, seed=1)
    full = simplejpeg.decode_jpeg(raw, colorspace="RGB")
    seen_flip = set()
    for key in range(12):
        for interp in ("area", "linear"):
            spec = RandomResizedCrop()
            u = sample_uniforms(2, 0, key)
            win = draw_window(90, 120, u, spec)
            crop = full[win.top:win.top + win.height, win.left:win.left + win.width]
            if interp == "linear":
                want = cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
            else:
                want = tv_resize(crop, size)
            if win.flip:
                want = want[:, ::-1]
            seen_flip.add(win.flip)
            out = np.zeros((3, size, size), np.uint8)
            got = decode_random_resized_crop(raw, size, u, spec, out, interp)
            assert got is out
            if interp == "linear":
                assert np.array_equal(out, want.transpose(2, 0, 1)), (key, win)
            else:
                assert mean_abs(out, want.transpose(2, 0, 1)) < 1.0, (key, win)
    assert seen_flip == {True, False}


@pytest.mark.parametrize("side", [72, 96, 120, 160])
def test_area_antialiases_like_torchvision_and_linear_does_not(side):
    """White noise (every frequency) shrunk to 48 by 1.5-3.3x: torchvision's
    antialiased resize averages most of it away; ``"area"`` keeps as little of it
    (its spread within a quarter of torchvision's) and lands near its pixels;
    bilinear sampling alone keeps the noise."""
    noise = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    tv = tv_resize(noise, 48)
    cv2 = augment._opencv()
    area = augment._resize(noise, 48, "area", cv2)
    linear = augment._resize(noise, 48, "linear", cv2)
    assert linear.std() > 1.4 * tv.std()
    assert abs(area.std() - tv.std()) < 0.25 * tv.std()
    assert mean_abs(area, tv) < 0.5 * mean_abs(linear, tv)


@pytest.mark.parametrize("side", [230, 260, 300, 360, 448, 700, 896])
def test_the_prefilter_adds_the_variance_torchvision_has_over_bilinear(side):
    """torchvision's filter at a shrink f is a triangle of half-width f (variance
    f**2 / 6), bilinear's one of half-width 1 (1 / 6): the kernel has the rest."""
    k = augment._prefilter(side, 224).astype(np.float64)
    x = np.arange(len(k)) - len(k) // 2
    f = side / 224
    assert k.sum() == pytest.approx(1.0, abs=1e-6) and np.all(k >= 0)
    assert np.allclose(k, k[::-1])
    assert (k * x * x).sum() == pytest.approx((f * f - 1) / 6, rel=0.02)
    assert augment._prefilter(224, 224) is None and augment._prefilter(100, 224) is None


def test_a_large_window_is_decoded_at_a_reduced_scale(monkeypatch):
    """The whole-image path (test_jpegregion.py checks the region path's reductions)."""
    monkeypatch.setattr(augment.jpegregion, "read_header", lambda raw: None)
    calls = []
    real = simplejpeg.decode_jpeg

    def spy(raw, **kw):
        calls.append(kw)
        return real(raw, **kw)
    monkeypatch.setattr(augment.simplejpeg, "decode_jpeg", spy)
    raw = encode("baseline", 600, 800, seed=2)
    whole = RandomResizedCrop(scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), hflip=0.0)
    got = decode_random_resized_crop(raw, 64, sample_uniforms(0, 0, 0), whole)
    assert calls[-1].get("min_height") == 75 and calls[-1].get("min_width") == 100  # 1/8
    # against a full-size decode of the same window: the same picture
    want = tv_resize(real(raw, colorspace="RGB"), 64)
    assert mean_abs(got, want.transpose(2, 0, 1)) < 2.0
    # a small window keeps the full size; a mid-sized one 1/2
    tiny = RandomResizedCrop(scale=(0.01, 0.01), ratio=(1.0, 1.0))
    decode_random_resized_crop(raw, 64, sample_uniforms(0, 0, 0), tiny)
    assert "min_height" not in calls[-1]
    half = RandomResizedCrop(scale=(0.25, 0.25), ratio=(4 / 3, 4 / 3))
    got = decode_random_resized_crop(raw, 64, sample_uniforms(0, 0, 1), half)
    assert calls[-1].get("min_height") == 150  # 300x400 window: 1/4 keeps it >= 64


def test_a_reduced_decode_cuts_the_same_window_as_a_full_one():
    """Windows anywhere in the image, decoded at 1/2-1/8: the same picture as a full
    decode of the window (bounds within a reduced pixel)."""
    raw = encode("baseline444", 640, 800, seed=4)
    full = simplejpeg.decode_jpeg(raw, colorspace="RGB")
    spec = RandomResizedCrop(scale=(0.3, 0.6), hflip=0.0)
    for key in range(10):
        u = sample_uniforms(3, 0, key)
        win = draw_window(640, 800, u, spec)
        assert augment._reduction(win, 48) > 1
        crop = full[win.top:win.top + win.height, win.left:win.left + win.width]
        want = tv_resize(crop, 48).transpose(2, 0, 1)
        got = decode_random_resized_crop(raw, 48, u, spec)
        assert mean_abs(got, want) < 3.0, (key, win)


# -- ImageFolder(train=True) in loaders ---------------------------------------------------
@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("train") / "root"
    for i in range(36):
        h, w = SHAPES[i % len(SHAPES)]
        kind = "progressive" if i % 9 == 4 else ("grayscale" if i % 11 == 5 else "baseline")
        write(kind, root / f"c{i % 3}" / f"{i:03d}.jpg", h, w, seed=i)
    write("png_as_jpg", root / "c0" / "png.jpg", 50, 70, seed=99)
    write("cmyk", root / "c1" / "cmyk.jpg", 52, 66, seed=98)
    return root


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2)
                                    for (x1, y1), (x2, y2) in zip(a, b))


def test_train_samples_are_crops_of_the_image(tree):
    ds = ImageFolder(tree, SIZE, train=True, seed=3)
    ev = ImageFolder(tree, SIZE)
    assert ds.samples == ev.samples and ds.seed == 3 and ds.epoch == 0
    x, y = ds[0]
    assert x.shape == (3, SIZE, SIZE) and x.dtype == torch.uint8 and y == ev[0][1]
    assert not torch.equal(x, ev[0][0])
    assert torch.equal(ds[0][0], x)  # the same sample, the same crop
    for i in range(len(ds)):  # every kind decodes (PNG and CMYK through Pillow)
        assert ds[i][0].shape == (3, SIZE, SIZE)


def test_batches_are_the_same_for_any_thread_count_execution_and_dataloader(tree):
    order = list(np.random.default_rng(0).permutation(37))

    def run(**kw):
        ds = ImageFolder(tree, SIZE, train=True, seed=11)
        with AsyncLoader(ds, batch_size=8, sampler=order, **kw) as loader:
            out = [batches(loader)]
            loader.set_epoch(1)  # the process stage (if any) keeps running: the epoch
            out.append(batches(loader))  # reaches its workers with their tasks
            loader.set_epoch(0)
            out.append(batches(loader))
        return out

    want = run(num_threads=1, execution="threads")
    assert not same(want[0], want[1]) and same(want[0], want[2])
    for kw in ({"num_threads": 3, "execution": "threads"}, {"execution": "inline"},
               {"execution": "auto"},
               {"num_threads": 2, "execution": "processes", "num_workers": 2}):
        got = run(**kw)
        for e in range(3):
            assert same(got[e], want[e]), (kw, e)
    ds = ImageFolder(tree, SIZE, train=True, seed=11)
    assert same(batches(DataLoader(ds, batch_size=8, sampler=order)), want[0])
    ds.set_epoch(1)
    assert same(batches(DataLoader(ds, batch_size=8, sampler=order, num_workers=2)), want[1])


def test_set_epoch_changes_the_windows_and_the_seed_fixes_them(tree):
    a = ImageFolder(tree, SIZE, train=True, seed=5)
    b = ImageFolder(tree, SIZE, train=True, seed=5)
    c = ImageFolder(tree, SIZE, train=True, seed=6)
    n = len(a)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(n))
    assert sum(torch.equal(a[i][0], c[i][0]) for i in range(n)) <= 2
    e0 = [a[i][0] for i in range(n)]
    a.set_epoch(1)
    assert a.epoch == 1
    assert sum(torch.equal(e0[i], a[i][0]) for i in range(n)) <= 2
    a.set_epoch(0)
    assert all(torch.equal(e0[i], a[i][0]) for i in range(n))
    with pytest.raises(ValueError):
        a.set_epoch(-1)


def test_the_default_seed_follows_torch_manual_seed(tree):
    torch.manual_seed(123)
    a = ImageFolder(tree, SIZE, train=True)
    torch.manual_seed(123)
    b = ImageFolder(tree, SIZE, train=True)
    torch.manual_seed(124)
    c = ImageFolder(tree, SIZE, train=True)
    assert a.seed == b.seed != c.seed


def test_resume_mid_epoch_gives_the_rest_of_the_uninterrupted_run(tree):
    def loader():
        return AsyncLoader(ImageFolder(tree, SIZE, train=True, seed=2), batch_size=5,
                           shuffle=True, seed=9, num_threads=2)
    with loader() as full:
        full.set_epoch(3)
        want = batches(full)
    with loader() as first:
        first.set_epoch(3)
        it = iter(first)
        head = [(x.clone(), y.clone()) for x, y in (next(it) for _ in range(3))]
        state = first.state_dict()
        del it
    assert same(head, want[:3])
    with loader() as resumed:
        resumed.load_state_dict(state)
        assert resumed.dataset.epoch == 3
        assert same(batches(resumed), want[3:])


def test_arguments_are_checked(tree):
    with pytest.raises(TypeError, match="train=True"):
        ImageFolder(tree, SIZE, scale=(0.5, 1.0))
    with pytest.raises(TypeError, match="train=True"):
        ImageFolder(tree, SIZE, seed=1)
    with pytest.raises(TypeError, match="decoder"):
        ImageFolder(tree, train=True, decoder=lambda raw: raw)
    with pytest.raises(ValueError, match="size"):
        ImageFolder(tree, None, train=True)
    for bad in ({"scale": (0.9, 0.1)}, {"ratio": (0.0, 1.0)}, {"ratio": 2.0},
                {"hflip": 1.5}, {"seed": -1}, {"seed": "x"}):
        with pytest.raises(ValueError):
            ImageFolder(tree, SIZE, train=True, **bad)
    ds = ImageFolder(tree, SIZE, train=True, scale=(0.5, 0.6), ratio=(1.0, 2.0), hflip=0.0)
    assert ds.decoder.crop == RandomResizedCrop((0.5, 0.6), (1.0, 2.0), 0.0)


def test_the_eval_path_is_unchanged(tree):
    ds = ImageFolder(tree, SIZE)
    assert ds.train is False and ds.seed is None
    ds.set_epoch(4)
    assert ds.epoch == 4
    from asyncfeed import decode_image
    path, _ = ds.samples[0]
    with open(path, "rb") as f:
        assert np.array_equal(ds[0][0].numpy(), decode_image(f.read(), SIZE))


# -- WebDatasetShards ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("wds_train"))
    for s in range(3):
        with tarfile.open(os.path.join(root, f"t-{s}.tar"), "w") as tf:
            for i in range(8):
                h, w = SHAPES[(s + i) % len(SHAPES)]
                for ext, data in (("jpg", encode("baseline", h, w, seed=10 * s + i)),
                                  ("cls", str(i % 4).encode())):
                    info = tarfile.TarInfo(f"k{s}_{i:02d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return os.path.join(root, "t-{0..2}.tar")


def _by_content(samples) -> list[bytes]:
    return sorted(x.numpy().tobytes() + bytes([y]) for x, y in samples)


def test_webdataset_crops_follow_the_sample_not_the_order(shards):
    def ds(buf, epoch=0):
        d = WebDatasetShards(shards, shuffle_buffer=buf, seed=1, rank=0, world_size=1,
                             decode=ImageLabelDecoder(SIZE, train=True, seed=4))
        d.set_epoch(epoch)
        return d
    plain = list(ds(0))
    assert len(plain) == 24 and plain[0][0].shape == (3, SIZE, SIZE)
    shuffled = list(ds(6))
    assert _by_content(plain) == _by_content(shuffled)  # each sample its own crop
    eval_ = list(WebDatasetShards(shards, shuffle_buffer=0, rank=0, world_size=1,
                                  decode=ImageLabelDecoder(SIZE)))
    assert _by_content(plain) != _by_content(eval_)
    epoch1 = ds(0, epoch=1)
    assert epoch1.decoder.epoch == 1
    assert _by_content(list(epoch1)) != _by_content(plain)
    for threads in (1, 3):
        with AsyncLoader(ds(6), batch_size=5, num_threads=threads) as loader:
            got = [(x, y) for xb, yb in loader for x, y in zip(xb, yb.tolist())]
        assert _by_content(got) == _by_content(plain)
    with AsyncLoader(ds(0), batch_size=5) as loader:
        loader.set_epoch(1)
        got = [(x, y) for xb, yb in loader for x, y in zip(xb, yb.tolist())]
    assert _by_content(got) == _by_content(list(ds(0, epoch=1)))


def test_webdataset_state_restores_the_decoders_epoch(shards):
    d = WebDatasetShards(shards, shuffle_buffer=0, rank=0, world_size=1,
                         decode=ImageLabelDecoder(SIZE, train=True, seed=4))
    d.load_state_dict({"epoch": 2, "position": None})
    assert d.decoder.epoch == 2
    with pytest.raises(TypeError, match="train=True"):
        ImageLabelDecoder(SIZE, hflip=0.5)


# -- the decoder on its own ---------------------------------------------------------------
def test_the_decoder_is_reproducible_and_names_its_window():
    dec = RandomResizedCropDecoder(SIZE, seed=8)
    raw = encode("baseline", 60, 80, seed=5)
    a = dec.decode(raw, 17)
    dec.set_epoch(2)
    b = dec.decode(raw, 17)
    dec.set_epoch(0)
    assert np.array_equal(dec.decode(raw, 17), a) and not np.array_equal(a, b)
    win = dec.window(60, 80, 17)
    assert win == draw_window(60, 80, sample_uniforms(8, 0, 17), dec.crop)
    assert "seed=8" in repr(dec)


def _philox_uniforms(seed, epoch, key):
    """The draw's definition: a Philox generator keyed by the seed, its counter
    (0, key, epoch, 0), the top 53 bits of each 64-bit output scaled to [0, 1)."""
    gen = np.random.Philox(counter=np.array([0, key, epoch, 0], np.uint64),
                           key=np.array([seed % 2**64, seed >> 64], np.uint64))
    return ((gen.random_raw(augment.N_UNIFORMS) >> np.uint64(11)) / 2.0**53).tolist()


def test_each_draw_is_its_samples_own_whatever_the_thread_drew_before():
    cases = [(seed, epoch, key) for seed in (0, 7, 2**64 + 3, 2**127 + 2**63)
             for epoch in (0, 1, 2**40) for key in (0, 1, 99, 2**63 + 5)]
    expected = {c: _philox_uniforms(*c) for c in cases}
    assert len({tuple(v) for v in expected.values()}) == len(cases)

    def draw_all(order):
        return {c: sample_uniforms(*c) for c in order}

    # one thread, in two orders; then four threads at once, each in its own order
    assert draw_all(cases) == expected
    assert draw_all(cases[::-1]) == expected
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        shuffled = [list(np.random.default_rng(k).permutation(len(cases))) for k in range(4)]
        results = pool.map(
            lambda order: [(cases[i], sample_uniforms(*cases[i])) for i in order * 20], shuffled)
        for got in results:
            assert all(draw == expected[case] for case, draw in got)
