"""Record the execution chooser's readings on real passes, as replayable traces.

Each data set runs in a fresh process with a default ``AsyncLoader`` for up to
``--epochs`` epochs (stopping once the choice settled); the chooser's record
(every window: candidate, rows, seconds, the consumer's wait, the rows' CPU in this
process and in the workers; the cost of a row's trip back from a worker process),
its space and its choice are written
as JSON, one file per data set and run, to ``--out``.  The decision tests
(``tests/engine/test_policy_traces.py``) replay these files through
``policy.decide``: the same readings always give the same decision, so a rule
change that would decide a recorded run otherwise fails there.

    PYTHONPATH=src python bench/record_choice.py --out tests/engine/traces
    PYTHONPATH=src python bench/record_choice.py --sets gil,sha --neighbour --tag busy

``--neighbour`` runs one busy-looping process beside each run (a noisy
machine); ``--tag`` names the files' variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from asyncfeed._bench.neighbour import busy_neighbour

_CHILD = r"""
import hashlib, json, sys, time
import numpy as np, torch
from asyncfeed import AsyncLoader

name, epochs = sys.argv[1], int(sys.argv[2])

class Gil:  # pure Python per sample: holds the GIL
    def __len__(self): return 2000
    def __getitem__(self, i):
        x = 0
        for k in range(12000):
            x += k * k % 7
        return torch.tensor([x, i])

class Sha:  # hashing a 1 MiB buffer: the GIL released
    buf = bytes(1 << 20)
    def __len__(self): return 2000
    def __getitem__(self, i):
        return torch.tensor(list(hashlib.sha256(self.buf + bytes([i % 256])).digest()[:4]))

class Mixed:  # hashing (the GIL released), then twice as long in pure Python (held)
    buf = bytes(1 << 20)
    def __len__(self): return 2000
    def __getitem__(self, i):
        h = hashlib.sha256(self.buf + bytes([i % 256])).digest()
        x = 0
        for k in range(24000):
            x += k * k % 7
        return torch.tensor([x, h[0], i])

class Jpeg:  # decoding photos held in RAM (the GIL released)
    def __init__(self):
        import simplejpeg
        g = np.random.default_rng(0)
        base = np.cumsum(g.integers(-3, 4, (480, 640, 3)), axis=1).astype(np.uint8)
        self.raw = [simplejpeg.encode_jpeg(np.roll(base, k * 7, axis=0), 85) for k in range(16)]
        self.decode = simplejpeg.decode_jpeg
    def __len__(self): return 2000
    def __getitem__(self, i):
        img = self.decode(self.raw[i % 16])[16:240, 32:256]
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))

class Noop:  # costs nothing: the loader's own overhead
    row = np.zeros((3, 8, 8), np.uint8)
    def __len__(self): return 50000
    def __getitem__(self, i): return self.row, i

class Dicts:  # detection-style dict samples, a custom collate
    def __init__(self):
        g = np.random.default_rng(0)
        self.img = g.integers(0, 255, (512, 3, 48, 48), np.uint8)
        self.nbox = g.integers(0, 20, 512)
    def __len__(self): return 12000
    def __getitem__(self, i):
        n = int(self.nbox[i % 512])
        return {"image": torch.from_numpy(self.img[i % 512]),
                "boxes": torch.arange(n * 4, dtype=torch.float32).view(n, 4), "id": f"img{i}"}

def collate_dicts(batch):
    return {"image": torch.stack([b["image"] for b in batch]),
            "boxes": [b["boxes"] for b in batch], "id": [b["id"] for b in batch]}

class Tokens:  # Python tokenisation: split and dict look-ups
    words = ("the a of to in and is for on with as by at it from that this be are was "
             "loader batch thread process sample gpu").split()
    vocab = {w: k for k, w in enumerate(words)}
    def __len__(self): return 20000
    def __getitem__(self, i):
        line = " ".join(self.words[(i * 7 + k) % len(self.words)] for k in range(8 + i % 24))
        return {"ids": torch.tensor([self.vocab.get(w, 0) for w in line.split()])}

def collate_tokens(batch):
    n = max(len(b["ids"]) for b in batch)
    out = torch.zeros(len(batch), n, dtype=torch.long)
    for k, b in enumerate(batch):
        out[k, :len(b["ids"])] = b["ids"]
    return {"ids": out}

class Cifar:  # 32x32 arrays with a per-sample generator
    def __init__(self): self.x = np.random.default_rng(0).integers(0, 255, (5000, 32, 32, 3), np.uint8)
    def __len__(self): return 20000
    def __getitem__(self, i):
        g = np.random.default_rng(i)
        img = np.pad(self.x[i % 5000], ((4, 4), (4, 4), (0, 0)))
        y, x = g.integers(0, 9, 2)
        img = img[y:y + 32, x:x + 32]
        if g.random() < 0.5:
            img = img[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), i % 10

class Sleepy:  # waits for I/O (the GIL released, no CPU)
    def __len__(self): return 1200
    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.tensor([i])

def spectro():  # NumPy spectrograms: small calls release the GIL, Python holds it between
    from asyncfeed._bench.userdata import AudioClips
    return AudioClips(4096)

def pngs():  # PNGs decoded and rotated by Pillow (the GIL released in its C parts)
    from asyncfeed._bench.userdata import PngAugment
    return PngAugment(4096)

def reads():  # rows that wait 3 ms (a read from slow storage), then 4 KiB to float32
    from asyncfeed._bench.userdata import SlowReads
    return SlowReads(3072)

def augment():  # training augmentation fused into decoding: the bench's synthetic photos
    from asyncfeed import ImageFolder
    from asyncfeed._bench.synthetic import ensure_synthetic
    return ImageFolder(ensure_synthetic(1000, 10), 224, train=True)

# each built only when chosen
sets = {"gil": (Gil, 16, None), "sha": (Sha, 16, None), "mixed": (Mixed, 16, None),
        "jpeg": (Jpeg, 32, None), "augment": (augment, 32, None), "noop": (Noop, 256, None),
        "dicts": (Dicts, 32, collate_dicts), "tokens": (Tokens, 64, collate_tokens),
        "cifar": (Cifar, 128, None), "sleepy": (Sleepy, 16, None),
        "spectro": (spectro, 32, None), "pngs": (pngs, 64, None), "reads": (reads, 32, None)}
make, bs, collate = sets[name]
ds = make()
al = AsyncLoader(ds, batch_size=bs, collate_fn=collate)
rates = []
for e in range(epochs):
    t = time.perf_counter(); n = 0
    for b in al:
        n += 1
    rates.append(n * bs / (time.perf_counter() - t))
    if not al._chooser.exploring and e >= 1:
        break
ch = al._chooser
out = {"set": name, "space": ch.space.to_dict(), "record": ch.record.to_dict(),
       "choice": [ch.decision.choice.mode.value, ch.decision.choice.count],
       "settled": ch.decision.settled, "epoch_rates": rates, "report": str(ch.report())}
al.close()
print(json.dumps(out))
"""

SETS = ("gil", "sha", "mixed", "jpeg", "augment", "noop", "dicts", "tokens", "cifar", "sleepy",
        "spectro", "pngs", "reads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--neighbour", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="tests/engine/traces")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.sets.split(","):
        for run in range(args.runs):
            with busy_neighbour(args.neighbour):
                t0 = time.monotonic()
                p = subprocess.run([sys.executable, "-c", _CHILD, name, str(args.epochs)],
                                   capture_output=True, text=True, timeout=600)
            if p.returncode:
                print(f"{name}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            rec["neighbour"] = args.neighbour
            rec["load1"] = os.getloadavg()[0]
            suffix = f"-{args.tag}" if args.tag else ""
            path = os.path.join(args.out, f"{name}{suffix}-{run}.json")
            with open(path, "w") as f:
                json.dump(rec, f, indent=None)
                f.write("\n")
            print(f"{name} run {run} ({time.monotonic() - t0:.1f} s): {rec['report']}")


if __name__ == "__main__":
    main()
