"""Refused reads against the 0 ms rate, in one process, without servers: what the loader
itself does with retries (the read-ahead's places, the decode window), apart from a
machine's CPU and its servers.

Each sample's ``async fetch`` waits ``--latency`` (20 ms); ``--errors`` (10%) of first
attempts wait that long, then the source's backoff (0.1-0.2 s, slept through
``asyncfeed._io.backoff`` as ``FsspecSource`` sleeps it), then the latency again;
``decode`` sleeps ``--decode-ms`` (2 ms: a GIL-free decode, so a busy machine moves the
result little).  The reference is the same loader with neither latency nor errors.
Batch 32, 2 threads; ``--samples`` per pass (256, workload (e)'s default).

    PYTHONPATH=src python bench/retry_model.py [ROUNDS] [--samples N] [--prefetch K]
"""
import argparse
import asyncio
import random
import statistics
import time

import torch

from asyncfeed import AsyncLoader
from asyncfeed._io.backoff import backoff

RAW = b"x" * 100_000   # a compressed image's bytes: what the read-ahead budget counts


class Refusing:
    def __init__(self, n: int, latency: float, errors: float, decode_s: float,
                 seed: int) -> None:
        self.n, self.latency, self.errors, self.decode_s = n, latency, errors, decode_s
        self.rng = random.Random(seed)
        self.refused: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise AssertionError("read through fetch")

    async def fetch(self, i: int) -> bytes:
        if self.latency:
            await asyncio.sleep(self.latency)
        if i not in self.refused and self.rng.random() < self.errors:
            self.refused.add(i)
            await backoff(0.1 + self.rng.uniform(0.0, 0.1))
            await asyncio.sleep(self.latency)
        return RAW

    def decode(self, raw: bytes, i: int) -> torch.Tensor:
        time.sleep(self.decode_s)
        return torch.zeros(4)


def rate(ds: Refusing, seed: int, prefetch: int | None) -> float:
    t0, n = time.perf_counter(), 0
    with AsyncLoader(ds, batch_size=32, num_threads=2, shuffle=True, seed=seed,
                     prefetch=prefetch) as loader:
        for b in loader:
            n += len(b)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int, nargs="?", default=5)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--errors", type=float, default=0.1)
    ap.add_argument("--decode-ms", type=float, default=2.0)
    ap.add_argument("--prefetch", type=int, default=None)
    a = ap.parse_args()
    ratios = []
    for rnd in range(a.rounds):
        zero = rate(Refusing(a.samples, 0.0, 0.0, a.decode_ms / 1e3, rnd), rnd, a.prefetch)
        tail = rate(Refusing(a.samples, a.latency, a.errors, a.decode_ms / 1e3, rnd), rnd,
                    a.prefetch)
        ratios.append(tail / zero)
        print(rnd, f"0 ms {zero:.0f}/s, refused {tail:.0f}/s, x 0 ms {ratios[-1]:.2f}",
              flush=True)
    print(f"x 0 ms: median {statistics.median(ratios):.2f}, worst {min(ratios):.2f}")


if __name__ == "__main__":
    main()
