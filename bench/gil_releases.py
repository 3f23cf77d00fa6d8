"""What letting go of the GIL for a microsecond's call costs the fused training decode.

    PYTHONPATH=src python bench/gil_releases.py [--threads 2] [--busy 0,1] [--rounds 5]
        [--images 400]

The fused per-sample function of ``ImageFolder(train=True)`` (random-resized-crop
and flip to 224, region decoding through ``_data/jpegregion.py``) runs over the
bench's synthetic photos (file bytes held in RAM) in ``--threads`` threads, beside
``--busy`` threads that run Python without pause (a consumer or training loop
whose Python holds the GIL).  Two bindings of TurboJPEG 3 are compared, rounds
interleaved (A B A B ...):

* ``held``: the library's own binding: only the decode lets go of the GIL, the
  calls that take a microsecond (header, parameters) keep it;
* ``released``: every call lets go of it (``ctypes.CDLL`` throughout).

Each release lets a waiting thread take the GIL, and taking it back waits until
that thread lets go: behind a thread running Python, up to a switch interval
(``sys.getswitchinterval()``).  Prints images/s per binding and busy count, the
median over the rounds and the worst round, and the busy threads' progress.
Needs a TurboJPEG 3 library (the ``turbojpeg`` wheel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from asyncfeed import ImageFolder
from asyncfeed._bench import synthetic
from asyncfeed._data import jpegregion


def _run(decoder: Any, raws: list[bytes], threads: int, busy: int) -> tuple[float, float]:
    """(images/s of ``threads`` decoding ``raws``, loops/s of the ``busy`` threads)."""
    stop = threading.Event()
    loops = [0] * busy

    def spin(k: int) -> None:
        n = 0
        while not stop.is_set():
            for i in range(1000):
                n += i
            loops[k] += 1

    def work(idx: range) -> None:
        out = np.empty((3, decoder.size, decoder.size), np.uint8)
        for i in idx:
            decoder.decode(raws[i], i, out)

    spinners = [threading.Thread(target=spin, args=(k,)) for k in range(busy)]
    for t in spinners:
        t.start()
    workers = [threading.Thread(target=work, args=(range(j, len(raws), threads),))
               for j in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    for t in spinners:
        t.join()
    return len(raws) / wall, sum(loops) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", default="0,1", help="busy Python threads, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=400)
    args = ap.parse_args()
    lib = jpegregion._library()
    if lib is None:
        sys.exit("no TurboJPEG 3 library: install the turbojpeg wheel (asyncfeed[turbo])")
    bindings = {"held": lib, "released": jpegregion._bind(
        lib.name, releasing=frozenset(jpegregion._SIGNATURES))}
    folder = ImageFolder(synthetic.ensure_synthetic(1000, 10, seed=0), size=224, train=True)
    decoder = folder.decoder
    raws = [folder.read(i) for i in range(min(args.images, len(folder)))]
    print(f"{len(raws)} images, {args.threads} decode threads, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms; median (worst) of {args.rounds} rounds")
    for busy in (int(b) for b in args.busy.split(",")):
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in bindings}
        for _ in range(args.rounds):
            for name, bound in bindings.items():
                jpegregion._library = lambda b=bound: b  # type: ignore[assignment]
                got[name].append(_run(decoder, raws, args.threads, busy))
        for name, runs in got.items():
            rates = [r for r, _ in runs]
            spins = statistics.median(s for _, s in runs)
            print(f"  busy {busy}, {name:8s}: {statistics.median(rates):7.0f} img/s "
                  f"({min(rates):.0f})" + (f", busy loops {spins:,.0f}/s" if busy else ""))


if __name__ == "__main__":
    main()
