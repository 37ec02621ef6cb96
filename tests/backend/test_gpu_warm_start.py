"""On a GPU, issue 5's budget: a ResNet-50-sized model warm-starts from the cache in at
most 1 s of backend time, and 4 processes compiling it at once all get eager's results
while the cache ends up holding what one build leaves (each graph built once).

The budget test times the backend, so it is marked ``serial``: ``.ci/gpu`` runs it after
the parallel GPU tests, alone. Among 7 other test workers the same warm start measured
1100 and 1515 ms on the H200 (CPU contention); alone, 302 ms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

_WORKER = textwrap.dedent("""
    import json, sys, torch
    sys.path.append({root!r})  # after site-packages: the installed stitch_backend wins
    from stitch_backend.backend import StitchBackend
    from tests.zoo import ResNet50Like
    torch.manual_seed(0)
    model = ResNet50Like().cuda().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    backend = StitchBackend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        ok = torch.allclose(out, model(x), atol=1e-3, rtol=1e-3)
    print(json.dumps({{"ok": ok, "cached": [r.cached for r in backend.records],
                      "ms": [r.compile_ms for r in backend.records],
                      "kernels": [r.plan.counts()["generated"] for r in backend.records]}}))
""").format(root=str(ROOT))


def _run(n: int, cache: Path) -> list[dict]:
    env = dict(os.environ, STITCHCUDA_CACHE_DIR=str(cache), STITCHCUDA_CACHE="1")
    procs = [subprocess.Popen([sys.executable, "-P", "-c", _WORKER], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.serial
def test_resnet50_sized_model_warm_starts_within_a_second(tmp_path):
    (cold,) = _run(1, tmp_path)
    (warm,) = _run(1, tmp_path)
    print("ResNet-50-sized, backend ms cold vs warm:", cold["ms"], warm["ms"])
    assert cold["ok"] and warm["ok"]
    assert cold["cached"] == [False] and warm["cached"] == [True]
    assert warm["kernels"] == cold["kernels"]
    assert sum(warm["ms"]) <= 1000, warm["ms"]


def test_four_processes_compile_it_once(tmp_path):
    results = _run(4, tmp_path)
    assert all(r["ok"] for r in results)
    assert [r["cached"][0] for r in results].count(False) == 1, results
    from stitch_backend.cache import Store

    assert len(Store(tmp_path).ls()) == 1
