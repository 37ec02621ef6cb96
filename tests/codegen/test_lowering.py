"""Lowering semantics without a GPU: the IR interpreter must match the eager GraphModule
for every case of the table; unsupported regions must say why; the public handle's
fields and launch plans are what the launcher expects."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.codegen import FusedKernel, LaunchPlan, Unsupported, generate
from stitch_backend.codegen import indexing as ix
from stitch_backend.codegen.lower import lower

from .cases import BY_NAME, CASES, Case


def _trace(fn, *args, mode="fake"):
    return make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode=mode)(*args)


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_matches(got, ref, tol):
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.dtype == r.dtype, f"output {i}: dtype {g.dtype} vs eager {r.dtype}"
        assert g.shape == r.shape, f"output {i}: shape {tuple(g.shape)} vs eager {tuple(r.shape)}"
        if r.numel():
            assert g.stride() == r.stride(), f"output {i}: strides {g.stride()} vs eager {r.stride()}"
        if r.dtype.is_floating_point:
            torch.testing.assert_close(g, r, atol=tol, rtol=tol, equal_nan=True, msg=f"output {i}")
        else:
            assert torch.equal(g, r), f"output {i}: {g} vs {r}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_interpreter_matches_eager(case: Case):
    gm = case.trace()
    kernel = generate(gm, case.name)
    tol = 1e-2 if case.half else 1e-5
    for alt in ([False, True] if case.alt_inputs else [False]):
        inputs = case.make_inputs(seed=7, alt=alt)
        assert_matches(kernel.interpret(inputs), _as_list(gm(*inputs)), tol)


# ----------------------------------------------------------------------------- unsupported


@pytest.mark.parametrize("fn, args, needle", [
    (lambda a: torch.softmax(a, -1).sum(0), (torch.randn(4, 8),), "iteration space"),
    (lambda a: a @ a.t(), (torch.randn(4, 8),), "aten.mm.default"),
    (lambda a: a + torch.rand_like(a), (torch.randn(4, 8),), "rand"),
    (lambda a: torch.cumsum(a, 1), (torch.randn(4, 8),), "aten.cumsum.default"),
    (lambda a: torch.softmax(a, -1) * torch.softmax(a, -1).amax(-1).sum(), (torch.randn(4, 8),), "cross-row"),
    (lambda a: (torch.softmax(a, -1)[:, None, :] * torch.ones(3, 1)), (torch.randn(4, 8),), "iteration space"),
])
def test_unsupported_says_why(fn, args, needle):
    gm = _trace(fn, *args)
    with pytest.raises(Unsupported) as info:
        generate(gm, "bad")
    assert needle in info.value.reason


def test_unsupported_is_a_stitch_error():
    from stitch_backend.exc import StitchError
    assert issubclass(Unsupported, StitchError)


def test_bad_kernel_name_is_rejected():
    gm = _trace(lambda a: a + 1, torch.randn(4))
    with pytest.raises(ValueError, match="C identifier"):
        generate(gm, "not a name")


# ----------------------------------------------------------------------------- index algebra


def test_simplifier_undoes_view_round_trips():
    i0, i1 = ix.loop_var(0), ix.loop_var(1)
    simp = ix.Simplifier({i0: (0, 3), i1: (0, 7)})
    flat = 8 * i0 + i1
    assert simp.simplify(ix.FDiv(flat, 8)) == i0
    assert simp.simplify(ix.IMod(flat, 8)) == i1
    assert simp.simplify(8 * ix.FDiv(i1 + 8 * i0, 8) + ix.IMod(i1 + 8 * i0, 8)) == flat
    assert simp.simplify(ix.IMod(flat, 4)) == ix.IMod(i1, 4)


def test_simplifier_drops_the_digits_a_division_by_a_whole_stride_ignores():
    """A (1, 32, 6, 6) position read back through a view to (4, 8, 6, 6) and on to the
    channel of the first shape: ``8*((36*c + 6*h + w) // 288) + c % 8`` is ``c``."""
    c, h, w = ix.loop_var(1), ix.loop_var(2), ix.loop_var(3)
    simp = ix.Simplifier({c: (0, 31), h: (0, 5), w: (0, 5)})
    flat = 36 * c + 6 * h + w
    assert simp.simplify(ix.FDiv(flat, 288)) == ix.FDiv(c, 8)
    assert simp.simplify(8 * ix.FDiv(flat, 288) + ix.IMod(ix.FDiv(flat, 36), 8)) == c
    assert simp.simplify(ix.IMod(flat, 288)) == 36 * ix.IMod(c, 8) + 6 * h + w
    # the digits below the factor must be provably smaller than it: w alone may be 5 > 3
    wide = ix.Simplifier({c: (0, 31), w: (0, 5)})
    assert "FDiv(3*" in str(wide.simplify(ix.FDiv(3 * c + w, 6)))


def test_simplifier_puts_back_three_digits_of_a_flattened_volume():
    """A (13, 29, 29) volume flattened to one index i and read through its digits:
    ``841*(i // 841) + 29*((i // 29) % 29) + i % 29`` is i. Before, the first pair was
    not recognised (its division by 29*29 is written FDiv(i, 841), not a nested FDiv),
    so KernelBench L2 27's group norm paid three divisions an element and no vector
    loads."""
    i = ix.loop_var(0)
    simp = ix.Simplifier({i: (sympy.Integer(0), sympy.Integer(13 * 29 * 29 - 1))})
    digits = 841 * ix.FDiv(i, 841) + 29 * ix.IMod(ix.FDiv(i, 29), 29) + ix.IMod(i, 29)
    assert simp.simplify(digits) == i
    assert simp.simplify(digits + 10933 * ix.loop_var(1)) == i + 10933 * ix.loop_var(1)
    # without the whole stride of the last digit it stays as it is
    part = 29 * ix.IMod(ix.FDiv(i, 29), 29) + ix.IMod(i, 29)
    assert simp.simplify(part) == sympy.expand(part)


def test_a_softmax_over_a_flattened_volume_reads_vectors():
    """Softmax over the positions of a (2, 4, 3, 5, 8) value viewed (2, 4, 120) (L2 38's
    region): the row is contiguous, so it is read in 16-byte vectors without a
    division by the view's sizes."""
    k = generate(_trace(lambda a: torch.softmax(a.clamp(0, 1).view(2, 4, -1), -1) * 2.0,
                        torch.randn(2, 4, 3, 5, 8)), "vol_softmax")
    assert "vector path" in k.source.splitlines()[0], k.source.splitlines()[0]
    assert "/ 5)" not in k.source and "/ 40)" not in k.source, k.source
    x = torch.randn(2, 4, 3, 5, 8)
    torch.testing.assert_close(k.interpret([x])[0],
                               torch.softmax(x.clamp(0, 1).view(2, 4, -1), -1) * 2.0)


def test_an_instance_norm_viewed_back_is_one_kernel_with_its_divide():
    """L2 17's region: before, the divide after the view back was a second kernel that
    read and wrote the whole tensor again."""
    k = generate(_trace(BY_NAME["norm_instance_norm_viewed_back"].fn, torch.randn(2, 6, 5, 7)), "inorm")
    assert k.kind == "reduction" and "aten.div.Tensor" in k.ops


def test_views_lower_to_plain_offsets():
    gm = _trace(lambda a: (a.view(2, 3, 40).permute(2, 0, 1).reshape(40, 6).t() * 2).contiguous(),
                torch.randn(6, 40))
    ir = lower(gm, "views")
    offsets = [s.offset for s in ir.stores]
    text = " ".join(map(str, offsets)) + " ".join(str(n) for n in ir.all_exprs())
    assert "FDiv" not in text and "IMod" not in text
    assert len(ir.domain.row_vars) == 1  # contiguous in and out: one merged loop variable


def test_group_norm_domain_is_rows_by_group():
    gm = _trace(lambda a, w, b: F.group_norm(a, 3, w, b), torch.randn(2, 6, 5, 7), torch.randn(6),
                torch.randn(6))
    ir = lower(gm, "gn")
    assert int(ir.domain.rows) == 2 * 3 and int(ir.domain.reduce_len) == 2 * 35
    assert [r.phase for r in ir.reductions] == [0, 1]  # mean, then centred sum of squares


def test_cross_entropy_is_one_kernel_with_cross_row_stage():
    case = BY_NAME["norm_cross_entropy_mean"]
    ir = lower(case.trace(), "ce")
    assert {r.level for r in ir.reductions} == {"inner", "outer"}
    assert [s.level for s in ir.stores] == ["outer"]


# ----------------------------------------------------------------------------- the handle


def test_fused_kernel_fields_and_source():
    case = BY_NAME["norm_layer_norm"]
    k = generate(case.trace(), "region_ln", sm_count=132)
    assert isinstance(k, FusedKernel)
    assert k.name == k.entry == "region_ln"
    assert 'extern "C" __global__' in k.source and "region_ln(" in k.source
    assert "aten.native_layer_norm.default" in k.source.split("extern")[0]
    assert k.ops == ["aten.native_layer_norm.default"]
    assert k.signature == "ppppi"  # x, w, b, y, log2_tk
    assert "sfk_ldv<4>" in k.source  # 16-byte vector path for fp32 rows
    assert "atomicAdd" not in k.source
    with pytest.raises(Exception):
        k.name = "other"  # frozen


def test_prepare_allocates_eager_layouts_and_args():
    case = BY_NAME["norm_layer_norm_outputs"]
    gm = case.trace()
    k = generate(gm, "ln3")
    inputs = case.make_inputs(seed=3)
    plan = k.prepare(inputs)
    assert isinstance(plan, LaunchPlan)
    ref = gm(*inputs)
    for o, r in zip(plan.outputs, ref):
        assert (o.shape, o.stride(), o.dtype) == (r.shape, r.stride(), r.dtype)
    assert len(plan.args) == len(k.signature)
    assert plan.args[:3] == tuple(x.data_ptr() for x in inputs)
    assert plan.args[3:6] == tuple(o.data_ptr() for o in plan.outputs)
    threads = plan.block[0]
    assert threads & (threads - 1) == 0 and 32 <= threads <= 1024
    assert 1 <= plan.grid[0] <= 132 * 2048 // threads and plan.shared_mem == 0


def test_prepare_sizes_grid_from_sm_count():
    """Grid-stride grids (a reduction over the outer index) are capped at the device's
    resident threads; a pointwise kernel launches one thread per vector whatever it has."""
    gm = _trace(lambda a: a * 2, torch.randn(1 << 16))
    for sm in (4, 132):
        plan = generate(gm, "pw", sm_count=sm).prepare([torch.randn(1 << 16)])
        assert plan.grid[0] == (1 << 16) // (256 * 4)
    x = torch.randn(64, 1 << 16)
    gm = _trace(lambda a: a.sum(0), x)
    small = generate(gm, "col", sm_count=4).prepare([x])
    big = generate(gm, "col", sm_count=132).prepare([x])
    assert small.grid[0] * small.block[0] <= 4 * 2048 < big.grid[0] * big.block[0]


def test_cross_row_kernel_gets_workspace_and_ticket():
    case = BY_NAME["norm_cross_entropy_mean"]
    k = generate(case.trace(), "ce")
    plan = k.prepare(case.make_inputs(seed=1))
    assert k.signature == "pp" + "p" + "ppp" + "i"
    ticket = plan.scratch[-1]
    assert ticket.dtype == torch.int32 and int(ticket.item()) == 0


def test_dynamic_kernel_takes_sizes_as_arguments():
    case = BY_NAME["dyn_softmax"]
    k = generate(case.trace(), "dyn")
    assert "l" in k.signature
    for alt in (False, True):
        inputs = case.make_inputs(seed=2, alt=alt)
        plan = k.prepare(inputs)
        sizes = [a for a, c in zip(plan.args, k.signature) if c == "l"]
        assert sorted(sizes) == sorted(inputs[0].shape)


def test_prepare_rejects_inputs_of_another_layout():
    case = BY_NAME["norm_softmax"]
    k = generate(case.trace(), "sm")
    with pytest.raises(ValueError, match="shape"):
        k.prepare([torch.randn(5, 40)])
    with pytest.raises(ValueError, match="strides"):
        k.prepare([torch.randn(40, 6).t()])
    with pytest.raises(ValueError, match="dtype"):
        k.prepare([torch.randn(6, 40, dtype=torch.float64)])


def test_prepare_validates_each_layout_once(monkeypatch):
    import stitch_backend.codegen.fused as fused

    calls = []
    real_bind = fused.bind
    monkeypatch.setattr(fused, "bind", lambda ir, xs: calls.append(1) or real_bind(ir, xs))
    k = generate(_trace(lambda a: a.relu() * 2, torch.randn(6, 8)), "memo")
    first, second = k.prepare([torch.randn(6, 8)]), k.prepare([torch.randn(6, 8)])
    assert len(calls) == 1
    assert first.args != second.args  # fresh outputs and pointers on every call
    assert first.outputs[0].data_ptr() != second.outputs[0].data_ptr()
    with pytest.raises(ValueError, match="strides"):  # a new layout is checked again
        k.prepare([torch.randn(8, 6).t()])
    assert len(calls) == 2


def test_a_region_mixing_devices_stays_on_aten():
    # ATen lets a 0-dim CPU tensor (a lifted constant, as in ``z[:, 0] = 0.0``) meet CUDA
    # tensors; a kernel handed its host pointer would fault. Meta stands in for CUDA.
    gm = _trace(lambda a, b: a + b, torch.randn(4, 4), torch.tensor(0.0))
    gm.graph.find_nodes(op="placeholder")[0].meta["val"] = torch.empty(4, 4, device="meta")
    with pytest.raises(Unsupported, match="mixes devices"):
        generate(gm, "mixed")


def test_prepare_rejects_inputs_on_two_devices():
    k = generate(_trace(lambda a, b: a * b, torch.randn(4, 4), torch.randn(4, 4)), "two")
    with pytest.raises(ValueError, match="one device"):
        k.prepare([torch.randn(4, 4), torch.empty(4, 4, device="meta")])


def test_half_results_round_where_eager_rounds():
    # (a * b) rounds to fp16 before + 1 in eager; the kernel must round there too
    a = torch.full((8,), 1.0009765625, dtype=torch.float16)
    b = torch.full((8,), 1.0009765625, dtype=torch.float16)
    gm = _trace(lambda x, y: x * y + 1e-3, a, b)
    out = generate(gm, "h").interpret([a, b])[0]
    assert torch.equal(out, gm(a, b))


def test_a_scalar_constant_is_inlined_beside_tensors_of_any_device():
    """``torch.minimum(x, torch.tensor(0.5))``: a region module marks the constant and
    the kernel takes it as a literal, also when it is a CPU scalar beside a CUDA ``x``
    (unmarked, the region refuses the mix of devices)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from stitch_backend.regions import CONSTANT

    def fn(x, c):
        return torch.minimum(x, c) * 2.0

    gm = make_fx(fn)(torch.randn(4, 8), torch.tensor(0.5))
    mode = FakeTensorMode()
    with mode:
        fake_x = torch.empty(4, 8, device="cuda")
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(fake_x, mode.from_tensor(torch.tensor(0.5)))
    c_node = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    assert c_node.meta["val"].device.type == "cpu"
    with pytest.raises(Unsupported, match="mixes devices"):
        generate(gm, "mixed")
    c_node.meta[CONSTANT] = torch.tensor(0.5)
    k = generate(gm, "across")              # inlined beside the CUDA tensor
    assert [a.position for a in k.ir.inputs] == [0] and "0.5f" in k.source
    cpu = make_fx(fn)(torch.randn(4, 8), torch.tensor(0.5))
    [n for n in cpu.graph.nodes if n.op == "placeholder"][1].meta[CONSTANT] = torch.tensor(0.5)
    k = generate(cpu, "inlined")
    assert [a.position for a in k.ir.inputs] == [0]
    assert "0.5f" in k.source
    x = torch.randn(4, 8)
    torch.testing.assert_close(k.interpret([x, torch.tensor(0.5)])[0], fn(x, torch.tensor(0.5)))


def test_outputs_live_on_the_device_of_what_the_kernel_reads():
    """A region input the kernel does not read (a CPU scalar constant it inlined) may come
    first: the outputs still go where the read inputs are (a kernel writing through a
    host pointer is an illegal address on the GPU). Meta tensors stand in for CUDA."""
    from stitch_backend.codegen.fused import Layout, launch_plan

    layout = Layout(outputs=(((4, 8), (8, 1), torch.float32),), scratch=(), positions=(1,),
                    tail=(), grid=(1, 1, 1), block=(128, 1, 1))
    plan = launch_plan(layout, [torch.tensor(0.5), torch.empty(4, 8, device="meta")])
    assert plan.outputs[0].device.type == "meta"
    assert [t.device.type for t in plan.reads] == ["meta"]   # what the runner checks
    plan = launch_plan(layout, [torch.empty(4, 8, device="meta"), torch.randn(4, 8)])
    assert plan.outputs[0].device.type == "cpu"


def test_a_gathered_index_out_of_range_is_an_error_as_in_aten():
    """The kernel checks each gathered index against its extent (``__trap()``, where ATen's
    CUDA kernels raise a device-side assert); the interpreter raises IndexError."""
    fn = lambda a, t: torch.gather(a, 1, t.unsqueeze(1)).squeeze(1) * 2  # noqa: E731
    a, t = torch.randn(6, 40), torch.randint(0, 40, (6,))
    k = generate(_trace(fn, a, t), "gath")
    assert "__trap()" in k.source and "(unsigned long long)(40)" in k.source
    torch.testing.assert_close(k.interpret([a, t])[0], fn(a, t))
    for bad in (40, -1):
        t_bad = t.clone()
        t_bad[3] = bad
        with pytest.raises(IndexError, match="out of range"):
            k.interpret([a, t_bad])
