"""On a GPU: generated kernels replace regions only when verified; the cache starts warm."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from stitch_backend.backend import StitchBackend
from tests.zoo import zoo

pytestmark = pytest.mark.gpu


def _run(model, inputs, backend):
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        return compiled(*inputs)


def _flat(v):
    return [x for item in v for x in _flat(item)] if isinstance(v, (tuple, list)) else [v]


@pytest.mark.parametrize("name", ["norm_zoo", "transformer_block", "mlp", "residual_block"])
def test_generated_kernels_give_eager_results(name):
    """Verified kernels replace regions (at least the fused ones of norm_zoo and
    transformer_block); every region left on ATen says why."""
    cls, make_inputs = zoo()[name]
    torch.manual_seed(0)
    model = cls().cuda().eval()
    inputs = [x.cuda() for x in make_inputs(8)]
    backend = StitchBackend(options={"require_speedup": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        got = compiled(*inputs)        # first call: verification on real inputs
        second = compiled(*inputs)     # verified kernels installed
        want = model(*inputs)
    for g, s, w in zip(_flat(got), _flat(second), _flat(want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, w, atol=1e-4, rtol=1e-4)
    regions = [r for rec in backend.records for r in rec.plan.regions]
    kernels = [r for r in regions if r.backend == "kernel"]
    print(backend.report())
    if name in ("norm_zoo", "transformer_block"):
        assert kernels, "a model with fused regions got no verified kernel"
    for r in regions:
        assert r.backend == "kernel" or r.reason, r


def test_wrong_candidate_is_rejected_and_model_stays_correct(monkeypatch):
    from stitch_backend import kernels

    original = kernels.KernelRunner.__call__

    def wrong(self, *inputs):
        outs = original(self, *inputs)
        for o in outs:
            if o.is_floating_point():
                o.add_(0.01)
        return outs

    monkeypatch.setattr(kernels.KernelRunner, "__call__", wrong)
    cls, make_inputs = zoo()["norm_zoo"]
    torch.manual_seed(0)
    model = cls().cuda().eval()
    inputs = [x.cuda() for x in make_inputs(4)]
    backend = StitchBackend(options={"require_speedup": False, "cache": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    regions = [r for rec in backend.records for r in rec.plan.regions]
    rejected = [r for r in regions if r.reason and "wrong result" in r.reason]
    assert rejected and not any(r.backend == "kernel" for r in regions)


def test_warm_start_in_a_second_process(tmp_path):
    script = textwrap.dedent("""
        import json, sys, time, torch
        sys.path.append(%r)  # after site-packages: the installed stitch_backend wins
        from stitch_backend.backend import StitchBackend
        from tests.zoo import NormZoo
        torch.manual_seed(0)
        model = NormZoo().cuda().eval()
        x = torch.randn(8, 8, 6, 6, device="cuda")
        backend = StitchBackend(options={"require_speedup": False})
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x)
            ok = torch.allclose(out, model(x), atol=1e-4, rtol=1e-4)
        rec = backend.records[0]
        print(json.dumps({"cached": rec.cached, "ms": rec.compile_ms, "ok": ok,
                          "kernels": sum(r.backend == "kernel" for r in rec.plan.regions)}))
    """ % str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    env = dict(__import__("os").environ, STITCHCUDA_CACHE_DIR=str(tmp_path / "cache"))
    import json
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-P", "-c", script], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(runs)
    assert runs[0]["ok"] and runs[1]["ok"]
    assert not runs[0]["cached"] and runs[1]["cached"]
    assert runs[1]["kernels"] == runs[0]["kernels"]
    assert runs[1]["ms"] < 1000


def _replay_timed_faster(monkeypatch) -> None:
    """The first replay's timing check scripted: replayed 1 ms, uncaptured 2 ms (each
    timed function still runs once)."""
    from stitch_backend import cudagraphs

    times = iter([1.0, 2.0])

    def scripted(fn, runs=5):
        fn()
        return next(times, 2.0)
    monkeypatch.setattr(cudagraphs, "wall_ms", scripted)


def test_replayed_outputs_are_never_overwritten(monkeypatch):
    """Calls 1-2 run uncaptured (verification, warm-up); from call 3 the Program is one
    CUDA graph. Every output the user keeps stays what eager computes for its input.

    Whether replay stays on is a timing decision (this tiny block once measured 0.568 ms
    replayed vs 0.566 ms uncaptured, and replay went off): scripted here, since the
    subject is the outputs of replays."""
    _replay_timed_faster(monkeypatch)
    torch.manual_seed(0)
    model = zoo()["transformer_block"][0]().cuda().eval()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    xs = [torch.randn(4, 8, 32, device="cuda") for _ in range(6)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
        for x, y in zip(xs, outs):
            torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
    assert not torch.equal(outs[-1], outs[-2])
    (rec,) = backend.records
    assert any(n.startswith("CUDA graph replay on") for n in rec.notes), rec.notes
    assert not any("replay off" in n for n in rec.notes), rec.notes
    program_replay = [n for n in rec.notes if "off" in n]
    assert not program_replay


def test_graphs_with_random_ops_are_replayed_and_draw_eagers_numbers(monkeypatch):
    """Dropout and rand_like in a captured graph: each call of a seeded run, replays
    included, draws what eager draws at that point, and the generator ends where eager's
    calls leave it (the capture's and checks' extra runs are undone).

    Whether replay stays on is a timing decision (in the 8-process GPU suite this tiny
    graph once measured 2.742 ms replayed vs 2.548 uncaptured, and replay went off):
    scripted here, as in the test above, since the subject is the replays' draws."""
    from tests.zoo import DropoutModel

    _replay_timed_faster(monkeypatch)

    torch.manual_seed(0)
    model = DropoutModel().cuda().train()
    backend = StitchBackend(options={"eager_guard": False})
    compiled = torch.compile(model, backend=backend)
    xs = [torch.randn(4, 32, device="cuda") for _ in range(6)]
    with torch.no_grad():
        torch.cuda.manual_seed(1)
        expected = [model(x) for x in xs]
        after_eager = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(1)
        got = [compiled(x).clone() for x in xs]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cuda.get_rng_state(), after_eager)
    (rec,) = backend.records
    assert any(n.startswith("CUDA graph replay on") for n in rec.notes), rec.notes
    assert not any("replay off" in n for n in rec.notes), rec.notes
    assert rec.program.replay.checked and rec.program.replay.graph is not None


def test_a_gather_out_of_range_fails_loudly_as_eager_does():
    """Cross entropy's gather runs in a generated kernel with eager's values; a target
    outside the classes makes the call fail with a CUDA error (the kernel's bounds check
    traps, as ATen's kernels assert), never a silent value. In a subprocess: the error
    is sticky for the process's CUDA context."""
    script = textwrap.dedent("""
        import json, sys, torch
        import torch.nn.functional as F
        sys.path.append(%r)
        from stitch_backend.backend import StitchBackend
        backend = StitchBackend(options={"require_speedup": False, "eager_guard": False})
        loss = torch.compile(lambda a, t: F.cross_entropy(a, t), backend=backend)
        a = torch.randn(64, 100, device="cuda")
        t = torch.randint(0, 100, (64,), device="cuda")
        with torch.no_grad():
            got = [loss(a, t) for _ in range(4)]
        ok = all(torch.allclose(g, F.cross_entropy(a, t), atol=1e-5, rtol=1e-5) for g in got)
        regions = [r for rec in backend.records for r in rec.plan.regions]
        gather = [r.backend for r in regions if "aten.gather.default" in r.ops]
        print(json.dumps({"ok": ok, "gather": gather}), flush=True)
        bad = t.clone()
        bad[5] = 100
        with torch.no_grad():
            value = loss(a, bad)
        torch.cuda.synchronize()
        print("NO ERROR", float(value), flush=True)
    """ % str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    import json
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True)
    first = json.loads(proc.stdout.strip().splitlines()[0])
    assert first == {"ok": True, "gather": ["kernel"]}, (first, proc.stderr[-2000:])
    assert proc.returncode != 0 and "NO ERROR" not in proc.stdout, proc.stdout
    assert "CUDA" in proc.stderr or "cuda" in proc.stderr, proc.stderr[-2000:]


def test_a_cpu_scalar_constant_runs_inside_a_generated_kernel():
    """``torch.min(x, torch.tensor(0.5))`` on a CUDA ``x``: the CPU constant is inlined,
    so the region (tanh, minimum, mul) runs as one verified kernel, not on ATen."""
    class ClampMin(torch.nn.Module):
        def forward(self, x):
            return torch.min(torch.tanh(x), torch.tensor(0.5)) * 3.0

    x = torch.randn(256, 1000, device="cuda")
    backend = StitchBackend(options={"require_speedup": False, "eager_guard": False})
    got = [_run(ClampMin(), [x], backend) for _ in range(2)]
    for g in got:
        torch.testing.assert_close(g, ClampMin()(x))
    regions = [r for rec in backend.records for r in rec.plan.regions if r.ops]
    assert any("aten.minimum.default" in r.ops for r in regions)
    assert all(r.backend == "kernel" for r in regions), [r.reason for r in regions]


def test_a_parameter_given_new_storage_is_read_from_there(monkeypatch):
    """``param.data = ...`` keeps the Parameter (Dynamo's guards pass) but moves its
    memory: the replay must not read the old storage (it recaptures)."""
    from stitch_backend import cudagraphs

    monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn, runs=5: (fn(), 1.0)[1])
    torch.manual_seed(0)
    model = zoo()["mlp"][0]().cuda().eval()
    backend = StitchBackend(options={"cache": False})
    compiled = torch.compile(model, backend=backend)
    x = zoo()["mlp"][1](2)[0].cuda()
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        param = next(model.parameters())
        param.data = param.data * 2.0 + 0.5
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    (rec,) = backend.records
    assert any(n.startswith("CUDA graph replay on") for n in rec.notes), rec.notes
    assert not any("replay off" in n for n in rec.notes), rec.notes
    assert rec.program.replay.captures == 2


class _DeconvSoftmax(torch.nn.Module):
    """KernelBench L2 91's shape, smaller: a softmax over a transposed convolution's
    channels, then a pointwise tail (channels-last: the rows are read along C and
    written NCHW, so the column and staged layouts are raced)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.ConvTranspose2d(16, 64, 4, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return torch.sigmoid(torch.softmax(self.conv(x), 1) * 2.0)


class _ConvGeluPool(torch.nn.Module):
    """KernelBench L2 67's shape, smaller: a global average pool after conv + GELU."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 32, 3)

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(
            torch.nn.functional.gelu(self.conv(x)), 1).flatten(1)


@pytest.mark.parametrize("name", ["deconv_softmax", "conv_gelu_pool"])
def test_channel_softmax_and_global_pool_regions_give_eager_results(name):
    """The staged-layout alternative is compiled beside the inner and column kernels and
    whichever is kept gives eager's values; a global pool runs in the convolution's
    epilogue kernel, correct by DESIGN.md's rule against eager and fp64."""
    from stitch_backend.correctness import compare

    torch.manual_seed(0)
    model, x = ((_DeconvSoftmax(), torch.randn(8, 16, 24, 24)) if name == "deconv_softmax"
                else (_ConvGeluPool(), torch.randn(8, 8, 40, 40)))
    model, x = model.cuda(), x.cuda()
    backend = StitchBackend(options={"require_speedup": False, "cache": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(x)
        got = compiled(x)
        want = model(x)
        ref = model.double()(x.double())
    cmp = compare(got, want, ref)
    assert cmp.ok_design, cmp.reason
    (rec,) = backend.records
    if name == "conv_gelu_pool":
        (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
        assert "aten.mean.dim" in conv.ops and conv.backend == "kernel", (conv.ops, conv.reason)
