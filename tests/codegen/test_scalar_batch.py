"""Row reductions without a vector path (odd row lengths: KernelBench L1 38/39's 65535)
issue the loads that lead each step of a pass for BATCH steps before using them
(``codegen.batched_loads``). On the CPU: what the source
holds, that a load whose address reads another value stays where it is, that every case
compiles for sm_90a; on the GPU: eager's values, bit-identical on a second launch."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend import toolchain
from stitch_backend.codegen import generate
from stitch_backend.codegen.batched_loads import BATCH

from .checks import assert_compiles_for_sm90a, assert_eager_values


def _trace(fn, *inputs):
    return make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*inputs)


def _l2norm(a):
    return a / torch.norm(a, p=2, dim=1, keepdim=True)


def _gather_sum(a, i):
    return a.index_select(1, i).sum(1)


def _affine_norm(a, w, b):
    return F.layer_norm(a, (a.shape[-1],), w, b)


# name: (function, input shapes and dtypes)
CASES = {
    "l2norm_odd": (_l2norm, [((16, 33333), torch.float32)]),
    "layer_norm_affine_odd_f16": (_affine_norm, [((8, 40001), torch.float16),
                                                 ((40001,), torch.float16),
                                                 ((40001,), torch.float16)]),
    "gather_sum_odd": (_gather_sum, [((6, 50000), torch.float32), ((33333,), torch.int64)]),
    "bf16_sum_odd": (lambda a: a.sum(-1), [((4, 3, 30001), torch.bfloat16)]),
    "softmax_odd": (lambda a: torch.softmax(a, 1), [((5, 65535), torch.float32)]),
}


def _inputs(what, device="cpu"):
    _, specs = CASES[what]
    gen = torch.Generator(device=device).manual_seed(len(what))
    out = []
    for shape, dtype in specs:
        if dtype == torch.int64:
            out.append(torch.randint(0, 50000, shape, device=device, generator=gen))
        else:
            out.append(torch.randn(*shape, device=device, generator=gen).to(dtype))
    return out


def _kernel(what, device="cpu"):
    fn, _ = CASES[what]
    xs = _inputs(what, device)
    return generate(_trace(fn, *xs), f"sb_{what}"), fn, xs


def test_an_odd_row_norm_issues_a_batch_of_steps_loads_before_using_them():
    """L1 39's form: both passes over the row (the sum of squares, then the element
    stores) fetch BATCH steps' loads into an array, then use them; the steps left
    over run the plain loop; each pass's batch is a block of its own (its own ``kq``)."""
    k, _, _ = _kernel("l2norm_odd")
    src = k.source
    assert k.emitted.vec == 1 and k.emitted.layout == "inner"
    assert src.count(f"pf_t0[{BATCH}]") == 1 and src.count(f"pf_t2[{BATCH}]") == 1
    assert src.count("pf_t0[u] = sfk_val(in0[") == 1 and src.count("= pf_t0[u];") == 1
    assert src.count("kq = (") == 2 and src.count("k0 = kq;") == 2
    assert src.count(f"for (int u = 0; u < {BATCH}; ++u)") == 4
    # the stores stay in the use loop, after their loads
    use = src.split("= pf_t2[u];")[1].split("}")[0]
    assert "out0[" in use


def test_two_leading_loads_share_the_batch_and_a_dependent_address_is_not_fetched_ahead():
    k, _, _ = _kernel("layer_norm_affine_odd_f16")
    fetched = re.findall(r"(pf_t\d+)\[u\] = ", k.source)
    assert len(fetched) >= 2          # x in the statistics' pass, x, w and b in the stores'
    g, _, _ = _kernel("gather_sum_odd")
    src = g.source
    # the index is fetched ahead; the gathered value, whose address reads it, is not
    fetch = [ln for ln in src.splitlines() if re.search(r"pf_t\d+\[u\] = ", ln)]
    assert len(fetch) == 1 and "in1[" in fetch[0]
    assert not any("in0[" in ln for ln in fetch)


def test_rows_with_a_vector_path_keep_their_loop():
    k = generate(_trace(_l2norm, torch.randn(16, 32768)), "sb_even")
    assert k.emitted.vec == 4 and "pf_" not in k.source


@pytest.mark.nvcc
def test_every_case_compiles_for_sm90a():
    assert_compiles_for_sm90a([_kernel(w)[0] for w in sorted(CASES)], "scalar_batch")


@pytest.mark.gpu
@pytest.mark.parametrize("what", sorted(CASES))
def test_batched_scalar_loads_give_eagers_values(what):
    k, fn, xs = _kernel(what, "cuda")
    assert "pf_" in k.source
    assert_eager_values(k, fn, xs)


def _inner_batched(monkeypatch, fn, x):
    from stitch_backend.codegen import batched_loads

    monkeypatch.setattr(batched_loads, "BATCH_INNER_VECTOR", True)
    return generate(_trace(fn, x), "sb_inner_vec")


def test_the_inner_layouts_vector_passes_batch_where_the_flag_is_set(monkeypatch):
    """batched_loads.BATCH_INNER_VECTOR (off by default, not yet measured): the template's
    vector passes fetch BATCH chunks ahead, as the cluster layout's first pass does."""
    fn = lambda a: torch.softmax(a, 1)  # noqa: E731
    k = _inner_batched(monkeypatch, fn, torch.randn(3, 200000))
    assert k.emitted.layout == "inner" and k.emitted.vec == 4
    assert k.source.count(f"pf_vin0_0[{BATCH}];") == 2      # both passes over the row read x
    monkeypatch.undo()
    assert "pf_" not in generate(_trace(fn, torch.randn(3, 200000)), "sb_inner_plain").source


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["softmax", "l2norm"])
def test_batched_inner_vector_passes_give_eagers_values(monkeypatch, what):
    from stitch_backend.cuda_driver import CudaModule

    from .test_gpu import _launch

    fn = {"softmax": lambda a: torch.softmax(a, 1), "l2norm": _l2norm}[what]
    x = torch.randn(5, 200000, device="cuda")
    k = _inner_batched(monkeypatch, fn, x)
    assert "pf_vin0_0" in k.source
    cubin = toolchain.compile_cubin(k.source, k.entry, toolchain.device_arch()).cubin
    (got,) = _launch(k, CudaModule(cubin).function(k.entry, k.signature), [x])
    torch.testing.assert_close(got, fn(x), atol=1e-5, rtol=1e-5)
