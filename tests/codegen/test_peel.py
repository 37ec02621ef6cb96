"""Peeled rows (``codegen.peel``, ``generate(peel=True)``; the Coder's ``_pl``
alternative): a row reduction whose rows start anywhere (odd lengths: KernelBench L1
38/39's 65535) reads a scalar head up to its first aligned element, 16-byte chunks over
the aligned middle, and a scalar tail; in the cluster layout each block takes a share of
the middle and the first block the head and tail. On the CPU: what the source holds,
that the emitted row bounds cover each element once with every chunk aligned (and, in a
cluster, inside its block's shared-memory share), what is not peeled, the Coder's
alternatives, and that every case compiles for sm_90a; on the GPU: eager's values,
bit-identical on a second launch, also from a misaligned view."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.codegen import generate
from stitch_backend.codegen.fused import Unsupported
from stitch_backend.codegen.peel import PEEL_MIN_K

from .checks import assert_compiles_for_sm90a, assert_eager_values


def _trace(fn, *inputs):
    return make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*inputs)


def _l1norm(a):
    return a / torch.mean(torch.abs(a), dim=1, keepdim=True)


def _l2norm(a):
    return a / torch.norm(a, p=2, dim=1, keepdim=True)


def _affine_norm(a, w, b):
    return F.layer_norm(a, (a.shape[-1],), w, b)


# name: (function, input shapes and dtypes)
CASES = {
    "l1norm_odd": (_l1norm, [((9, 65535), torch.float32)]),
    "l2norm_odd": (_l2norm, [((16, 33333), torch.float32)]),
    "layer_norm_affine_odd_f16": (_affine_norm, [((8, 40001), torch.float16),
                                                 ((40001,), torch.float16),
                                                 ((40001,), torch.float16)]),
    "bf16_sum_odd": (lambda a: a.sum(-1), [((4, 3, 30001), torch.bfloat16)]),
    "softmax_odd": (lambda a: torch.softmax(a, 1), [((5, 65535), torch.float32)]),
    "logsumexp_odd": (lambda a: torch.logsumexp(a, 1), [((6, 4099), torch.float32)]),
}


def _inputs(what, device="cpu"):
    _, specs = CASES[what]
    gen = torch.Generator(device=device).manual_seed(len(what))
    return [torch.randn(*shape, device=device, generator=gen).to(dtype) for shape, dtype in specs]


def _kernel(what, device="cpu", peel=True, layout=None):
    fn, _ = CASES[what]
    xs = _inputs(what, device)
    return generate(_trace(fn, *xs), f"pl_{what}", peel=peel, layout=layout), fn, xs


def test_a_peeled_row_norm_reads_its_aligned_middle_in_vectors_and_its_edges_one_by_one():
    """L1 38's form: both passes (the sum of magnitudes, then the stores) run 16-byte
    chunks over ``sfk_mid`` elements from the row's first aligned one, then the head and tail
    elements one a thread; the template (no peel) keeps one element a thread and step."""
    k, _, _ = _kernel("l1norm_odd")
    src = k.source
    assert k.emitted.vec == 4 and k.emitted.layout == "inner"
    assert "rows peeled to alignment" in src
    assert src.count("for (int q0 = (int)tk * 4; q0 < sfk_mid; q0 += (int)TK * 4)") == 2
    assert src.count("const int k0 = sfk_lead + q0;") == 2
    assert src.count("sfk_ldv<4>(in0 + ") == 2 and src.count("sfk_stv<4>(out0 + ") == 1
    assert src.count("for (int e = tk; e < sfk_edge; e += TK)") == 2
    # the edge loop's stores are scalar: every element of the head and tail is written
    edge_store = src.split("e < sfk_edge")[2].split("} else {")[0]
    assert re.search(r"out0\[\(i1 \+ \(65535 \* i0\)\)\] = ", edge_store)
    # misaligned buffers take the scalar pass, which covers the whole row
    assert "} else {" in src and src.count("k0 < Kr;") == 2
    plain = _kernel("l1norm_odd", peel=False)[0]
    assert plain.emitted.vec == 1 and "sfk_lead" not in plain.source


_BOUNDS = ["sfk_lead0", "sfk_lead", "sfk_mid", "sfk_vend", "sfk_edge"]
_CLUSTER_BOUNDS = ["sfk_share", "kb", "ke", "sfk_qshare", "sfk_qb", "sfk_qe", "sfk_vb", "sfk_ve"]


def _bounds(src: str, names=tuple(_BOUNDS)):
    """The emitted row-bound lines as Python assignments (of the row index i0, Kr and,
    in a cluster, the block's rank)."""
    lines = [ln.strip() for ln in src.splitlines()
             if re.match(rf"\s*const int ({'|'.join(names)}) =", ln)]
    assert [ln.split(" =")[0] for ln in lines] == [f"const int {n}" for n in names]
    body = []
    for ln in lines:
        ln = ln.removeprefix("const int ").rstrip(";").replace("(int)", "").replace("/", "//")
        ln = ln.replace("sfk_rank == 0u", "sfk_rank == 0")
        ln = re.sub(r"(\w+ [<=]=? \w+) \? (.+) : (\w+)$", r"((\2) if \1 else \3)", ln)
        ln = re.sub(r"(\w+(?: - \w+)?) < (\w+) \? (\w+(?: \+ \w+)?) : (\w+(?: \+ \w+)?)",
                    r"(\3 if \1 < \2 else \4)", ln)
        body.append(ln)
    return body


def _evaluate(body, env):
    for ln in body:
        name, expr = ln.split(" = ", 1)
        env[name] = eval(expr, {}, env)   # noqa: S307 - the test's own generated text
    return env


def test_the_row_bounds_cover_each_element_once_with_every_chunk_aligned():
    """The bound lines of the source, evaluated for each start of a row modulo 4 and row
    lengths from 0 to past a chunk: the vector chunks (``sfk_lead`` + 0, 4, .. below
    ``sfk_mid``) begin on a multiple of 4 and end by ``sfk_vend``; with the head and tail
    of the edge loop they cover 0..Kr-1 exactly once."""
    k, _, _ = _kernel("l1norm_odd")
    body = _bounds(k.source)
    for i0 in range(8):
        for kr in list(range(0, 12)) + [65535, 4099]:
            env = _evaluate(body, {"i0": i0, "Kr": kr})
            lead, vend, edge = env["sfk_lead"], env["sfk_vend"], env["sfk_edge"]
            chunks = [lead + q0 for q0 in range(0, env["sfk_mid"], 4)]
            assert all((65535 * i0 + c) % 4 == 0 and c + 4 <= vend <= kr for c in chunks), (i0, kr)
            seen = [c + v for c in chunks for v in range(4)]
            seen += [e if e < lead else vend + (e - lead) for e in range(edge)]
            assert sorted(seen) == list(range(kr)), (i0, kr, lead, vend, edge)


def test_the_rows_own_data_takes_the_vector_path_before_what_every_row_reads():
    """A LayerNorm over odd rows: x and the output start with the row (vectors, fp16:
    8 a chunk); its weight and bias start at 0 for every row and stay scalar."""
    k, _, _ = _kernel("layer_norm_affine_odd_f16")
    src = k.source
    assert k.emitted.vec == 8
    assert "sfk_ldv<8>(in0 + " in src and "sfk_stv<8>(out0 + " in src
    assert "sfk_ldv<8>(in1" not in src and "sfk_ldv<8>(in2" not in src
    assert "sfk_aligned(in1" not in src


def test_rows_with_an_aligned_vector_path_short_rows_and_other_layouts_are_not_peeled():
    for fn, x, layout in ((_l2norm, torch.randn(16, 32768), None),        # aligned already
                          (_l2norm, torch.randn(16, PEEL_MIN_K - 1), None),  # short rows
                          (lambda a: a.sum(0), torch.randn(33333, 5), None),  # column layout
                          (torch.relu, torch.randn(7, 33333), None)):         # pointwise
        with pytest.raises(Unsupported):
            generate(_trace(fn, x), "pl_no", peel=True, layout=layout)


class _OddNorm(nn.Module):
    def forward(self, x):
        return x / torch.norm(x * 2.0, p=2, dim=1, keepdim=True)


def _region(model, x):
    from stitch_backend.backend import StitchBackend

    backend = StitchBackend({"cpu_interpret": True, "cache": False})
    torch.compile(model, backend=backend)(x)
    rec = backend.records[-1]
    return rec, next(r for r in rec.plan.regions if r.kind.value == "fused")


def test_odd_long_rows_get_the_peeled_alternative_and_it_gives_the_regions_values():
    """Rows of 33333: a ``_pl`` candidate beside the template (its kernel peeled);
    rows of 32768 (an aligned vector path) and of 999 (short) get none. Interpreted,
    the candidate gives the region's outputs."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.state import subtask_for
    from stitch_backend.kernels import InterpretedRunner, runner_for
    from stitch_backend.regions import region_module

    rec, region = _region(_OddNorm(), torch.randn(4, 33333))
    alts = {a.name: a for a in TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives}
    assert "k_pl" in alts, list(alts)
    assert all("sfk_lead" in k.source for k in alts["k_pl"].kernels)
    for cols in (32768, 999):
        other_rec, other = _region(_OddNorm(), torch.randn(4, cols))
        names = [a.name for a in TemplateCoder().propose(
            subtask_for(other_rec.gm, other, "k")).alternatives]
        assert "k_pl" not in names, cols
    x = torch.randn(4, 33333)
    module = region_module(rec.gm, region)
    want = module(x)
    (got,) = runner_for(alts["k_pl"], base=InterpretedRunner)(x)
    torch.testing.assert_close(got, want[0] if isinstance(want, (tuple, list)) else want)


@pytest.mark.nvcc
def test_every_peeled_case_compiles_for_sm90a():
    """All cases in one unit, nvcc for sm_90a (the GPU test below runs them)."""
    assert_compiles_for_sm90a([_kernel(w)[0] for w in sorted(CASES)], "peel")


@pytest.mark.gpu
@pytest.mark.parametrize("what", sorted(CASES) + ["l2norm_odd misaligned"])
def test_peeled_rows_give_eagers_values(what):
    """Each case; and the l2norm's kernel on a view one element into its storage (its
    pointer is not 16-byte aligned: ``vec_ok`` is false, the scalar pass reads the rows)."""
    k, fn, xs = _kernel(what.split()[0], "cuda")
    assert "sfk_lead" in k.source
    if what.endswith("misaligned"):
        base = torch.randn(xs[0].numel() + 1, device="cuda")
        xs = [base[1:].view(xs[0].shape)]
        assert xs[0].data_ptr() % 16
    assert_eager_values(k, fn, xs)


def test_a_peeled_cluster_row_shares_its_aligned_middle_and_the_first_block_its_edges():
    """The cluster layout peeled (L1 38's rows): each of the 8 blocks takes whole aligned
    chunks of the middle (``sfk_qb``..``sfk_qe``), keeps them in its shared memory
    indexed from ``sfk_vb``, and the first block alone the head and tail; evaluated from
    the source for each start of a row modulo 4 and lengths up to past 8 chunks, the
    blocks' chunks and the first block's edges cover the row once, every chunk aligned and
    inside its block's slots (``_share`` elements, as the scalar path's)."""
    k, _, _ = _kernel("l1norm_odd", layout="cluster")
    src = k.source
    assert k.emitted.layout == "cluster" and k.emitted.vec == 4 and k.emitted.shared_mem > 0
    assert "rows peeled to alignment" in src and "(8 blocks a row)" in src
    assert "sfk_rb_vin0_0[(k0 - sfk_vb) / 4] = " in src
    assert src.count("q0 = sfk_qb + (int)tk * 4; q0 < sfk_qe;") == 1   # the pass from smem
    assert "kq = sfk_vb + (int)tk * 4;" in src                           # the batched pass
    body = _bounds(src) + _bounds(src, tuple(_CLUSTER_BOUNDS))
    for i0 in range(4):
        for kr in list(range(0, 40)) + [65535, 4099]:
            seen = []
            for rank in range(8):
                env = _evaluate(body, {"i0": i0, "Kr": kr, "sfk_rank": rank})
                share = env["sfk_share"]
                chunks = list(range(env["sfk_vb"], env["sfk_ve"], 4))
                assert all((65535 * i0 + c) % 4 == 0 for c in chunks), (i0, kr, rank)
                assert all(0 <= (c - env["sfk_vb"]) // 4 < share // 4 for c in chunks)
                seen += [c + v for c in chunks for v in range(4)]
                lead, vend = env["sfk_lead"], env["sfk_vend"]
                assert env["sfk_edge"] == (lead + kr - vend if rank == 0 else 0)
                seen += [e if e < lead else vend + (e - lead) for e in range(env["sfk_edge"])]
            assert sorted(seen) == list(range(kr)), (i0, kr)


def test_odd_long_rows_get_a_peeled_cluster_alternative():
    """Rows of 33333 with clusters: ``_cl_r`` and ``_clf_r`` (an L2 norm's division by
    its root) are peeled; rows of 32768 keep the aligned cluster kernel."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.state import subtask_for

    rec, region = _region(_OddNorm(), torch.randn(4, 33333))
    alts = {a.name: a for a in TemplateCoder(clusters=True).propose(
        subtask_for(rec.gm, region, "k")).alternatives}
    for name in ("k_cl_r", "k_clf_r"):
        (kernel,) = alts[name].kernels
        assert kernel.emitted.layout == "cluster" and kernel.emitted.vec == 4, name
        assert "sfk_qshare" in kernel.source and kernel.resident, name
    rec, region = _region(_OddNorm(), torch.randn(4, 32768))
    alts = {a.name: a for a in TemplateCoder(clusters=True).propose(
        subtask_for(rec.gm, region, "k")).alternatives}
    (kernel,) = alts["k_cl_r"].kernels
    assert kernel.emitted.vec == 4 and "sfk_lead" not in kernel.source


@pytest.mark.nvcc
def test_every_peeled_case_compiles_for_sm90a_in_the_cluster_layout():
    assert_compiles_for_sm90a([_kernel(w, layout="cluster")[0] for w in sorted(CASES)],
                              "peel_cluster")


@pytest.mark.gpu
@pytest.mark.parametrize("what", sorted(CASES) + ["l2norm_odd misaligned"])
def test_peeled_cluster_rows_give_eagers_values(what):
    k, fn, xs = _kernel(what.split()[0], "cuda", layout="cluster")
    assert "sfk_qshare" in k.source
    if what.endswith("misaligned"):
        base = torch.randn(xs[0].numel() + 1, device="cuda")
        xs = [base[1:].view(xs[0].shape)]
    assert_eager_values(k, fn, xs)
