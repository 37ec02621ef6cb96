"""Fixtures for the artifact-store tests: a store in a fresh folder and key factories."""

from __future__ import annotations

from pathlib import Path

import pytest

from stitch_backend.cache import CacheKey, Store


def make_key(n: int = 0, **overrides) -> CacheKey:
    """A distinct, realistic key per ``n``."""
    fields = dict(
        graph=(f"graph():\n  %x : [num_users=1] = placeholder[target=x]\n"
               f"  %relu_{n} = aten.relu(%x)"),
        input_metas=[{"shape": [8, 16], "stride": [16, 1], "dtype": "float32"}],
        options={"mode": "default", "allow_tf32": False},
        arch="sm_90a",
        versions={"torch": "2.11.0", "cuda": "12.8", "nvcc": "13.0", "stitchcuda": "0.1.0"},
    )
    fields.update(overrides)
    return CacheKey(**fields)


def sample_artifacts(n: int = 0, size: int = 64) -> dict[str, bytes]:
    return {
        f"region{n}.cubin": bytes((i * 7 + n) % 256 for i in range(size)),
        f"region{n}.cu": f"// region {n}: relu\n__global__ void k{n}() {{}}\n".encode(),
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def store(root: Path) -> Store:
    return Store(root)


@pytest.fixture(name="make_key")
def _make_key_fixture():
    """The ``make_key`` factory (a fixture, so test modules need not import conftest)."""
    return make_key


@pytest.fixture(name="artifacts")
def _artifacts_fixture():
    """The ``sample_artifacts`` factory."""
    return sample_artifacts
