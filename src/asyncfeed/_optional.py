"""Optional dependencies: imported where a feature needs them, naming the extra to install.

``pip install asyncfeed`` brings only what loading local files needs.  Remote storage,
progress bars, the benchmark and GPU telemetry live in extras (``pyproject.toml``)::

    remote    fsspec, s3fs, aiohttp (botocore comes with s3fs)
    progress  tqdm
    turbo     turbojpeg (its wheels carry libjpeg-turbo 3, which ``_data/jpegregion.py``
              loads with ctypes, without importing the package: not listed below)
    bench     the above, psutil, matplotlib, torchdata, spdl-core
    gpu       nvidia-ml-py (pynvml)

``import asyncfeed`` imports none of them.  Code that needs one calls :func:`require`
at the point of use (or at the top of a module that is itself only imported on
demand); a missing package then raises ``ModuleNotFoundError`` that says which
feature needed it and the ``pip install 'asyncfeed[extra]'`` that fixes it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "PIP_NAMES", "require"]

#: top-level import name -> the extra that installs it
EXTRAS: dict[str, str] = {
    "aiohttp": "remote",
    "botocore": "remote",
    "fsspec": "remote",
    "matplotlib": "bench",
    "psutil": "bench",
    "pynvml": "gpu",
    "s3fs": "remote",
    "spdl": "bench",
    "torchdata": "bench",
    "tqdm": "progress",
}

#: import names whose distribution on PyPI is called differently
PIP_NAMES: dict[str, str] = {"pynvml": "nvidia-ml-py", "spdl": "spdl-core"}


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Import and return ``module`` (dotted names allowed) for ``feature``.

    ``module``'s top-level package must be listed in :data:`EXTRAS`; ``extra`` names
    another extra that installs it (``"bench"`` for the benchmark's needs).  If it, or a
    package it imports, is not installed, raises ``ModuleNotFoundError`` (``name`` is
    the missing module, the original error chained) whose message reads like
    ``"reading s3:// roots needs 's3fs' (not installed): pip install 'asyncfeed[remote]'"``.
    Any other import failure propagates unchanged.  Once imported, a call costs a
    ``sys.modules`` lookup.
    """
    top = module.partition(".")[0]
    extra = extra or EXTRAS[top]  # KeyError: a bug in the caller, every optional name is listed
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or top
        what = PIP_NAMES.get(top, top)
        detail = "not installed" if missing.partition(".")[0] == top else f"missing {missing!r}"
        raise ModuleNotFoundError(
            f"{feature} needs {what!r} ({detail}): pip install 'asyncfeed[{extra}]'",
            name=missing) from e
