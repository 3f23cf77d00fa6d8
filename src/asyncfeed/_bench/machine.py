"""The machine a benchmark ran on, for the JSON and the report header."""

from __future__ import annotations

import os
import sys
from typing import Any


def machine_info() -> dict:
    import platform

    import psutil
    info: dict[str, Any] = {
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": sys.version.split()[0],
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    versions = {}
    for mod in ("numpy", "simplejpeg", "cv2", "PIL", "torchdata", "spdl", "psutil"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent is fine, noted as such
            versions[mod] = None
    try:
        from importlib.metadata import version
        versions["spdl-core"] = version("spdl-core")
        versions["torchdata"] = version("torchdata")
    except Exception:  # noqa: BLE001
        pass
    info["versions"] = versions
    return info
