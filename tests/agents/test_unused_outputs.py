"""An attention op's dropout seed/offset at dropout_p=0 holds no result and is left out of
the end-to-end check; with dropout on, or for any other output, nothing changes."""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
import torch.fx

from stitch_backend.agents.unused_outputs import unused_rng_outputs

aten = torch.ops.aten


def _attention_graph(op, dropout_p, picks):
    """A graph calling ``op`` on three placeholders and returning the ``picks``-th
    results of it."""
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    # flash: (q, k, v, dropout_p, ...); cuDNN, efficient: (q, k, v, bias, lse, dropout_p, ...)
    flash = op is aten._scaled_dot_product_flash_attention.default
    args = (q, k, v, dropout_p) if flash else (q, k, v, None, True, dropout_p)
    node = g.call_function(op, args)
    g.output(tuple(g.call_function(operator.getitem, (node, i)) for i in picks))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_cudnn_attention_seed_and_offset_at_dropout_0_are_unused():
    gm = _attention_graph(aten._scaled_dot_product_cudnn_attention.default, 0.0, [0, 1, 6, 7])
    assert unused_rng_outputs(gm) == [2, 3]


def test_with_dropout_on_the_seed_is_compared():
    gm = _attention_graph(aten._scaled_dot_product_cudnn_attention.default, 0.1, [0, 1, 6, 7])
    assert unused_rng_outputs(gm) == []


def test_flash_and_efficient_attention_name_them_otherwise():
    flash = _attention_graph(aten._scaled_dot_product_flash_attention.default, 0.0, [0, 6, 7, 1])
    assert unused_rng_outputs(flash) == [1, 2]
    eff = _attention_graph(aten._scaled_dot_product_efficient_attention.default, 0.0, [2, 0, 3])
    assert unused_rng_outputs(eff) == [0, 2]


def test_dropout_p_left_at_its_default_counts_as_0():
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    node = g.call_function(aten._scaled_dot_product_flash_attention.default, (q, k, v))
    g.output((g.call_function(operator.getitem, (node, 6)),))
    assert unused_rng_outputs(torch.fx.GraphModule(torch.nn.Module(), g)) == [0]


# An op of this test's own, shaped like fused attention: its seed output is a value
# that changes from call to call, as the H200's cuDNN attention's did at dropout 0.
_counter = itertools.count(1)


@pytest.fixture(scope="module")
def noisy_op():
    lib = torch.library.Library("stitchtest_rng", "DEF")
    lib.define("attn(Tensor x, float dropout_p) -> (Tensor output, Tensor philox_seed)")

    def impl(x, dropout_p):
        return x * 2.0, torch.tensor(next(_counter))

    def fake(x, dropout_p):
        return torch.empty_like(x), torch.empty((), dtype=torch.long)

    lib.impl("attn", impl, "CPU")
    torch.library.register_fake("stitchtest_rng::attn", fake, lib=lib)
    yield torch.ops.stitchtest_rng.attn.default
    lib._destroy()


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_a_graph_returning_an_unused_seed_keeps_its_kernels_only_at_dropout_0(noisy_op,
                                                                             dropout_p):
    from stitch_backend.backend import StitchBackend

    def fn(x):
        y, seed = noisy_op(torch.relu(x * 3.0 + 1.0), dropout_p)
        return torch.tanh(y) * 0.5, seed

    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False})
    torch.compile(fn, backend=backend)(torch.randn(64, 32))
    record = backend.records[-1]
    kept = any(r.backend == "kernel" for r in record.plan.regions)
    if dropout_p == 0.0:
        assert kept, backend.report()
        assert any("not compared" in n for n in record.notes), record.notes
    else:   # the seed differs from eager's and is compared: the check fails the graph
        assert not kept, backend.report()
        assert any("end-to-end check failed" in n for n in record.notes), record.notes
