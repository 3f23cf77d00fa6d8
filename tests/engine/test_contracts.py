"""The extension contracts (``asyncfeed.protocols``), read once per loader
(``Capabilities``), and the one error module."""

from __future__ import annotations

import asyncio
import importlib
import re
from pathlib import Path
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import asyncfeed
from asyncfeed import protocols
from asyncfeed._engine.capabilities import Capabilities
from asyncfeed._engine.runtime import Runtime
from asyncfeed._errors import ErrorKind, classify
from support.oracle import assert_parity, assert_same_batches


class Split:
    """Map-style, ``read``/``fetch`` + ``decode`` + ``decode_into`` + ``sample_source``."""

    def __init__(self, n: int = 20, use_async_fetch: bool = True) -> None:
        self.n = n
        self.use_async_fetch = use_async_fetch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.decode(self.read(i), i)

    def read(self, i):
        return i * 3

    async def fetch(self, i):
        await asyncio.sleep(0)
        return i * 3

    def decode(self, raw, i):
        return torch.full((2,), raw, dtype=torch.int64), i

    def decode_into(self, raw, i, out):
        out.fill_(raw)
        return out, i

    def sample_source(self, i):
        return f"item-{i}"

    async def close_io(self):
        pass


class Stream(IterableDataset):
    """Iterable that splits its work, with the one decode signature."""

    def __init__(self, n: int = 11) -> None:
        self.n = n
        self.seen: list = []

    def iter_raw(self):
        return iter(range(100, 100 + self.n))

    def decode(self, raw, index):
        self.seen.append((raw, index))
        return raw * 2

    def __iter__(self):
        return (self.decode(raw, i) for i, raw in enumerate(self.iter_raw()))


class OldStream(IterableDataset):
    """The 0.1 form: ``decode(raw)``."""

    def iter_raw(self):
        return iter(range(7))

    def decode(self, raw):
        return raw + 1

    def __iter__(self):
        return map(self.decode, self.iter_raw())


# ------------------------------------------------------------------ protocols
def test_builtins_fit_the_protocols(tmp_path):
    from support.imagegen import write
    write("baseline", tmp_path / "a" / "x.jpg")
    folder = asyncfeed.ImageFolder(tmp_path, size=8)
    for proto in (protocols.AsyncFetchDataset, protocols.ReadDecodeDataset,
                  protocols.DecodeIntoDataset, protocols.NamedSamples, protocols.ClosesIO):
        assert isinstance(folder, proto), proto
    assert isinstance(asyncfeed.LocalSource(tmp_path), protocols.Source)
    for name in ("is_local", "list_dirs", "list_files", "read_sync", "read", "close_io"):
        assert hasattr(asyncfeed.FsspecSource, name), name  # a Source (not made: needs a URL)
    assert isinstance(asyncfeed.ImageDecoder(8), protocols.DecoderInto)
    assert isinstance(asyncfeed.ImageLabelDecoder(8), protocols.Decoder)
    shards = asyncfeed.WebDatasetShards(str(tmp_path / "x-{0..1}.tar"),
                                        decode=asyncfeed.ImageLabelDecoder(8))
    assert isinstance(shards, protocols.SplitIterableDataset)
    assert isinstance(shards, protocols.RankAware)
    assert not isinstance(Split(), protocols.SplitIterableDataset)
    for name in ("pin", "to_device", "hand_over"):
        assert callable(getattr(asyncfeed.CopyStream, name))


def test_protocols_are_exported():
    assert asyncfeed.protocols is protocols
    for name in ("Source", "Decoder", "DecoderInto", "DeviceTransfer"):
        assert getattr(asyncfeed, name) is getattr(protocols, name)
    assert sorted(protocols.__all__) == protocols.__all__
    for name in protocols.__all__:
        assert getattr(protocols, name).__doc__, name


# --------------------------------------------------------------- capabilities
def test_capabilities_of_a_split_dataset():
    ds = Split()
    c = Capabilities.of(ds)
    assert not c.iterable and c.use_fetch and c.has_read
    assert c.fetch == ds.fetch and c.read == ds.read and c.decode == ds.decode
    assert c.decode_into == ds.decode_into and c.sample_source == ds.sample_source
    assert c.close_io == ds.close_io and c.getitems is None and c.iter_raw is None
    off = Capabilities.of(Split(use_async_fetch=False))
    assert not off.use_fetch and off.has_read and off.close_io is None
    with pytest.raises(AttributeError):
        c.fetch = None  # frozen


def test_capabilities_of_plain_datasets():
    plain = Capabilities.of([torch.zeros(2)] * 3)
    assert not plain.iterable and not plain.use_fetch and not plain.has_read
    assert plain.decode is None and plain.decode_into is None

    class ReadOnly:  # read without decode is no capability
        def __getitem__(self, i):
            return i

        def __len__(self):
            return 3

        def read(self, i):
            return i

    assert Capabilities.of(ReadOnly()).read is None
    it = Capabilities.of(Stream())
    assert it.iterable and it.iter_raw is not None and it.fetch is None


def test_capabilities_are_read_once_per_loader():
    """A loader keeps what it read when it was made; a new loader sees the change."""
    ds = Split()
    loader = asyncfeed.AsyncLoader(ds, batch_size=4, num_threads=2)
    ds.use_async_fetch = False
    assert loader._caps.use_fetch
    assert not asyncfeed.AsyncLoader(ds, batch_size=4)._caps.use_fetch
    loader.close()


@pytest.mark.parametrize("fetch", [True, False])
def test_split_dataset_through_the_loader(fetch):
    assert_parity(Split(23, use_async_fetch=fetch), batch_size=4, shuffle=True, num_threads=3)


def test_iterable_decode_gets_stream_positions():
    ds = Stream(11)
    want = list(DataLoader(ds, batch_size=3))
    ds.seen.clear()
    with asyncfeed.AsyncLoader(ds, batch_size=3, num_threads=3) as al:
        got = list(al)
    assert_same_batches(got, want)
    assert sorted(ds.seen) == [(100 + i, i) for i in range(11)]


def test_one_argument_iterable_decode_still_works_and_warns():
    import asyncfeed._engine.capabilities as caps_mod
    caps_mod._warned.discard(OldStream)
    want = list(DataLoader(OldStream(), batch_size=2))
    with pytest.warns(DeprecationWarning, match=r"OldStream.decode\(raw\).*decode\(raw, index\)"):
        al = asyncfeed.AsyncLoader(OldStream(), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        al2 = asyncfeed.AsyncLoader(OldStream(), batch_size=2)
    with al, al2:
        assert_same_batches(list(al), want)
        assert_same_batches(list(al2), want)


# ----------------------------------------------------------------------- errors
def test_one_error_module_draws_the_tree():
    errors = importlib.import_module("asyncfeed._errors")
    with pytest.raises(ImportError):
        importlib.import_module("asyncfeed._io.remote_errors")
    public = [n for n in asyncfeed.__all__ if isinstance(getattr(asyncfeed, n), type)
              and issubclass(getattr(asyncfeed, n), BaseException)]
    assert len(public) >= 7
    for name in public:
        assert getattr(asyncfeed, name) is getattr(errors, name)
        assert re.search(rf"\b{name}\b", errors.__doc__), f"{name} is not in the tree"
    assert issubclass(asyncfeed.RemoteTimeoutError, asyncfeed.RemoteReadError)
    assert issubclass(asyncfeed.RemoteReadError, (asyncfeed.AsyncFeedError, OSError))


def test_classify_returns_an_enum_equal_to_the_old_strings():
    kinds = {classify(FileNotFoundError()), classify(PermissionError()),
             classify(TimeoutError()), classify(ValueError())}
    assert kinds == set(ErrorKind)
    assert all(isinstance(k, ErrorKind) for k in kinds)
    assert classify(TimeoutError()) is ErrorKind.TRANSIENT
    assert ErrorKind.TRANSIENT == "transient" and str(ErrorKind.MISSING) == "missing"


class _Fetching(Split):
    """Split, reading on the loop."""


@pytest.mark.parametrize("fetch", [False, True])
def test_work_refused_at_close_is_a_loader_closed_error(fetch):
    """A batch whose work the closing runtime refuses carries LoaderClosedError, which the
    consumer raises as it is (it was a bare AsyncFeedError)."""
    loader = asyncfeed.AsyncLoader(Split(8, use_async_fetch=fetch), batch_size=4,
                                   num_threads=1)
    rt = Runtime(1, with_loop=fetch)
    try:
        rt.pool.shutdown(wait=True)  # the decode pool refuses new work, the loop still runs
        p, _ = loader._make_pipeline(rt)
        p.top_up()
        b = p.wait(0, 10)
        assert isinstance(b.error, asyncfeed.LoaderClosedError), repr(b.error)
        assert not b.failures
    finally:
        rt.close()
        loader.close()


# ------------------------------------------------------------------------- docs
DOCS = Path(__file__).resolve().parents[2] / "docs"
BENCH_DOCS = {"benchmarks.md", "gpu.md"}  # the bench's own tools may be named there


def _user_docs() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if p.name not in BENCH_DOCS] + \
        [DOCS.parent / "README.md"]


def test_user_docs_do_not_send_users_to_private_modules():
    for path in _user_docs():
        hits = re.findall(r"asyncfeed\._\w+(?:\.\w+)*", path.read_text())
        assert not hits, f"{path.name} names private modules: {hits}"


def test_what_docs_import_from_asyncfeed_is_exported():
    for path in [*_user_docs(), *(DOCS / n for n in BENCH_DOCS)]:
        text = path.read_text()
        found = re.findall(r"from asyncfeed import \(([^)]*)\)", text) + \
            re.findall(r"from asyncfeed import ([\w, ]+)$", text, flags=re.M)
        for names in found:
            for name in (n.strip() for n in names.split(",")):
                if name:
                    assert name in asyncfeed.__all__, f"{path.name} imports {name}"


def test_the_memory_and_io_layers_import_nothing_from_the_engine():
    """``_memory`` and ``_io`` sit below ``_engine``: they import nothing from it
    (sample layouts live in ``_memory``, where both can use them)."""
    import ast
    from pathlib import Path
    pkg = Path(asyncfeed.__file__).parent
    offenders = []
    for layer in ("_memory", "_io"):
        for path in sorted((pkg / layer).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    name = "." * node.level + (node.module or "")
                    if "_engine" in name:
                        offenders.append(f"{layer}/{path.name}: from {name} import ...")
                elif isinstance(node, ast.Import):
                    offenders += [f"{layer}/{path.name}: import {a.name}" for a in node.names
                                  if "_engine" in a.name]
    assert not offenders, offenders
