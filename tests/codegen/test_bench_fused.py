"""``python -m stitch_backend.codegen.bench_fused``: the generated kernels' benchmark."""

from __future__ import annotations

import pytest


def test_the_layouts_option_names_each_reduction_layout(monkeypatch):
    """``--layouts inner,cluster --only softmax`` times each softmax region once per layout
    (None stands for the template's own choice where the option is absent)."""
    from stitch_backend.codegen import bench_fused

    calls = []
    monkeypatch.setattr(bench_fused, "bench", lambda *a: calls.append(a))
    bench_fused.main(["--layouts", "inner,cluster", "--only", "softmax", "--long-rows"])
    bench_fused.main([])
    assert calls == [(None, 50, True, ("inner", "cluster"), ("softmax",)),
                     (None, 50, False, (None,), ())]


@pytest.mark.gpu
def test_a_softmax_region_in_two_layouts_gives_a_row_each():
    from stitch_backend.codegen.bench_fused import bench

    rows = bench(iters=2, layouts=("inner", "cluster"), only=("softmax_fp32",))
    assert [r["region"].rsplit("[", 1)[1] for r in rows] == ["inner]", "cluster]"]
    assert all(r["fused_ms"] > 0 and r["eager_ms"] > 0 for r in rows)
