"""``normalize``: a ``uint8`` image batch to normalized floats, where it lives.

Normalizing per sample in the loader multiplies the bytes every later step moves
by four (float32) and spends the loader's CPU on arithmetic the GPU does in
microseconds.  The loader hands out ``uint8`` batches; the training step calls
:func:`normalize` on the batch once it is on the device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "normalize"]

#: ImageNet's per-channel mean and std of pixels in [0, 1] (torchvision's constants)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_Key = tuple[tuple[float, ...], tuple[float, ...], float, torch.device, torch.dtype]
_coefficients: dict[_Key, tuple[torch.Tensor, torch.Tensor]] = {}
_lock = threading.Lock()


def _coeffs(mean: tuple[float, ...], std: tuple[float, ...], scale: float,
            device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` with ``x * a + b == (x * scale - mean) / std``, shaped ``[C, 1, 1]`` to
    broadcast over a ``[N, C, H, W]`` or ``[C, H, W]`` batch, made once per device and
    dtype."""
    key = (mean, std, scale, device, dtype)
    got = _coefficients.get(key)
    if got is not None:
        return got
    shape = (len(mean),) + (1, 1)
    m = torch.tensor(mean, dtype=torch.float64)
    s = torch.tensor(std, dtype=torch.float64)
    a = (scale / s).reshape(shape).to(device=device, dtype=dtype)
    b = (-m / s).reshape(shape).to(device=device, dtype=dtype)
    with _lock:
        _coefficients.setdefault(key, (a, b))
        return _coefficients[key]


def normalize(batch: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN,
              std: Sequence[float] = IMAGENET_STD, *, dtype: torch.dtype = torch.float32,
              scale: float = 1 / 255, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch * scale - mean) / std`` per channel, as ``dtype``, on ``batch``'s device.

    ``batch`` is ``[N, C, H, W]`` or ``[C, H, W]`` (any integer or float dtype: the
    ``uint8`` batches of ``ImageFolder``); ``mean``/``std`` have one value per
    channel (default: ImageNet's, for pixels scaled to [0, 1] by ``scale``).  It is
    ``x * a + b`` with per-channel coefficients made once per device and dtype and
    cached.  On a GPU it is one fused ``addcmul`` (one kernel reads the ``uint8``
    pixels and writes ``dtype``).  On the CPU it converts the pixels into the result
    and scales and shifts it there, in place: torch's CPU ``addcmul`` would convert
    the batch through a temporary float copy of its own.  ``out``: a ``dtype``
    tensor of the batch's shape on its device to write into; on the CPU, pass one
    the loop keeps (a fresh result per batch may be paged in anew each call,
    several times the arithmetic: ``docs/augmentation.md``).  Raises ValueError for
    a batch whose channel count differs from ``mean``'s, a ``std`` with a zero, or
    an ``out`` of another shape, dtype or device.
    """
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"normalize takes a tensor, got {type(batch).__name__}")
    m = tuple(float(v) for v in mean)
    s = tuple(float(v) for v in std)
    if len(m) != len(s) or not m:
        raise ValueError(f"mean and std need one value per channel, got {len(m)} and {len(s)}")
    if any(v == 0 for v in s):
        raise ValueError(f"std has a zero: {s}")
    if batch.dim() not in (3, 4) or batch.shape[-3] != len(m):
        raise ValueError(f"expected a [N, {len(m)}, H, W] or [{len(m)}, H, W] batch, got "
                         f"shape {tuple(batch.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    if out is not None and (out.shape != batch.shape or out.dtype != dtype
                            or out.device != batch.device):
        raise ValueError(f"out must be a {dtype} tensor of shape {tuple(batch.shape)} on "
                         f"{batch.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    a, b = _coeffs(m, s, float(scale), batch.device, dtype)
    if batch.device.type != "cpu":
        if out is None:
            return torch.addcmul(b, batch, a)
        return torch.addcmul(b, batch, a, out=out)
    # torch's CPU addcmul converts an integer batch through a temporary copy as large
    # as the result (paged in afresh whenever the allocator gave it back); converting
    # into the result and scaling it there in place is about three times faster
    # (docs/augmentation.md)
    result = torch.empty_like(batch, dtype=dtype) if out is None else out
    result.copy_(batch)
    result.mul_(a)
    return result.add_(b)
