"""``asyncfeed.normalize``: a uint8 batch to normalized floats, one pass per batch on a
GPU, in place in the result on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import asyncfeed
from asyncfeed import normalize

pytestmark = pytest.mark.timeout(60)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference(x, mean=MEAN, std=STD):
    m = torch.tensor(mean, dtype=torch.float64).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
    return (x.double() / 255 - m) / s


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def batch(device="cpu", n=4):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 10, 12), dtype=torch.uint8, generator=g).to(device)


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_matches_the_definition_in_one_pass_on_the_gpu_and_in_place_on_the_cpu(device):
    x = batch(device)
    y = normalize(x)
    assert y.dtype == torch.float32 and y.device == x.device and y.shape == x.shape
    assert torch.allclose(y.double().cpu(), reference(x.cpu()), atol=1e-5)
    out = torch.empty(x.shape, dtype=torch.float32, device=device)
    with CountOps() as fresh:  # the coefficients are cached: nothing made per batch
        normalize(x)
    with CountOps() as given:
        assert normalize(x, out=out) is out
    assert torch.equal(out, y)
    if device == "cuda":  # one kernel reads the uint8 pixels and writes floats
        assert fresh.ops == ["aten.addcmul.default"] and given.ops == ["aten.addcmul.out"]
    else:  # the result is the only tensor made: converted into, then scaled in place
        in_place = ["aten.copy_.default", "aten.mul_.Tensor", "aten.add_.Tensor"]
        assert fresh.ops == ["aten.empty_like.default"] + in_place
        assert given.ops == in_place


def test_out_of_another_shape_dtype_or_device_is_refused():
    x = batch()
    for out in (torch.empty(3, 3, 10, 12), torch.empty(x.shape, dtype=torch.float64),
                torch.empty(x.shape, device="meta")):
        with pytest.raises(ValueError, match="out must be"):
            normalize(x, out=out)


@pytest.mark.parametrize("device", devices())
def test_dtypes_shapes_and_own_constants(device):
    x = batch(device)
    half = normalize(x, dtype=torch.float16)
    assert half.dtype == torch.float16
    assert torch.allclose(half.double().cpu(), reference(x.cpu()), atol=1e-2)
    one = normalize(x[0])
    assert one.shape == (3, 10, 12) and torch.equal(one, normalize(x)[0])
    mine = normalize(x, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert torch.allclose(mine.double().cpu(), reference(x.cpu(), (0.5,) * 3, (0.5,) * 3),
                          atol=1e-5)
    raw = normalize(x, mean=(0, 0, 0), std=(1, 1, 1), scale=1.0)
    assert torch.equal(raw, x.float())
    last = normalize(x.contiguous(memory_format=torch.channels_last))
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.equal(last, normalize(x))


def test_bad_input():
    with pytest.raises(ValueError, match="3"):
        normalize(torch.zeros(2, 4, 5, 5, dtype=torch.uint8))
    with pytest.raises(ValueError):
        normalize(torch.zeros(5, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="zero"):
        normalize(batch(), std=(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="one value per channel"):
        normalize(batch(), mean=(0.5, 0.5))
    with pytest.raises(ValueError, match="floating"):
        normalize(batch(), dtype=torch.int32)
    with pytest.raises(TypeError):
        normalize([1, 2, 3])  # type: ignore[arg-type]


def test_exported():
    assert asyncfeed.normalize is normalize and "normalize" in asyncfeed.__all__
