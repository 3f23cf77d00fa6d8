"""The package's shape as installed: a lean core, extras that say how to get them, types.

* ``import asyncfeed`` imports no optional package (nor OpenCV, Pillow and uvloop,
  which loading imports on first use: they made the import cost ~80 ms more
  after ``import torch``; ``bench/import_time.py`` measures it);
* with an optional package made unimportable (``sys.modules[name] = None`` in a fresh
  interpreter), the feature that needs it raises ``ModuleNotFoundError`` naming the extra;
* the extras in ``pyproject.toml`` hold what ``asyncfeed._optional`` says they hold, the
  core dependencies none of it, and ``py.typed`` ships.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

import asyncfeed
from asyncfeed import _optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "asyncfeed")

#: imported on first use by loading, never by ``import asyncfeed``
LAZY_CORE = ("cv2", "PIL", "uvloop")


def _python(code: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter importing this checkout's asyncfeed, with the
    top-level packages in ``block`` unimportable."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in block)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=100)


def _lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_import_asyncfeed_imports_no_optional_package() -> None:
    proc = _python("""
        import json, sys
        import torch
        before = set(sys.modules)
        import asyncfeed
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    new = json.loads(_lines(proc)[-1])
    tops = {m.partition(".")[0] for m in new}
    optional = sorted(tops & (set(_optional.EXTRAS) | {"s3fs", "aiobotocore", "boto3"}))
    assert optional == [], f"import asyncfeed imported optional packages {optional}"
    lazy = sorted(tops & set(LAZY_CORE))
    assert lazy == [], (f"import asyncfeed imported {lazy}: import them where loading uses "
                        f"them (see bench/import_time.py)")
    internals = sorted(m for m in new if m.startswith(("asyncfeed._bench", "asyncfeed._io.fsspec",
                                                       "asyncfeed._io.conn")))
    assert internals == [], f"import asyncfeed imported {internals}"


def test_opencv_is_imported_by_the_decoders_that_resize_when_they_are_made() -> None:
    # made with the data set, not in a pass's first rows (where the import would hold the
    # GIL for every decode thread); a data set that never resizes never imports it
    proc = _python("""
        import sys
        import asyncfeed
        asyncfeed.ImageDecoder(size=None)
        print("cv2" in sys.modules)
        asyncfeed.ImageDecoder(size=64)
        print("cv2" in sys.modules)
    """)
    assert _lines(proc)[-2:] == ["False", "True"]
    proc = _python("""
        import sys
        from asyncfeed._data.augment import RandomResizedCropDecoder
        RandomResizedCropDecoder(64)
        print("cv2" in sys.modules, "numpy.random" in sys.modules)
    """)
    assert _lines(proc)[-1] == "True True"


def test_remote_roots_without_fsspec_name_the_extra() -> None:
    proc = _python("""
        from asyncfeed import ImageFolder
        for root in ("http://127.0.0.1:9/data", "s3://bucket/data"):
            try:
                ImageFolder(root)
            except ModuleNotFoundError as e:
                print(e.name, "|", e)
    """, block=("fsspec",))
    lines = _lines(proc)
    assert len(lines) == 2, proc.stdout
    for line in lines:
        name, _, msg = line.partition(" | ")
        assert name == "fsspec"
        assert "'fsspec'" in msg and "pip install 'asyncfeed[remote]'" in msg, msg


def test_protocol_backends_without_their_package_name_the_extra() -> None:
    proc = _python("""
        from asyncfeed import ImageFolder
        for root in ("s3://bucket/data", "https://127.0.0.1:9/data"):
            try:
                ImageFolder(root)
            except ModuleNotFoundError as e:
                print(e.name, "|", e)
    """, block=("s3fs", "aiohttp"))
    lines = _lines(proc)
    assert [ln.partition(" | ")[0] for ln in lines] == ["s3fs", "aiohttp"], proc.stdout
    assert "reading s3:// roots needs 's3fs'" in lines[0]
    assert "reading https:// roots needs 'aiohttp'" in lines[1]
    assert all("pip install 'asyncfeed[remote]'" in ln for ln in lines)


def test_remote_shards_without_fsspec_name_the_extra() -> None:
    proc = _python("""
        from asyncfeed import WebDatasetShards
        ds = WebDatasetShards(["http://127.0.0.1:9/shard-0.tar"])
        try:
            next(iter(ds))
        except ModuleNotFoundError as e:
            print(e.name, "|", e)
    """, block=("fsspec",))
    (line,) = _lines(proc)
    assert line.startswith(("fsspec | ", "fsspec.asyn | ")), line
    assert "needs 'fsspec'" in line and "pip install 'asyncfeed[remote]'" in line, line


def test_bench_without_its_tools_says_what_to_install() -> None:
    proc = _python("""
        import contextlib, io, sys
        from asyncfeed._bench.cli import main
        for name in ("psutil", "tqdm", "matplotlib"):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(["bench", "--quick", "--workloads", "a", "--plot", "x.png"])
            print(rc, "|", err.getvalue().strip())
            del sys.modules[name]  # installed again: the next one is reported
    """, block=("psutil", "tqdm", "matplotlib"))
    lines = _lines(proc)
    assert len(lines) == 3, proc.stdout
    for name, line in zip(("psutil", "tqdm", "matplotlib"), lines):
        assert line.startswith("2 | asyncfeed bench: "), line
        assert f"needs '{name}'" in line and "pip install 'asyncfeed[bench]'" in line, line


def test_require_names_feature_extra_and_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_optional.EXTRAS, "asyncfeed_no_such_pkg", "gpu")
    monkeypatch.setitem(_optional.PIP_NAMES, "asyncfeed_no_such_pkg", "no-such-dist")
    with pytest.raises(ModuleNotFoundError) as info:
        _optional.require("asyncfeed_no_such_pkg.sub", "GPU telemetry")
    assert str(info.value) == ("GPU telemetry needs 'no-such-dist' (not installed): "
                               "pip install 'asyncfeed[gpu]'")
    assert info.value.name == "asyncfeed_no_such_pkg"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'asyncfeed\[bench\]'"):
        _optional.require("asyncfeed_no_such_pkg", "asyncfeed bench", extra="bench")
    with pytest.raises(KeyError):
        _optional.require("json", "not an optional package")  # a caller's bug, not a hint
    assert _optional.require("fsspec.asyn", "remote").__name__ == "fsspec.asyn"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _dist(requirement: str) -> str:
    name = requirement
    for stop in "<>=!~;[ ":
        name = name.split(stop, 1)[0]
    return name.lower().replace("_", "-")


def _extra_dists(project: dict, extra: str) -> set[str]:
    """Distributions of ``extra``, following ``asyncfeed[...]`` self-references."""
    out: set[str] = set()
    for req in project["optional-dependencies"][extra]:
        if _dist(req) == "asyncfeed":
            for inner in req[req.index("[") + 1:req.index("]")].split(","):
                out |= _extra_dists(project, inner.strip())
        else:
            out.add(_dist(req))
    return out


def test_extras_hold_what_the_optional_table_says() -> None:
    project = _pyproject()["project"]
    core = {_dist(r) for r in project["dependencies"]}
    for module, extra in _optional.EXTRAS.items():
        dist = _optional.PIP_NAMES.get(module, module)
        if module == "botocore":
            dist = "s3fs"  # botocore comes with s3fs (through aiobotocore)
        assert dist in _extra_dists(project, extra), f"{dist} not in [{extra}]"
        assert dist in _extra_dists(project, "all"), f"{dist} not in [all]"
        assert dist not in core, f"{dist} is optional ([{extra}]) but a core dependency"
    assert core == {"torch", "numpy", "simplejpeg", "pillow", "opencv-python-headless",
                    "uvloop"}


def test_py_typed_ships() -> None:
    assert os.path.isfile(os.path.join(SRC, "py.typed"))
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["asyncfeed"]


def _module_level_imports(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_core_modules_import_optional_packages_only_through_require() -> None:
    """Outside ``_bench`` (behind the CLI's check), a module-level ``import fsspec`` would
    fail with a bare 'No module named' wherever that module is imported on demand."""
    bad = []
    for dirpath, _, files in os.walk(SRC):
        if os.path.basename(dirpath) == "_bench":
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                bad += [f"{os.path.relpath(path, SRC)}: import {name}"
                        for name in _module_level_imports(path)
                        if name.partition(".")[0] in _optional.EXTRAS]
    assert bad == []


def test_version_is_the_packages() -> None:
    assert asyncfeed.__version__ == _pyproject()["project"]["version"]
