"""Shared fixtures: a fresh cache directory and a reset Dynamo for every test; device tiers."""

import os
import shutil

import pytest

# Child Pythons started by tests (subprocess, multiprocessing) must import the installed
# package, not the source folder in the working directory: agents/ and cache/ only become
# stitch_backend.* when installed. PYTHONSAFEPATH (Python 3.11+) is what -P sets.
os.environ["PYTHONSAFEPATH"] = "1"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine with -m gpu)")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc on PATH")
    has_gpu = _cuda_available()
    has_nvcc = shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not has_nvcc:
            item.add_marker(skip_nvcc)


@pytest.fixture(autouse=True)
def _fresh_cache_and_dynamo(tmp_path, monkeypatch):
    """Each test gets its own cache directory and a clean Dynamo state."""
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(tmp_path / "stitchcuda-cache"))
    # The eager guard would set a test's kernels aside wherever eager beats them (tiny
    # test inputs); tests/backend/test_eager_guard.py turns it on where it is the subject.
    monkeypatch.setenv("STITCHCUDA_EAGER_GUARD", "0")
    try:
        import torch._dynamo
    except ImportError:
        yield
        return
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
