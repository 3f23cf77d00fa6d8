"""What the fused training path spends per image, and what region decoding saves.

    PYTHONPATH=src python bench/augment_decode_costs.py [FOLDER] [--size 224] [--rounds 5]
        [--loader-epochs 3] [--execution auto] [--batch-size 32] [--loader-only]

FOLDER: an ImageFolder tree (default: the bench's synthetic set of 1000 images,
generated if needed).  One thread, CPU time (``time.process_time``), every step
timed over every image, steps interleaved round by round (A B C A B C ...);
medians over the rounds, and the worst round.  Prints:

1. libjpeg-turbo's decode at each M/8 scale simplejpeg offers (why only 1/2, 1/4
   and 1/8 are used);
2. the share of training windows decoded at full size, 1/2, 1/4, 1/8;
3. the fused sample's steps: the sample's random draw (``sample_uniforms``: one
   Philox generator per thread, its state set per sample; and, for comparison, a
   generator built per sample), header + window, decode (at the reduction chosen) of
   the whole image (simplejpeg) and of the window's region only (TurboJPEG 3's
   cropping region, ``_data/jpegregion.py``, where the library is installed),
   crop + resize (``"area"``, OpenCV's ``INTER_AREA`` for comparison, and
   ``"linear"``), flip + CHW write; and the whole sample, by either decode; and
   how far each resize lands from torchvision's antialiased one;
4. the share of each image below the window's last row (what region decoding
   never reads);
5. the loader: the PIL pipeline of workload (h) (``PilAugment[i]``, the CPU
   reference of its targets) and ``ImageFolder(train=True)[i]`` over every image
   (the per-sample functions with their file reads, one thread) against ``AsyncLoader`` (its defaults,
   or ``--execution``) over the same folder for ``--loader-epochs`` epochs on one
   loader (``set_epoch`` between them), CPU per image of each epoch (the process
   and its worker processes) and the execution chosen: the loader's own cost per
   image, in its first epoch (exploring executions) and after;
6. ``asyncfeed.normalize`` of a ``uint8`` batch of ``--batch-size`` rows on the CPU,
   per image, at torch's thread count and at one thread, into a fresh tensor each
   time and into one reused ``out=`` (what a CPU-only consumer pays on top; with a
   GPU it runs there), and the one ``addcmul`` it runs on a GPU, on the CPU into the
   same ``out=`` (why it does not there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import cv2
import numpy as np
import psutil
import simplejpeg

from asyncfeed import ImageFolder
from asyncfeed._bench.workloads import PilAugment
from asyncfeed._data import augment, jpegregion
from asyncfeed._data.augment import RandomResizedCrop, draw_window, sample_uniforms
from asyncfeed._data.image import Interpolation


def _folder(path: str | None) -> str:
    if path:
        return path
    from asyncfeed._bench import synthetic
    return synthetic.ensure_synthetic(1000, 10, seed=0)


def _rounds(steps: dict, rounds: int) -> dict:
    times: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for name, (fn, n) in steps.items():
            t0 = time.process_time()
            fn()
            times[name].append((time.process_time() - t0) / n * 1e3)
    return {k: (statistics.median(v), max(v)) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loader-epochs", type=int, default=3,
                   help="epochs of section 5 (0: skip sections 5 and 6)")
    p.add_argument("--execution", default="auto", help="AsyncLoader's execution (section 5)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--loader-only", action="store_true", help="sections 5 and 6 only")
    args = p.parse_args(argv)
    cv2.setNumThreads(1)
    root = _folder(args.folder)
    if args.loader_only:
        _loader_costs(root, args)
        return 0
    ds = ImageFolder(root, args.size, train=True, seed=0)
    raws = []
    for path, _ in ds.samples:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            simplejpeg.decode_jpeg_header(raw)
        except ValueError:
            continue
        raws.append(raw)
    heads = [simplejpeg.decode_jpeg_header(r)[:2] for r in raws]
    n = len(raws)
    print(f"{n} JPEGs from {root}; size {args.size}; {args.rounds} rounds, one thread, "
          f"CPU ms per image: median (worst round)\n")

    def scaled(m: int):
        def run() -> None:
            for r, (h, w) in zip(raws, heads):
                simplejpeg.decode_jpeg(r, colorspace="RGB", min_height=-(-h * m // 8),
                                       min_width=-(-w * m // 8))
        return run, n
    res = _rounds({f"{m}/8": scaled(m) for m in range(8, 0, -1)}, args.rounds)
    print("1. decode at each scale")
    for k, (med, worst) in res.items():
        print(f"   {k:>4}: {med:.3f} ({worst:.3f})")

    spec = RandomResizedCrop()
    wins = [draw_window(h, w, sample_uniforms(0, 0, i), spec) for i, (h, w) in enumerate(heads)]
    ks = [augment._reduction(win, args.size) for win in wins]
    print("\n2. windows decoded at: " + ", ".join(
        f"{'full size' if k == 1 else f'1/{k}'} {ks.count(k) / n:.1%}" for k in (1, 2, 4, 8)))

    decoded = []
    for r, (h, w), win, k in zip(raws, heads, wins, ks):
        kw = {} if k == 1 else {"min_height": -(-h // k), "min_width": -(-w // k)}
        decoded.append(augment._cut(simplejpeg.decode_jpeg(r, colorspace="RGB", **kw),
                                    win, h, w))
    resized = [cv2.resize(c, (args.size, args.size), interpolation=cv2.INTER_LINEAR)
               for c in decoded]
    out = np.empty((3, args.size, args.size), np.uint8)

    def header() -> None:
        for i, r in enumerate(raws):
            h, w = simplejpeg.decode_jpeg_header(r)[:2]
            draw_window(h, w, sample_uniforms(0, 0, i), spec)

    def draw() -> None:
        for i in range(n):
            sample_uniforms(0, 0, i)

    def draw_fresh() -> None:  # a generator built per sample, for comparison
        for i in range(n):
            counter = np.array([0, i, 0, 0], np.uint64)
            bits = np.random.Philox(counter=counter, key=np.zeros(2, np.uint64)).random_raw(
                augment.N_UNIFORMS)
            ((bits >> np.uint64(11)) * (1.0 / (1 << 53))).tolist()

    def decode() -> None:
        for r, (h, w), k in zip(raws, heads, ks):
            kw = {} if k == 1 else {"min_height": -(-h // k), "min_width": -(-w // k)}
            simplejpeg.decode_jpeg(r, colorspace="RGB", **kw)

    def decode_region() -> None:  # as the loader decodes: the region, or its fallback
        for r, win in zip(raws, wins):
            augment._decode_window(r, lambda h, w, win=win: win, args.size, None)

    def resize(interp: Interpolation):
        def run() -> None:
            for c in decoded:
                augment._resize(c, args.size, interp, cv2)
        return run, n

    def inter_area() -> None:  # OpenCV's box filter, for comparison
        for c in decoded:
            shrink = c.shape[0] >= args.size and c.shape[1] >= args.size
            cv2.resize(c, (args.size, args.size),
                       interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)

    def flip_write() -> None:
        for i, c in enumerate(resized):
            augment.hwc_to_chw(cv2.flip(c, 1) if wins[i].flip else c, out)

    def whole(interp: Interpolation, region: bool = True):
        dec = augment.RandomResizedCropDecoder(args.size, interpolation=interp, seed=0)

        def run() -> None:
            real = jpegregion.read_header
            if not region:
                jpegregion.read_header = lambda raw: None  # type: ignore[assignment]
            try:
                for i, r in enumerate(raws):
                    dec.decode(r, i, out)
            finally:
                jpegregion.read_header = real  # type: ignore[assignment]
        return run, n
    steps = {"draw (a generator per thread)": (draw, n),
             "draw (a generator per sample)": (draw_fresh, n),
             "header + window": (header, n), "decode, whole image": (decode, n)}
    if jpegregion.available():
        steps["decode, region only"] = (decode_region, n)
    steps.update({"resize area": resize("area"), "resize INTER_AREA": (inter_area, n),
                  "resize linear": resize("linear"), "flip + CHW write": (flip_write, n),
                  "whole sample, area": whole("area"),
                  "whole sample, linear": whole("linear")})
    if jpegregion.available():
        steps["whole sample, area, whole-image decode"] = whole("area", region=False)
    else:
        print("(no TurboJPEG 3 library: pip install 'asyncfeed[turbo]' to measure region "
              "decoding)")
    res = _rounds(steps, args.rounds)
    print("\n3. the fused sample's steps")
    for k, (med, worst) in res.items():
        print(f"   {k:<38} {med:.3f} ({worst:.3f})")
    _closeness(decoded, args.size)

    below = [1 - (win.top + win.height) / h for win, (h, _) in zip(wins, heads)]
    full = [b for b, k in zip(below, ks) if k == 1]
    print(f"\n4. rows below the window: {statistics.mean(below):.1%} of the image on average "
          f"({statistics.mean(full):.1%} for windows decoded at full size)")
    if args.loader_epochs > 0:
        _loader_costs(root, args)
    return 0


def _closeness(windows: list[np.ndarray], size: int) -> None:
    """Mean absolute difference (grey levels) of each resize from torchvision's
    antialiased one (torch's ``interpolate(antialias=True)``, what its ``Resize``
    runs on tensors), over the same decoded windows."""
    import torch
    import torch.nn.functional as F

    def tv(c: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(c)).permute(2, 0, 1)[None].float()
        out = F.interpolate(t, size=(size, size), mode="bilinear", antialias=True)
        return out[0].permute(1, 2, 0).numpy()

    def inter_area(c: np.ndarray) -> np.ndarray:
        shrink = c.shape[0] >= size and c.shape[1] >= size
        return cv2.resize(c, (size, size),
                          interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    ways = {"area": lambda c: augment._resize(c, size, "area", cv2),
            "INTER_AREA": inter_area,
            "linear": lambda c: augment._resize(c, size, "linear", cv2)}
    diffs: dict[str, list[float]] = {k: [] for k in ways}
    for c in windows:
        want = tv(c)
        for k, way in ways.items():
            diffs[k].append(float(np.abs(way(c).astype(np.float32) - want).mean()))
    print("   mean absolute difference from torchvision's antialiased resize, grey levels "
          "(95th percentile): " + ", ".join(
              f"{k} {statistics.mean(v):.2f} ({float(np.percentile(v, 95)):.2f})"
              for k, v in diffs.items()))


def _cpu_tree(proc: Any) -> float:
    """CPU seconds of this process, its reaped children and its live children."""
    t = proc.cpu_times()
    total = float(t.user + t.system + t.children_user + t.children_system)
    for child in proc.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass  # ended between the listing and the reading: reaped, counted above
    return total


def _loader_costs(root: str, args: argparse.Namespace) -> None:
    import torch

    from asyncfeed import AsyncLoader, normalize
    me = psutil.Process()
    ds = ImageFolder(root, args.size, train=True, seed=0)
    n = len(ds)
    pil = PilAugment(list(ds.samples), args.size, seed=0)
    per_sample: list[float] = []
    per_pil: list[float] = []
    epochs: list[list[float]] = [[] for _ in range(args.loader_epochs)]
    rates: list[list[float]] = [[] for _ in range(args.loader_epochs)]
    chosen: list[str] = []
    for _ in range(args.rounds):
        c0 = _cpu_tree(me)
        for i in range(n):
            ds[i]
        per_sample.append((_cpu_tree(me) - c0) / n * 1e3)
        c0 = _cpu_tree(me)
        for i in range(n):
            pil[i]
        per_pil.append((_cpu_tree(me) - c0) / n * 1e3)
        with AsyncLoader(ds, batch_size=args.batch_size, shuffle=True, seed=0,
                         execution=args.execution) as loader:
            for e in range(args.loader_epochs):
                loader.set_epoch(e)
                c0, t0, got = _cpu_tree(me), time.perf_counter(), 0
                for x, _ in loader:
                    got += int(x.shape[0])
                epochs[e].append((_cpu_tree(me) - c0) / got * 1e3)
                rates[e].append(got / (time.perf_counter() - t0))
            ex = loader.stats().execution
            chosen.append(f"{ex.mode.value} x{ex.count}" if ex is not None else "?")
    med = statistics.median(per_sample)
    print(f"\n5. the loader ({n} images per epoch, batch {args.batch_size}, "
          f"execution={args.execution!r}; CPU ms per image, median (worst round))")
    print(f"   PIL pipeline (bench's PilAugment)[i]     {statistics.median(per_pil):.3f} "
          f"({max(per_pil):.3f})  (float, normalized)")
    print(f"   ImageFolder(train=True)[i], one thread   {med:.3f} ({max(per_sample):.3f})")
    for e, (cpu, rate) in enumerate(zip(epochs, rates)):
        m = statistics.median(cpu)
        print(f"   AsyncLoader, epoch {e}                    {m:.3f} ({max(cpu):.3f})  "
              f"{m - med:+.3f} over the sample  {statistics.median(rate):,.0f} img/s (noisy)")
    print(f"   execution after the last epoch: {', '.join(chosen)}")

    x = torch.randint(0, 256, (args.batch_size, 3, args.size, args.size), dtype=torch.uint8)
    reps = max(1, n // args.batch_size)

    reused = torch.empty(x.shape, dtype=torch.float32)

    # the one-op form normalize runs on a GPU: on the CPU torch converts the uint8 batch
    # through a float temporary of its own
    a, b = torch.rand(3, 1, 1), torch.rand(3, 1, 1)

    def addcmul(out: Any) -> Any:
        return torch.addcmul(b, x, a, out=out)

    def norm(threads: int, out: Any = None, op: Any = None) -> tuple[Any, int]:
        call = op or (lambda out: normalize(x, out=out))

        def run() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                for _ in range(reps):
                    call(out)
            finally:
                torch.set_num_threads(before)
        return run, reps * args.batch_size

    k = torch.get_num_threads()
    res = _rounds({f"{k} thread{'s' if k > 1 else ''} (torch's)": norm(k),
                   "1 thread": norm(1),
                   "1 thread, out= reused": norm(1, reused),
                   "addcmul, out= reused": norm(1, reused, addcmul)}, args.rounds)
    print(f"\n6. normalize, a [{args.batch_size}, 3, {args.size}, {args.size}] uint8 batch on "
          f"the CPU, per image")
    for name, (m, worst) in res.items():
        print(f"   {name:<22} {m:.3f} ({worst:.3f})")


if __name__ == "__main__":
    sys.exit(main())
