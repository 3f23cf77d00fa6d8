"""``ImageDecoder``: the default :class:`~asyncfeed.protocols.Decoder` of ``ImageFolder``."""

from __future__ import annotations

import torch

from .image import Interpolation, check_interpolation, check_size, decode_image


class ImageDecoder:
    """Image file bytes to a ``uint8`` RGB tensor ``[3, size, size]`` (full size with
    ``size=None``): decoded, resized on the short side and centre-cropped by
    :func:`asyncfeed.decode_image`.  Thread-safe.

    ``decode_into`` writes into a ``[3, size, size]`` uint8 CPU tensor (a batch
    row) and returns True; it returns False, writing nothing, for any other
    ``out`` (or with ``size=None``, whose shapes vary).
    """

    def __init__(self, size: int | None = 224, interpolation: Interpolation = "area") -> None:
        check_size(size)
        check_interpolation(interpolation)
        self.size = None if size is None else int(size)
        self.interpolation: Interpolation = interpolation

    def __call__(self, raw: bytes) -> torch.Tensor:
        return torch.from_numpy(decode_image(raw, self.size, interpolation=self.interpolation))

    def decode_into(self, raw: bytes, out: torch.Tensor) -> bool:
        if self.size is None or tuple(out.shape) != (3, self.size, self.size):
            return False
        decode_image(raw, self.size, out=out.numpy(), interpolation=self.interpolation)
        return True

    def __repr__(self) -> str:
        return f"ImageDecoder(size={self.size}, interpolation={self.interpolation!r})"
