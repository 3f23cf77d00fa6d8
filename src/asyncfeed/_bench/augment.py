"""Workload (h): training augmentation, fused into decoding or run per sample.

Every contender turns the folder's JPEGs into random-resized-crop (to ``size``)
+ horizontal-flip samples, normalized with ImageNet's mean and std:

* ``train``: ``ImageFolder(train=True)``, the crop and flip fused into decoding,
  ``uint8`` rows; the consumer normalizes each batch with
  :func:`asyncfeed.normalize` (one op per batch, on the bench's device; on the
  CPU on the consumer's thread alone, see :func:`normalized`), counted in the
  run's time and CPU.  Run by ``AsyncLoader`` (its defaults, whose one short
  epoch includes measuring its executions, and ``num_threads`` = cores, which
  fixes the execution) and by DataLoader (``w`` = 0, cores, 2 x cores).
* ``pil``: workload (g)'s :class:`~.workloads.PilAugment` (PIL decode,
  RandomResizedCrop, flip, float normalize, written with PIL and numpy), run by
  DataLoader and by ``AsyncLoader`` as a drop-in.
* ``tv-folder``: ``torchvision.datasets.ImageFolder``'s loader with
  ``transforms.v2`` RandomResizedCrop/flip/ToDtype/Normalize; ``tv-decode``: file
  bytes, ``torchvision.io.decode_jpeg`` and the same v2 transforms.  Optional:
  where torchvision is not installed, or does not import (a build for another
  torch), these rows are skipped, with the reason.

The limit lines run the fused per-sample function (``ImageFolder(train=True)[i]``)
one process per core, with no loader, each row then normalized as the consumer
does (:class:`NormalizedRows`): on a CPU-only machine the ``train`` rows' consumer
normalizes every batch on the same cores, so the limit does that work too.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .config import Config

__all__ = ["DATASETS", "NormalizedRows", "build", "normalized", "plan", "relative", "reserve",
           "section", "torchvision_missing"]

#: the data sets of workload (h), by kind
DATASETS = ("train", "pil", "tv-folder", "tv-decode")
TORCHVISION = ("tv-folder", "tv-decode")
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def torchvision_missing() -> str | None:
    """Why the torchvision contenders cannot run here, or None."""
    try:
        importlib.import_module("torchvision.transforms.v2")
        importlib.import_module("torchvision.io")
    except ModuleNotFoundError as e:
        return f"skipped (not installed): torchvision: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run"
        # e.g. a CUDA build beside a CPU-only torch: its extension needs torch's CUDA
        # libraries, and registering its operators fails
        return (f"skipped (installed, but does not import with this torch {torch.__version__}): "
                f"torchvision: {type(e).__name__}: {e}")
    return None


def _tv(module: str) -> Any:
    """A torchvision module (an optional contender: imported by name, untyped)."""
    return importlib.import_module(f"torchvision.{module}")


def _v2_transform(size: int) -> Any:
    v2 = _tv("transforms.v2")
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(_MEAN, _STD)])


class TorchvisionFolder:
    """What ``torchvision.datasets.ImageFolder(root, transform=v2...)`` does per sample
    (its ``pil_loader``, then the transform), over a given sample list."""

    def __init__(self, samples: list[tuple[str, int]], size: int) -> None:
        self.samples = samples
        self.transform = _v2_transform(size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(_tv("datasets.folder").pil_loader(path)), label


class TorchvisionDecode(TorchvisionFolder):
    """File bytes, ``torchvision.io.decode_jpeg`` (RGB), then the same v2 transform."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tvio = _tv("io")
        path, label = self.samples[index]
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        return self.transform(tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB)), label


def build(spec: dict, folder: Any) -> Any:
    """The data set of kind ``spec["kind"]`` over the samples of ``folder`` (an
    ``ImageFolder`` opened on the bench's files)."""
    kind, size = spec["kind"], spec["size"]
    if kind == "tv-folder":
        return TorchvisionFolder(list(folder.samples), size)
    if kind == "tv-decode":
        return TorchvisionDecode(list(folder.samples), size)
    raise ValueError(f"unknown data set kind {kind!r}")


def plan(bench: Any) -> list[Config]:
    """Workload (h)'s configurations (``bench``: the runner's :class:`Bench`)."""
    s = bench.s
    has = bench._has
    workers = tuple(w for w in s.workers if w in (0, s.cores, 2 * s.cores)) or s.workers
    cfgs: list[Config] = bench._limits("h", "train")
    if has("asyncfeed"):
        # its defaults (the first epoch measures executions), and one thread per
        # core fixed: the loader's path without that exploration
        cfgs += [Config("h", "asyncfeed", None, dataset="train", role="default"),
                 Config("h", "asyncfeed", s.cores, dataset="train", role="sweep")]
    sets = ["pil", "train"]
    why = torchvision_missing()
    if why is None:
        sets += list(TORCHVISION)
    else:
        bench.skipped["torchvision (h)"] = why
    for ds in sets:
        if has("dataloader"):
            cfgs += [Config("h", "dataloader", w, dataset=ds,
                            role="reference" if ds != "train" else "sweep") for w in workers]
        if ds != "train" and has("asyncfeed"):
            cfgs.append(Config("h", "asyncfeed", None, dataset=ds, role="drop-in"))
    return cfgs


def relative(rows: list[dict]) -> None:
    """Each row against the best DataLoader setting of each pipeline (``x best PIL DL``...)
    and its CPU per image against DataLoader w=0 running the PIL pipeline."""
    def best(ds: str) -> float:
        return max((r.get("rate") or 0 for r in rows if r["family"] == "dataloader"
                    and r["dataset"] == ds), default=0)
    pil_w0 = next((r for r in rows if r["family"] == "dataloader" and r["dataset"] == "pil"
                   and r["knob"] == 0), None)
    for r in rows:
        if not r.get("rate") or r["family"] == "limit":
            continue
        for ds, key in (("pil", "vs_pil_best"), ("tv-folder", "vs_tv_folder_best"),
                        ("tv-decode", "vs_tv_decode_best")):
            b = best(ds)
            if b:
                r[key] = r["rate"] / b
        if pil_w0 and pil_w0.get("cpu_per_sample_ms") and r.get("cpu_per_sample_ms"):
            r["cpu_vs_pil_w0"] = r["cpu_per_sample_ms"] / pil_w0["cpu_per_sample_ms"]


_PIPELINE = {"train": "fused (uint8) + normalize", "pil": "PIL + numpy",
             "tv-folder": "tv ImageFolder + v2", "tv-decode": "tv decode_jpeg + v2"}


def section(rows: list[dict], settings: dict, fmt: Any, name: Any
            ) -> tuple[str, list[str], list[list[str]]]:
    """Workload (h)'s table as ``(title, headers, rows)`` (``fmt``, ``name``: the
    report's helpers)."""
    out = [[name(r), "fused (uint8) + normalize" if r["family"] == "limit"
            else _PIPELINE.get(r["dataset"], r["dataset"]), fmt(r.get("rate"), ",.0f"),
            fmt(r.get("steady_rate") if r["family"] != "limit" else None, ",.0f"),
            fmt(r.get("vs_pil_best"), ".2f"), fmt(r.get("vs_tv_folder_best"), ".2f"),
            fmt(r.get("vs_tv_decode_best"), ".2f"), fmt(r.get("vs_limit"), ".2f"),
            _by_round(r, fmt), fmt(r.get("cpu_per_sample_ms"), ".3f"),
            fmt(r.get("cpu_vs_pil_w0"), ".2f"),
            fmt(r.get("peak_pss_bytes"), "mb")] for r in rows]
    samples = settings.get("samples_train", settings.get("samples"))
    title = (f"(h) training augmentation: random-resized-crop + flip to {settings['size']}, "
             f"normalized; {samples} samples per run, batch "
             f"{settings['batch_size']}; x: rate against the best DataLoader setting of that "
             f"pipeline; x limit: the medians' ratio; by round: each round's run against the "
             f"limit's run of that round, median (worst); CPU x: against DataLoader w=0 on "
             f"the PIL pipeline; steady: the rate after the run's first tenth of batches")
    headers = ["contender", "pipeline", "img/s", "steady img/s", "x PIL", "x tv-folder", "x tv-decode",
               "x limit", "x limit by round", "CPU ms/img", "CPU x", "peak PSS MB"]
    return title, headers, out


def _by_round(row: dict, fmt: Any) -> str:
    """The row's rate against the limit's run of the same round: median (worst)."""
    if row.get("vs_limit_round_median") is None:
        return fmt(None, ".2f")
    return (f"{fmt(row['vs_limit_round_median'], '.2f')} "
            f"({fmt(row['vs_limit_round_worst'], '.2f')})")


#: the consumer's reused float buffer for :func:`normalized` on the CPU, by row shape
_OUT: dict[tuple[int, ...], torch.Tensor] = {}


def reserve(rows: int, row_shape: tuple[int, ...]) -> None:
    """Make (and page in) the consumer's float buffer for batches of up to ``rows``
    rows of ``row_shape`` before a run starts, as a training loop has its input
    buffer before its first step: paging 19 MB in during the first batch would
    charge the loader's first batch with the consumer's one-off set-up."""
    _OUT.clear()
    _OUT[tuple(row_shape)] = torch.zeros((rows, *row_shape), dtype=torch.float32)


def normalized(images: Any) -> Any:
    """The consumer's per-batch normalize of the fused rows (see the module docstring).

    On the CPU it writes into one reused float buffer (``normalize(out=...)``), as a
    CPU training loop keeps its input tensor: a fresh 19 MB ``float32`` batch per
    call costs about twice the reused one, more where the allocator hands it back
    and it is paged in anew (``bench/augment_decode_costs.py`` section 6 measures
    both).  It runs on the
    consumer's thread alone: torch's intra-op threads would spin-wait after each
    batch on the cores the loader decodes on, and the PIL pipeline it is compared
    with normalizes on one thread per sample too.  On a GPU it runs there (the
    caching allocator reuses the memory).  The result is only valid until the
    next call.
    """
    from .._data.normalize import normalize
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
        return images
    if images.device.type != "cpu":
        return normalize(images)
    rows, row_shape = int(images.shape[0]), tuple(images.shape[1:])
    buf = _OUT.get(row_shape)
    if buf is None or buf.shape[0] < rows:
        reserve(rows, row_shape)
        buf = _OUT[row_shape]
    out = buf[:rows]
    threads = torch.get_num_threads()
    if threads == 1:
        return normalize(images, out=out)
    torch.set_num_threads(1)
    try:
        return normalize(images, out=out)
    finally:
        torch.set_num_threads(threads)


class NormalizedRows:
    """The limit's per-sample work for workload (h): a fused row, then its share of
    the consumer's normalize (the row normalized into a reused buffer), so the
    limit does what the loaders' runs do, less the loader."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        image, label = self.dataset[index]
        image = torch.as_tensor(image)
        return normalized(image.unsqueeze(0)), label
