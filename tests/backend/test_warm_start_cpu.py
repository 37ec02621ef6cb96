"""The artifact cache around the whole pipeline, on the CPU (cpu_interpret mode):
a second compile starts warm, a broken entry is rebuilt, processes build a graph once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from stitch_backend.backend import StitchBackend
from stitch_backend.cache import Store
from tests.zoo import zoo

OPTIONS = {"cpu_interpret": True, "require_speedup": False}
ROOT = Path(__file__).resolve().parents[2]


def _compile_and_run(model, x):
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        first = compiled(x)
        second = compiled(x)
    return backend, first, second


def test_second_compile_loads_from_cache():
    torch.manual_seed(0)
    model = zoo()["transformer_block"][0]().eval()
    x = torch.randn(2, 8, 32)
    cold, _, _ = _compile_and_run(model, x)
    assert not any(r.cached for r in cold.records)
    assert len(Store().ls()) == len(cold.records)
    # the first call's verification is timed, in the records and the report
    assert all(r.program.verify_s > 0 and r.to_dict()["verify_s"] > 0 for r in cold.records)
    assert cold.report().count("; verified in ") == len(cold.records)
    torch._dynamo.reset()
    warm, first, second = _compile_and_run(model, x)
    assert all(r.cached for r in warm.records)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(first, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, want, atol=1e-5, rtol=1e-5)
    kernels = lambda b: [(r.id, r.kernel) for rec in b.records for r in rec.plan.regions
                         if r.backend == "kernel"]
    assert kernels(warm) == kernels(cold) and kernels(warm)
    # No candidate was proposed, compiled or verified on the warm start.
    assert not warm.trajectories


def test_corrupt_entry_is_rebuilt_with_a_warning(caplog):
    torch.manual_seed(0)
    model = zoo()["norm_zoo"][0]().eval()
    x = torch.randn(2, 8, 6, 6)
    _compile_and_run(model, x)
    (info,) = Store().ls()
    source = next(p for p in info.path.iterdir() if p.suffix == ".cu")
    source.write_bytes(source.read_bytes()[:-20])  # truncated
    torch._dynamo.reset()
    backend, first, second = _compile_and_run(model, x)
    assert not backend.records[0].cached
    assert any("corrupt" in r.getMessage().lower() or "checksum" in r.getMessage().lower()
               for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(second, model(x), atol=1e-5, rtol=1e-5)
    assert len(Store().ls()) == 1  # rebuilt and stored again
    assert not Store().verify()


_WORKER = textwrap.dedent("""
    import json, sys, time, torch
    sys.path.append({root!r})
    from stitch_backend.backend import StitchBackend
    from tests.zoo import zoo
    torch.manual_seed(0)
    model = zoo()["transformer_block"][0]().eval()
    x = torch.randn(2, 8, 32)
    backend = StitchBackend(options={{"cpu_interpret": True, "require_speedup": False}})
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        ok = torch.allclose(out, model(x), atol=1e-5, rtol=1e-5)
    print(json.dumps({{"ok": ok, "cached": [r.cached for r in backend.records],
                      "ms": [r.compile_ms for r in backend.records]}}))
""")


def _start_workers(n, env):
    script = _WORKER.format(root=str(ROOT))
    return [subprocess.Popen([sys.executable, "-P", "-c", script], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(n)]


def _results(procs):
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_warm_start_in_a_new_process():
    env = dict(os.environ)
    (cold,) = _results(_start_workers(1, env))
    (warm,) = _results(_start_workers(1, env))
    assert cold["ok"] and warm["ok"]
    assert cold["cached"] == [False] and warm["cached"] == [True]
    print("backend compile ms, cold vs warm:", cold["ms"], warm["ms"])


def test_four_processes_build_each_graph_once():
    results = _results(_start_workers(4, dict(os.environ)))
    assert all(r["ok"] for r in results)
    cached = [r["cached"][0] for r in results]
    assert cached.count(False) == 1, cached  # one built it; three waited and loaded it
    assert len(Store().ls()) == 1


def test_an_entry_that_does_not_fit_says_why_in_the_notes():
    """A cache entry refused on warm start is not silent: the reason reaches the report."""
    from types import SimpleNamespace

    from stitch_backend import artifacts
    from stitch_backend.agents.planner import partition
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: (torch.relu(x) * 2,))(torch.randn(4))
    plan = partition(gm, graph_name="g")
    notes: list[str] = []
    entry = SimpleNamespace(key="ab" * 32, manifest={"plan": "not a plan"})
    assert artifacts.warm_start(entry, gm, plan, task_graph="sc_x", sm_count=132,
                                notes=notes) is None
    assert len(notes) == 1 and notes[0].startswith(f"cache entry {'ab' * 6} has no readable plan")
    other = partition(make_fx(lambda x: (torch.relu(x), x.sum()))(torch.randn(4)), graph_name="h")
    entry.manifest = {"plan": other.to_json()}
    assert artifacts.warm_start(entry, gm, plan, task_graph="sc_x", sm_count=132,
                                notes=notes) is None
    assert notes[1] == f"cache entry {'ab' * 6} was planned differently; rebuilding"
