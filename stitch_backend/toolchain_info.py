"""Cheap facts about the local CUDA toolchain (for keys and ``stitchcuda doctor``)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path


def find_nvcc() -> Path | None:
    """Path of nvcc from $CUDA_HOME/bin, then PATH; None when absent."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return Path(root) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.exists() else None


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str | None:
    """nvcc's release string such as '13.0.88', or None when nvcc is absent or broken."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"V(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else None
