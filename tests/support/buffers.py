"""Batch buffers for tests that compare two ways of writing rows into them."""

from __future__ import annotations

from typing import Any

import torch

from asyncfeed._memory.layout import Layout


def zeroed_pair(layout: Layout, rows: int) -> tuple[list[Any], list[Any]]:
    """Two buffer sets of ``rows`` rows for ``layout``, their tensors zeroed (what a
    test writes into one is compared with what it writes into the other)."""
    pair = layout.allocate(rows), layout.allocate(rows)
    for bufs in pair:
        for x in bufs:
            if isinstance(x, torch.Tensor):
                x.zero_()
    return pair


def assert_same_buffers(a: list[Any], b: list[Any]) -> None:
    """Bit-identical buffer sets: tensors compared byte for byte (bool as is),
    other leaves (strings, Python scalars) by equality."""
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                               y.view(torch.uint8) if y.dtype != torch.bool else y)
        else:
            assert x == y
