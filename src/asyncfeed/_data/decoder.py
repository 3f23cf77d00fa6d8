"""``ImageDecoder``: the default :class:`~asyncfeed.protocols.Decoder` of ``ImageFolder``."""

from __future__ import annotations

import torch

from .image import (Interpolation, MaxPixels, check_interpolation, check_size, decode_image,
                    pixel_limit, preload_resize)


class ImageDecoder:
    """Image file bytes to a ``uint8`` RGB tensor ``[3, size, size]`` (full size with
    ``size=None``): decoded, resized on the short side and centre-cropped by
    :func:`asyncfeed.decode_image`.  Thread-safe.

    ``decode_into`` writes into a ``[3, size, size]`` uint8 CPU tensor (a batch
    row) and returns True; it returns False, writing nothing, for any other
    ``out`` (or with ``size=None``, whose shapes vary).  ``max_pixels`` bounds the
    pixels a file's header may declare, checked before decoding (see
    :func:`asyncfeed.decode_image`).
    """

    def __init__(self, size: int | None = 224, interpolation: Interpolation = "area", *,
                 max_pixels: MaxPixels = "pillow") -> None:
        check_size(size)
        check_interpolation(interpolation)
        pixel_limit(max_pixels)
        self.size = None if size is None else int(size)
        self.interpolation: Interpolation = interpolation
        self.max_pixels: MaxPixels = max_pixels
        if self.size is not None:
            preload_resize()

    def __call__(self, raw: bytes) -> torch.Tensor:
        return torch.from_numpy(decode_image(raw, self.size, interpolation=self.interpolation,
                                             max_pixels=self.max_pixels))

    def decode_into(self, raw: bytes, out: torch.Tensor) -> bool:
        if self.size is None or tuple(out.shape) != (3, self.size, self.size):
            return False
        decode_image(raw, self.size, out=out.numpy(), interpolation=self.interpolation,
                     max_pixels=self.max_pixels)
        return True

    def __repr__(self) -> str:
        return f"ImageDecoder(size={self.size}, interpolation={self.interpolation!r})"
