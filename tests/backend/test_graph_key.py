"""GraphKey: stable across processes and node renaming; changes with what it must."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.graph import canonical_graph, graph_key

VERSIONS = {"torch": "2.x", "cuda": "13.0", "nvcc": "13.0.88", "stitchcuda": "0.1.0",
            "cache_version": "1"}


def _fn(x, w):
    return torch.relu(x @ w).sum(-1)


def _trace(fn=_fn, shapes=((4, 8), (8, 16)), dtype=torch.float32):
    inputs = [torch.randn(*s, dtype=dtype) for s in shapes]
    return make_fx(fn)(*inputs), inputs


def _key(gm, inputs, options=None, arch="sm_90a", versions=VERSIONS):
    return graph_key(gm, inputs, options=options or {"codegen": True}, arch=arch,
                     version_info=versions).digest


def test_key_stable_under_node_renaming():
    gm, inputs = _trace()
    before = _key(gm, inputs)
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "output":
            node.name = f"renamed_{i}"
    gm.recompile()
    assert _key(gm, inputs) == before


def test_key_stable_across_processes():
    code = textwrap.dedent("""
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx
        from stitch_backend.graph import graph_key
        def fn(x, w):
            return torch.relu(x @ w).sum(-1)
        inputs = [torch.randn(4, 8), torch.randn(8, 16)]
        gm = make_fx(fn)(*inputs)
        v = {"torch": "2.x", "cuda": "13.0", "nvcc": "13.0.88", "stitchcuda": "0.1.0",
             "cache_version": "1"}
        print(graph_key(gm, inputs, options={"codegen": True}, arch="sm_90a",
                        version_info=v).digest)
    """)
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip() for _ in range(2)}
    gm, inputs = _trace()
    digests.add(_key(gm, inputs))
    assert len(digests) == 1, digests


def test_key_changes_with_op_shape_stride_dtype():
    gm, inputs = _trace()
    base = _key(gm, inputs)
    other_op, _ = _trace(lambda x, w: torch.sigmoid(x @ w).sum(-1))
    assert _key(other_op, inputs) != base
    gm2, inputs2 = _trace(shapes=((4, 8), (8, 32)))
    assert _key(gm2, inputs2) != base
    gm3, inputs3 = _trace(dtype=torch.float64)
    assert _key(gm3, inputs3) != base
    strided = [inputs[0].t().contiguous().t(), inputs[1]]
    gm4 = make_fx(_fn)(*strided)
    assert _key(gm4, strided) != base


def test_key_changes_with_options_arch_versions():
    gm, inputs = _trace()
    base = _key(gm, inputs)
    assert _key(gm, inputs, options={"codegen": False}) != base
    assert _key(gm, inputs, arch="sm_80") != base
    for field in VERSIONS:
        changed = dict(VERSIONS, **{field: "other"})
        assert _key(gm, inputs, versions=changed) != base, field


def test_canonical_graph_names_symbols_by_position():
    def fn(x):
        return (x * 2).sum(0)

    a = make_fx(fn, tracing_mode="symbolic")(torch.randn(5, 3))
    b = make_fx(fn, tracing_mode="symbolic")(torch.randn(7, 3))
    text = canonical_graph(a)
    assert text == canonical_graph(b)
    assert "s0" in text


def test_key_covers_the_code_generating_sources():
    from stitch_backend.graph import code_digest, code_files, versions

    names = {f.name for f in code_files()}
    assert {"lower.py", "emit_cuda.py", "coder.py", "split_stats.py", "fused_ops.cuh"} <= names
    assert versions()["code"] == code_digest() and len(code_digest()) == 16


def test_key_changes_with_a_constant_value_not_only_its_shape():
    """``torch.tensor(0.5)`` in a forward is a graph constant the Coder inlines as a
    literal: a graph with 0.7 there must not reuse the cached kernels of 0.5."""
    def trace(value):
        gm, inputs = _trace(lambda x: torch.minimum(x, torch.tensor(value)) * 2, shapes=((4, 8),))
        assert any(n.op == "get_attr" for n in gm.graph.nodes)
        return _key(gm, inputs)

    assert trace(0.5) == trace(0.5)
    assert trace(0.5) != trace(0.7)
