"""The split-statistics alternative for training BatchNorm over few channels and layer
norm over few rows: where it applies, that every stage is a generated kernel, and that
it computes the region's outputs (kernel IR interpreter on CPU), inside the whole
pipeline too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.fx.interpreter import Interpreter

from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.split_stats import groups_for, groups_for_columns
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module


class ConvBN(nn.Module):
    def __init__(self, c_in=3, c=8):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class ConvMishBN(ConvBN):
    """A BatchNorm whose input is computed by a longer chain: bias add, view, Mish's ops
    (KernelBench L2 52's shape, smaller)."""

    def forward(self, x):
        x = self.conv(x)
        return self.bn(torch.tanh(torch.nn.functional.softplus(x)) * x)


class Conv3dBN(nn.Module):
    def __init__(self, c_in=3, c=8):
        super().__init__()
        self.conv = nn.Conv3d(c_in, c, 3, padding=1)
        self.bn = nn.BatchNorm3d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class FewRowsLayerNorm(nn.Module):
    """A layer norm over the last three dims of a (2, 8, 32, 32) input: 2 rows of 8192
    (L1 40's shape, smaller), then an activation that joins the normalising stage."""

    def __init__(self, shape=(8, 32, 32), affine=True):
        super().__init__()
        self.ln = nn.LayerNorm(shape, elementwise_affine=affine)

    def forward(self, x):
        return torch.nn.functional.gelu(self.ln(x * 2.0))


class BNOnly(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(x)) * 2.0


def test_groups_give_every_sm_rows_of_real_length():
    assert groups_for(64, 224 * 224, 132) == 8      # 512 rows of 6272
    assert groups_for(8, 64 * 64, 132) == 8         # 64 rows of 512
    assert groups_for(256, 56 * 56, 132) is None    # channels alone fill the GPU
    assert groups_for(64, 7 * 7, 132) is None       # too short to split
    assert groups_for(16, 3 * 1000, 132) is None or 3000 % groups_for(16, 3000, 132) == 0


def test_channels_last_groups_give_two_blocks_of_32_channels_per_sm():
    assert groups_for_columns(64, 10 * 224 * 224, 132) == 128  # 8192 rows, 256 blocks of 32
    assert groups_for_columns(128, 8 * 112 * 112, 132) == 64   # the same 8192 rows
    assert groups_for_columns(64, 10 * 56 * 56, 132) == 64     # stops at partials of 490
    assert groups_for_columns(16, 64 * 8 * 8, 132) == 16       # stops at partials of 256
    assert groups_for_columns(2048, 10 * 56 * 56, 132) == 4    # 8192 rows again
    assert groups_for_columns(4096, 10 * 7 * 7, 132) is None   # channels alone fill it
    assert groups_for_columns(64, 2 * 7 * 7, 132) is None      # too short to split


def _graph(model, x, channels_last=False):
    # cpu_interpret turns on the channels-last pass (as on CUDA); codegen=False plans only
    backend = StitchBackend(options={"codegen": False, "cpu_interpret": channels_last,
                                     "channels_last": channels_last})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    return rec


def _split_verdicts(backend) -> dict[str, bool]:
    """Each verified split alternative's name and whether it passed."""
    return {a.candidate.name: a.verdict.ok for t in backend.trajectories for a in t.attempts
            if a.action == "verify" and "_split" in a.candidate.name}


def _assert_compile_for_sm90a(alts) -> None:
    """Every candidate in ``alts`` (all its stages' kernels) compiles to a cubin."""
    from stitch_backend.toolchain import CompileJob, compile_many, csrc_dir

    results = compile_many([CompileJob(source=alt.source, name=alt.name, arch="sm_90a",
                                       include_dirs=(csrc_dir(),)) for alt in alts])
    assert len(results) == len(alts)
    for result in results:
        assert not isinstance(result, Exception), result
        assert result.cubin[:4] == b"\x7fELF"


def _values(gm):
    """Every node's value on random placeholder values (positive variances)."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = ph.meta["val"]
        args.append(torch.rand(v.shape, generator=gen) + 0.5 if v.is_floating_point()
                    else torch.zeros(v.shape, dtype=v.dtype))
    env = {}

    class Recorder(Interpreter):
        def run_node(self, n):
            env[n.name] = super().run_node(n)
            return env[n.name]

    Recorder(gm).run(*args)
    return env


@pytest.mark.parametrize("model,shape", [(ConvBN(), (2, 3, 64, 64)), (BNOnly(), (2, 8, 64, 64)),
                                         (ConvMishBN(), (2, 3, 64, 64)),
                                         (Conv3dBN(), (2, 3, 8, 16, 16))],
                         ids=["conv_epilogue", "fused_region", "activation_chain", "conv3d"])
def test_split_candidate_matches_the_region(model, shape):
    rec = _graph(model.train(), torch.randn(shape))
    env = _values(rec.gm)
    found = 0
    for region in rec.plan.regions:
        if "_native_batch_norm_legit_functional" not in " ".join(region.nodes):
            continue
        cand = TemplateCoder(split_stats=True).propose(subtask_for(rec.gm, region, "k"))
        two_pass, single_pass = cand.alternatives
        assert two_pass.name.endswith("_split") and single_pass.name.endswith("_split1p")
        inputs = [env[n] for n in region.inputs]
        want = region_module(rec.gm, region)(*inputs)
        for alt, n_kernels in ((two_pass, 5), (single_pass, 3)):
            kernels = [s for s in alt.stages if s.kernel is not None]
            assert len(kernels) == n_kernels, [s.region.nodes for s in alt.stages]
            got = runner_for(alt, base=InterpretedRunner)(*inputs)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        found += 1
        assert not TemplateCoder(split_stats=False).propose(
            subtask_for(rec.gm, region, "k")).alternatives
    assert found == 1


@pytest.fixture(autouse=True)
def both_split_forms(monkeypatch):
    """This module tests both forms of split statistics; by default the Coder proposes
    the two-pass one only where the single-pass one does not generate (the test below)."""
    monkeypatch.setattr(TemplateCoder, "two_pass_splits", True)


def test_by_default_only_the_single_pass_split_is_proposed(monkeypatch):
    """The single-pass split alone, and no narrow launch of the template's column kernel
    beside it (both lost to it on an H100 wherever they raced it)."""
    monkeypatch.setattr(TemplateCoder, "two_pass_splits", False)
    rec = _graph(ConvBN(c=16).train(), torch.randn(8, 3, 32, 32), channels_last=True)
    region = next(r for r in rec.plan.regions if r.kind.value == "conv")
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    assert sorted(a.name for a in alts) == ["k_sc", "k_sc_split1p", "k_split1p"], alts
    monkeypatch.setattr(TemplateCoder, "two_pass_splits", True)
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    assert sorted(a.name for a in alts) == ["k_sc", "k_sc_split", "k_sc_split1p", "k_split",
                                            "k_split1p"], alts


def test_channels_last_batchnorm_is_split_without_the_option():
    rec = _graph(ConvBN(c=16).train(), torch.randn(8, 3, 32, 32), channels_last=True)
    env = _values(rec.gm)
    region = next(r for r in rec.plan.regions if r.kind.value == "conv")
    assert env[region.nodes[0]].is_contiguous(memory_format=torch.channels_last)
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    kernels = {a.name: len([s for s in a.stages if s.kernel is not None]) for a in alts}
    # after cuDNN's convolution, and after the generated one of 3 input channels (_sc);
    # the conversion back to NCHW is the template's third kernel, in the splits' last;
    # 16 channels, but no narrow launch of the template's column kernel: the statistics split
    assert kernels == {"k_split": 5, "k_split1p": 3, "k_sc": 3, "k_sc_split": 6,
                       "k_sc_split1p": 4}, kernels
    inputs = [env[n] for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    for alt in alts:
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert g.stride() == w.stride()


def test_channels_last_3d_batchnorm_is_split():
    rec = _graph(Conv3dBN(c=16).train(), torch.randn(4, 3, 8, 16, 16), channels_last=True)
    env = _values(rec.gm)
    region = next(r for r in rec.plan.regions if r.kind.value == "conv")
    assert env[region.nodes[0]].is_contiguous(memory_format=torch.channels_last_3d)
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    names = {a.name for a in alts}
    assert {"k_split", "k_split1p"} <= names, names
    inputs = [env[n] for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    for alt in alts:
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert g.stride() == w.stride()


def test_single_pass_variance_holds_for_a_mean_far_from_the_spread():
    """Values around 1000 with spread 0.01: E[x^2] - E[x]^2 in fp32 would lose every
    digit; shifted by the channel's first element, the variance keeps eager's accuracy
    (judged against an fp64 run, as DESIGN.md's rule does)."""
    from stitch_backend.agents.split_stats import split_norms

    rec = _graph(BNOnly().train(), torch.randn(2, 8, 64, 64))
    region = next(r for r in rec.plan.regions
                  if "_native_batch_norm_legit_functional" in " ".join(r.nodes))
    module = region_module(rec.gm, region)
    split = split_norms(module, 132, single_pass=True)
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for ph in module.graph.find_nodes(op="placeholder"):
        v = ph.meta["val"]
        if v.dim() == 4:
            inputs.append(1000.0 + 0.01 * torch.randn(v.shape, generator=gen))
        else:
            inputs.append(torch.rand(v.shape, generator=gen) + 0.5)
    got = split.module(*inputs)
    want = module(*inputs)
    exact = module(*[t.double() for t in inputs])
    for g, w, e in zip(got, want, exact):
        err, eager_err = (g.double() - e).abs().max(), (w.double() - e).abs().max()
        assert err <= 2 * eager_err + 1e-6 * e.abs().max(), (err, eager_err)


def test_wide_or_small_batchnorm_gets_no_split():
    rec = _graph(ConvBN(c=256).train(), torch.randn(1, 3, 16, 16))
    for region in rec.plan.regions:
        try:
            cand = TemplateCoder(split_stats=True).propose(subtask_for(rec.gm, region, "k"))
        except Exception:  # noqa: BLE001 - regions without a template candidate
            continue
        assert not cand.alternatives


def test_pipeline_with_split_stats_gives_eager_results():
    torch.manual_seed(0)
    model = ConvBN().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "split_stats": True, "cache": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)
    assert backend.records[0].plan.counts()["generated"] >= 1
    verified = [a for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_split")]
    assert verified and all(a.verdict.ok for a in verified), [a.verdict for a in verified]
    # the race is told in the notes: which kernel was kept, and how each other one fared
    # (untimed on the CPU: the first correct one is kept)
    raced = [n for n in backend.records[0].notes if " kept (" in n]
    assert raced and all("_split correct, untimed" in n for n in raced), raced


@pytest.mark.nvcc
def test_split_candidate_compiles_for_sm90a():
    rec = _graph(ConvBN().train(), torch.randn(2, 3, 64, 64))
    region = next(r for r in rec.plan.regions if r.kind.value == "conv")
    alts = TemplateCoder(split_stats=True).propose(subtask_for(rec.gm, region, "k")).alternatives
    assert len(alts) == 2
    _assert_compile_for_sm90a(alts)


def test_an_alternative_that_does_not_compile_is_reported(monkeypatch):
    """The template's own candidate still races; the graph's notes say what was dropped."""
    from stitch_backend import config as config_mod
    from stitch_backend import toolchain
    from stitch_backend.agents.loop import implement
    from stitch_backend.agents.state import Task

    rec = _graph(ConvBN().train(), torch.randn(2, 3, 64, 64))
    seen = []

    def fake_compile_many(jobs, max_workers=None, on_done=None):
        # proposals first, then the alternatives (ConvBN has one training BatchNorm: its
        # two-pass and single-pass splits); the single-pass one, last, fails
        seen.extend(jobs)
        return [toolchain.CompiledKernel(job.name, job.arch, b"\x7fELF", "", 0.25 * (i + 1),
                                         ["nvcc"]) for i, job in enumerate(jobs[:-1])] + [
            toolchain.CompileError(["nvcc"], "error: broken", None)]

    monkeypatch.setattr(toolchain, "compile_many", fake_compile_many)
    cfg = config_mod.Config(split_stats=True)
    impl = implement(Task("g", "k", "sm_90a", "cuda"), rec.gm, rec.plan, arch="sm_90a",
                     config=cfg)
    (note,) = impl.notes
    assert note.startswith("alternative ") and "_split1p does not compile" in note, note
    left = [a.name for c in impl.candidates.values() for a in c.alternatives]
    assert len(left) == 1 and left[0].endswith("_split"), left
    # the report counts every kernel compiled, the two alternatives included, and sums
    # the compiler's own times of those that compiled (0.25 s, 0.5 s, ...)
    own = len(seen) - 2
    done = [0.25 * (i + 1) for i in range(len(seen) - 1)]
    assert impl.compile_note().startswith(
        f"{len(seen)} kernel(s) ({own} candidate(s), 2 alternative(s)) compiled in "), impl.compile_note()
    assert impl.compile_note().endswith(
        f"the compiler's own times sum to {sum(done):.2f} s, the longest {max(done):.2f} s")


def _layer_norm_region(rec):
    return next(r for r in rec.plan.regions if "native_layer_norm" in " ".join(r.nodes))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_layer_norm_over_few_rows_is_split_and_matches_the_region(affine):
    """Both alternatives (five and three kernels) give the region's outputs, the mean and
    1/std included, in the shapes eager gives them."""
    rec = _graph(FewRowsLayerNorm(affine=affine).train(), torch.randn(2, 8, 32, 32))
    region = _layer_norm_region(rec)
    env = _values(rec.gm)
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    assert [a.name for a in alts] == ["k_split", "k_split1p"]
    inputs = [env[n] for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    for alt, n_kernels in zip(alts, (5, 3)):
        assert len([s for s in alt.stages if s.kernel is not None]) == n_kernels
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_layer_norm_over_rows_enough_or_short_gets_no_split():
    from stitch_backend.agents.split_stats import split_norms

    for shape, x in (((64,), torch.randn(512, 64)),          # rows fill the GPU
                     ((256,), torch.randn(4, 256))):         # too short to split
        rec = _graph(FewRowsLayerNorm(shape).train(), x)
        region = _layer_norm_region(rec)
        assert split_norms(region_module(rec.gm, region), 132) is None, shape
    rec = _graph(FewRowsLayerNorm().train(), torch.randn(2, 8, 32, 32))
    module = region_module(rec.gm, _layer_norm_region(rec))
    assert split_norms(module, 132, contiguous=False) is None   # the option off


def test_single_pass_layer_norm_holds_for_a_mean_far_from_the_spread():
    """Rows around 1000 with spread 0.01, shifted by each row's first element: as close
    to an fp64 run as eager's layer norm."""
    from stitch_backend.agents.split_stats import split_norms

    rec = _graph(FewRowsLayerNorm(affine=False).train(), torch.randn(2, 8, 32, 32))
    module = region_module(rec.gm, _layer_norm_region(rec))
    split = split_norms(module, 132, single_pass=True)
    x = 500.0 + 0.005 * torch.randn(2, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    inputs = [x if ph.meta["val"].dim() == 4 else torch.ones(ph.meta["val"].shape)
              for ph in module.graph.find_nodes(op="placeholder")]
    got, want = split.module(*inputs), module(*inputs)
    exact = module(*[t.double() for t in inputs])
    for g, w, e in zip(got, want, exact):
        err, eager_err = (g.double() - e).abs().max(), (w.double() - e).abs().max()
        assert err <= 2 * eager_err + 1e-6 * e.abs().max(), (err, eager_err)


def test_pipeline_with_a_split_layer_norm_gives_eager_results():
    torch.manual_seed(0)
    model = FewRowsLayerNorm().train()
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "cache": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 8, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    verified = _split_verdicts(backend)
    assert verified and all(verified.values()), verified


@pytest.mark.nvcc
def test_layer_norm_split_compiles_for_sm90a():
    rec = _graph(FewRowsLayerNorm().train(), torch.randn(2, 8, 32, 32))
    alts = TemplateCoder().propose(subtask_for(rec.gm, _layer_norm_region(rec), "k")).alternatives
    _assert_compile_for_sm90a(alts)


@pytest.mark.gpu
def test_layer_norm_split_verifies_on_the_gpu():
    """Each split alternative passes the Verifier on the GPU (its kernels run on real
    inputs against eager), and the compiled model gives eager's result."""
    torch.manual_seed(0)
    model = FewRowsLayerNorm((64, 64, 64)).cuda().train()
    backend = StitchBackend(options={"cache": False, "require_speedup": False})
    x = torch.randn(4, 64, 64, 64, device="cuda")
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    verified = _split_verdicts(backend)
    assert len(verified) == 2 and all(verified.values()), verified


@pytest.mark.gpu
@pytest.mark.parametrize("make,shape", [(lambda: ConvMishBN(c=128), (8, 3, 64, 64)),
                                        (lambda: Conv3dBN(c=32), (4, 3, 16, 32, 32))],
                         ids=["activation_chain", "conv3d"])
def test_channels_last_splits_verify_on_the_gpu(make, shape):
    """The splits of a BatchNorm after a long activation chain and of a 3-D one pass the
    Verifier on the GPU, and the compiled model gives eager's result."""
    torch.manual_seed(0)
    model = make().cuda().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cache": False, "require_speedup": False,
                                     "channels_last": True})
    x = torch.randn(shape, device="cuda")
    # cuDNN's TF32 off: its NHWC and NCHW kernels then agree to fp32 rounding
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-4)
    verified = _split_verdicts(backend)
    assert verified and all(verified.values()), verified


class Conv3dGroupNormMean(nn.Module):
    """KernelBench L2 27's shape, smaller: conv, hardswish, group norm, mean over the
    positions (``reduce``) or the group norm returned (``reduce=False``)."""

    def __init__(self, c=8, groups=4, reduce=True):
        super().__init__()
        self.conv = nn.Conv3d(3, c, 3)
        self.gn = nn.GroupNorm(groups, c)
        self.reduce = reduce

    def forward(self, x):
        x = self.gn(torch.nn.functional.hardswish(self.conv(x)))
        return x.mean(dim=[2, 3, 4]) if self.reduce else x


class Conv3dInstanceNormMax(nn.Module):
    """KernelBench L2 79's shape, smaller: conv, scale, instance norm, clamp, scale, max
    over the channels."""

    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv3d(3, c, 3)
        self.scale = nn.Parameter(torch.rand(c, 1, 1, 1) + 0.5)
        self.norm = nn.InstanceNorm3d(c)

    def forward(self, x):
        x = self.norm(self.conv(x) * self.scale).clamp(-1.0, 1.0) * self.scale
        return x.max(dim=1)[0]


def _group_norm_region(rec):
    return _norm_region(rec, "native_group_norm")


def _norm_region(rec, op: str):
    return next(r for r in rec.plan.regions if op in " ".join(r.nodes))


@pytest.mark.parametrize("make,shape,op", [
    (lambda: Conv3dGroupNormMean(), (40, 3, 6, 10, 10), "native_group_norm"),
    (lambda: Conv3dGroupNormMean(reduce=False), (2, 3, 10, 18, 18), "native_group_norm"),
    (lambda: Conv3dInstanceNormMax(), (20, 3, 10, 10, 18), "_native_batch_norm_legit"),
], ids=["group_norm_rows_enough", "group_norm_few_rows", "instance_norm_rows_enough"])
def test_row_norm_is_split_and_matches_the_region(make, shape, op):
    """A group norm whose output is only reduced further (160 rows of 512: enough for
    the SMs, so its statistics are summed whole and the mean's kernel normalises), one
    over 8 rows of 4096 whose output is stored (summed in parts), and an instance norm
    of 160 channels of 1024 only reduced further (a max over the channels): both alternatives
    give the region's outputs, the mean and 1/std included."""
    rec = _graph(make().train(), torch.randn(shape))
    region = _norm_region(rec, op)
    env = _values(rec.gm)
    alts = TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives
    names = [a.name for a in alts]
    assert "k_split" in names and "k_split1p" in names, names
    inputs = [env[n] for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    for alt in (a for a in alts if "split" in a.name):
        kernels = [s.kernel for s in alt.stages if s.kernel is not None]
        assert len(kernels) == len(alt.stages), alt.name        # every stage generated
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_group_norm_with_rows_enough_and_a_stored_output_gets_no_split():
    """160 rows fill the SMs, and the normalised value is an output: the one-kernel
    template writes it anyway, so there is nothing to recompute."""
    from stitch_backend.agents.split_stats import split_norms

    rec = _graph(Conv3dGroupNormMean(reduce=False).train(), torch.randn(40, 3, 6, 10, 10))
    module = region_module(rec.gm, _group_norm_region(rec))
    assert split_norms(module, 132) is None
    rec = _graph(Conv3dGroupNormMean().train(), torch.randn(40, 3, 6, 10, 10))
    module = region_module(rec.gm, _group_norm_region(rec))
    assert split_norms(module, 132) is not None
    assert split_norms(module, 132, contiguous=False) is None   # the option off


# (model, input shape, the norm's node name) of the only-reduced splits, small for CPU
ONLY_REDUCED = [(lambda: Conv3dGroupNormMean(), (40, 3, 6, 10, 10), "native_group_norm"),
                (lambda: Conv3dInstanceNormMax(), (20, 3, 10, 10, 18), "_native_batch_norm_legit")]
ONLY_REDUCED_IDS = ["group_norm_mean", "instance_norm_max"]


@pytest.mark.parametrize("make,shape,op", ONLY_REDUCED, ids=ONLY_REDUCED_IDS)
def test_pipeline_with_a_split_row_norm_gives_eager_results(make, shape, op):
    torch.manual_seed(0)
    model = make().train()
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "cache": False, "channels_last": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    verified = _split_verdicts(backend)
    assert verified and all(verified.values()), verified


@pytest.mark.nvcc
@pytest.mark.parametrize("make,shape,op", ONLY_REDUCED, ids=ONLY_REDUCED_IDS)
def test_row_norm_split_compiles_for_sm90a(make, shape, op):
    """Every kernel of both split alternatives (statistics stages and the reduction's
    normalising stage) compiles for the H200, and so do their lean launches' (the
    instance norm's max over 18 columns: ``launch_alternatives.lean_columns``)."""
    rec = _graph(make().train(), torch.randn(shape))
    alts = [a for a in TemplateCoder().propose(
        subtask_for(rec.gm, _norm_region(rec, op), "k")).alternatives if "split" in a.name]
    assert len([a for a in alts if not a.name.endswith("_ln")]) == 2
    _assert_compile_for_sm90a(alts)


@pytest.mark.gpu
@pytest.mark.parametrize("make,shape", [(lambda: Conv3dGroupNormMean(c=16), (256, 3, 10, 18, 18)),
                                        (lambda: Conv3dInstanceNormMax(c=16), (64, 3, 10, 18, 18))],
                         ids=ONLY_REDUCED_IDS)
def test_row_norm_split_verifies_on_the_gpu(make, shape):
    """Both split alternatives of a group norm feeding a mean, and of an instance norm
    feeding a max, pass the Verifier on the GPU, and the compiled model gives eager's
    result."""
    torch.manual_seed(0)
    model = make().cuda().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cache": False, "require_speedup": False,
                                     "channels_last": False})
    x = torch.rand(shape, device="cuda")
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-4)
    verified = _split_verdicts(backend)
    assert len(verified) >= 2 and all(verified.values()), verified
