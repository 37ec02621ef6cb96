"""The static peak-memory estimate of a Program against the traced graph op by op."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.agents.planner import partition
from stitch_backend.ir import Plan, Region, RegionKind
from stitch_backend.memplan import estimate

N = 1 << 16          # elements; fp32 -> 256 KiB a value
V = 4 * N


def _chain(x):
    a = x * 2.0
    b = a + 1.0
    c = torch.relu(b)
    return (c.sum(),)


def test_op_by_op_frees_each_value_after_its_last_reader():
    gm = make_fx(_chain)(torch.randn(N))
    plan = partition(gm, graph_name="g")
    est = estimate(gm, plan)               # every region on ATen: same walk as the graph
    assert est.graph_bytes == 2 * V        # a and b, then b and c, alive at once
    assert est.program_bytes == 2 * V
    assert est.ratio == 1.0 and "above" not in est.line()


def test_a_generated_kernel_materialises_only_its_outputs():
    gm = make_fx(_chain)(torch.randn(N))
    plan = partition(gm, graph_name="g")
    assert len(plan.regions) == 1
    plan.regions[0].backend = "kernel"
    est = estimate(gm, plan)
    assert est.program_bytes == 4          # the scalar sum alone
    assert est.graph_bytes == 2 * V
    assert est.line() == ("memory plan: intermediates and outputs peak at 0.0 MiB "
                          "(the traced graph op by op: 0.5 MiB)")


def test_views_keep_their_base_and_a_kernel_writes_a_boundary_view_whole():
    def f(x):
        a = x * 2.0
        v = a.view(-1, 4)                  # alias of a: no bytes of its own
        return (v.t(),)

    gm = make_fx(f)(torch.randn(N))
    plan = partition(gm, graph_name="g")
    assert estimate(gm, plan).graph_bytes == V
    for r in plan.regions:
        r.backend = "kernel"
    assert estimate(gm, plan).program_bytes == V   # the output written whole by the kernel


def test_aten_regions_free_op_by_op_as_the_straight_line_function_does():
    """x is read by the first node of an ATen region that then allocates more: the
    straight-line function inlines the region's ops, so a dies after its last reader
    as in the graph, not when the region ends."""
    def f(x):
        a = x * 2.0
        b = a + 1.0            # last reader of a
        c = b * 3.0
        d = c * 4.0
        return (d,)

    gm = make_fx(f)(torch.randn(N))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plan = Plan("g", [Region(0, RegionKind.FALLBACK, names[:1], ["aten.mul.Tensor"], outputs=names[:1]),
                      Region(1, RegionKind.FALLBACK, names[1:], ["aten.add.Tensor"] * 3,
                             inputs=names[:1], outputs=names[-1:])], len(names))
    est = estimate(gm, plan)
    assert est.graph_bytes == est.program_bytes == 2 * V


def test_regions_that_reorder_ops_can_raise_the_peak_and_the_line_flags_it():
    """Op by op, a is summed and freed before b exists; a region computing both first
    holds them at once."""
    def f(x):
        a = x * 2.0
        s = a.sum()
        b = x * 3.0
        t = b.sum()
        return (s, t)

    gm = make_fx(f)(torch.randn(N))
    a, s, b, t = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plan = Plan("g", [Region(0, RegionKind.FUSED, [a, b], ["aten.mul.Tensor"] * 2, outputs=[a, b]),
                      Region(1, RegionKind.FALLBACK, [s, t], ["aten.sum.default"] * 2,
                             inputs=[a, b], outputs=[s, t])], 4)
    plan.regions[0].backend = "kernel"
    est = estimate(gm, plan)
    assert est.graph_bytes == V + 8            # b beside the two scalar outputs
    assert est.program_bytes == 2 * V + 4      # a and b, then s
    assert est.line().endswith("100% above it")


def test_a_library_calls_input_is_dropped_before_its_epilogue_writes():
    """A GEMM region (mm, then relu in an epilogue kernel): its runner frees the
    product's input after the product, so y, m and r are never alive together."""
    def f(x, w):
        y = x * 2.0
        m = y @ w
        return (torch.relu(m),)

    gm = make_fx(f)(torch.randn(256, 256), torch.randn(256, 256))
    y, m, r = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plan = Plan("g", [Region(0, RegionKind.FALLBACK, [y], ["aten.mul.Tensor"], outputs=[y]),
                      Region(1, RegionKind.GEMM, [m, r], ["aten.mm.default", "aten.relu.default"],
                             inputs=[y], outputs=[r])], 3)
    plan.regions[1].backend = "kernel"
    est = estimate(gm, plan)
    assert est.graph_bytes == est.program_bytes == 2 * V


def test_symbolic_sizes_count_at_the_example_and_data_dependent_ones_are_not_guessed():
    gm = make_fx(_chain, tracing_mode="symbolic")(torch.randn(N))
    assert estimate(gm, partition(gm, graph_name="g")).graph_bytes == 2 * V

    def data_dependent(x):
        return (torch.nonzero(x) * 2,)

    gm = make_fx(data_dependent, tracing_mode="symbolic")(torch.randn(64))
    est = estimate(gm, partition(gm, graph_name="g"))
    assert est.program_bytes is None and est.graph_bytes is None and est.ratio is None
    assert est.line() == "memory plan: not estimated (the size of nonzero depends on the data)"


def test_backend_report_and_json_carry_the_estimate():
    from stitch_backend.backend import StitchBackend

    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(lambda x: (torch.relu(x * 2.0 + 1.0).sum(),), backend=backend)(torch.randn(N))
    (rec,) = backend.records
    memory = rec.to_dict()["memory"]
    assert memory["program_bytes"] == memory["graph_bytes"] > 0
    assert "  memory plan: intermediates and outputs peak at" in backend.report()


def _held_input_plan():
    """y (region 0, ATen), then a kernel region writing o1 = y * 2 (y's last reader) and
    o2 = o1 * 3, both read by region 2: op by op y dies once o1 exists; the kernel holds
    y until it returns, beside both of its outputs."""
    def f(x):
        y = x + 1.0
        o1 = y * 2.0
        o2 = o1 * 3.0
        return (o1.sum(), o2.sum())

    gm = make_fx(f)(torch.randn(N))
    x = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    y, o1, o2, s, t = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plan = Plan("g", [Region(0, RegionKind.FALLBACK, [y], ["aten.add.Tensor"], inputs=[x], outputs=[y]),
                      Region(1, RegionKind.FUSED, [o1, o2], ["aten.mul.Tensor"] * 2,
                             inputs=[y], outputs=[o1, o2]),
                      Region(2, RegionKind.FALLBACK, [s, t], ["aten.sum.default"] * 2,
                             inputs=[o1, o2], outputs=[s, t])], 5)
    return gm, plan


def test_within_margin_keeps_on_aten_the_kernel_that_raises_the_peak():
    from stitch_backend.memplan import within_margin

    gm, plan = _held_input_plan()
    plan.regions[1].backend = "kernel"
    assert estimate(gm, plan).program_bytes == 3 * V      # y, o1 and o2
    plan.regions[1].backend = "aten"
    dropped, est = within_margin(gm, plan, {1})
    assert dropped == [1]
    assert est.program_bytes == est.graph_bytes == 2 * V + 4     # o1, o2 and a sum
    assert [r.backend for r in plan.regions] == ["aten"] * 3     # the plan left as it was
    gm2 = make_fx(_chain)(torch.randn(N))
    plan2 = partition(gm2, graph_name="g")
    assert within_margin(gm2, plan2, {plan2.regions[0].id})[0] == []   # lowers the peak: kept


def test_the_first_call_drops_a_kernel_over_the_margin_with_its_reason():
    from stitch_backend.agents.acceptance import _within_memory_margin
    from stitch_backend.program import Program

    gm, plan = _held_input_plan()
    program = Program(gm, plan)
    accepted = {1: object()}
    _within_memory_margin(program, accepted)
    assert accepted == {}
    assert plan.regions[1].reason.startswith("kept on ATen for memory")
    assert any(n.startswith("memory: 1 region(s) kept on ATen") and "now +0%" in n
               for n in program.notes_sink), program.notes_sink


def _saved_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of a forward graph's outputs (the module's result and what it saves)."""
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    vals = [n.meta.get("val") for n in outputs if isinstance(n, torch.fx.Node)]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def test_recompute_saves_fewer_activations_and_keeps_eager_gradients():
    """Option recompute (default on): the min-cut partitioner keeps a decomposed training
    BatchNorm's and GELU's intermediates out of what the forward saves, recomputing them
    in the backward; the gradients stay eager's."""
    from stitch_backend.backend import StitchBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8), torch.nn.GELU())   # (a bias ahead of BatchNorm: zero grad)
    x = torch.randn(4, 3, 16, 16)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    saved = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        backend = StitchBackend(options={"recompute": recompute, "cpu_interpret": True,
                                         "eager_guard": False})
        compiled = torch.compile(model, backend=backend)
        model.zero_grad(set_to_none=True)
        compiled(x).square().sum().backward()
        for got, ref in zip([p.grad for p in model.parameters()], want):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        (forward,) = [r for r in backend.records if r.stage == "forward"]
        saved[recompute] = _saved_bytes(forward.gm)
    assert saved[True] < saved[False], saved
