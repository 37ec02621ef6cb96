"""fp32 exponentials and divisions in their fast forms (``codegen.fast_math``,
``generate(fast_math=True)``): what the source holds, what is left accurate, what has
nothing to make fast, the interpreter's values, nvcc for sm_90a; on the GPU, eager's
values within the checks' tolerance and the same bits twice."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.codegen import generate
from stitch_backend.codegen.fast_math import why_not_fast
from stitch_backend.codegen.fused import Unsupported

from .checks import assert_compiles_for_sm90a, assert_eager_values


def _trace(fn, *inputs):
    return make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*inputs)


# name: (function, shapes, layout)
CASES = {
    "softmax_cluster": (lambda a: torch.softmax(a, 1), [(6, 32768)], "cluster"),
    "softmax_inner": (lambda a: torch.softmax(a, 1), [(7, 5000)], None),
    "log_softmax": (lambda a: torch.log_softmax(a, 1), [(5, 3000)], None),
    "l2norm_cluster": (lambda a: a / torch.norm(a, p=2, dim=1, keepdim=True), [(4, 32768)],
                       "cluster"),
    "gelu_exp": (lambda a, b: torch.exp(a) / b + F.gelu(a), [(64, 33), (64, 33)], None),
}


def _inputs(what, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(len(what))
    return [torch.randn(*s, device=device, generator=gen) for s in CASES[what][1]]


def _kernel(what, fast=True, device="cpu"):
    fn, _, layout = CASES[what]
    xs = _inputs(what, device)
    return generate(_trace(fn, *xs), f"f_{what}", layout=layout, fast_math=fast), fn, xs


def test_a_fast_softmax_takes_expf_intrinsics_and_multiplies_by_the_sums_reciprocal_once_a_row():
    """The header switch that makes the online statistics fast, ``__expf`` for the stores'
    exp, and the division by the row's sum as a multiply by a reciprocal declared before
    the store loops (once a row); the accurate kernel has none of these."""
    k, _, _ = _kernel("softmax_cluster")
    src = k.source
    assert "#define SFK_FAST_EXP 1" in src.split('#include "fused_ops.cuh"')[0]
    assert "expf(" not in src.replace("__expf(", "")
    assert src.count("__expf(") == 2                    # the vector pass and the scalar pass
    (recip,) = re.findall(r"const float (t\d+) = \(1\.0f / \(\(float\)acc0\.s\)\);", src)
    assert src.index(f"const float {recip} =") < src.index("sfk_stv<4>(out0")
    assert len(re.findall(rf"\* {recip}\)", src)) == 2
    assert not re.search(r"\(t\d+ / \(\(float\)acc0\.s\)\)", src)
    # the vector passes add a chunk's lanes at once, the scalar pass one element at a time
    assert src.count("acc0 = sfk_online_addv(acc0, sfk_x0);") == 2
    assert src.count("sfk_x0[v] = ") == 2 and src.count("float sfk_x0[4];") == 2
    assert src.count("sfk_online_add(acc0, ") == 1
    plain = _kernel("softmax_cluster", fast=False)[0].source
    assert "SFK_FAST_EXP" not in plain and "__expf" not in plain
    assert "sfk_online_addv" not in plain and plain.count("sfk_online_add(acc0, ") == 3
    assert plain.count(" / ((float)acc0.s))") == 2


def test_a_division_by_a_value_of_the_element_stays_a_division():
    """exp(a) / b divides by an element of b: only the exp is fast; the erf of the GELU
    keeps its accurate form."""
    k, _, _ = _kernel("gelu_exp")
    src = k.source
    assert "__expf(" in src and "sfk_gelu_erf(" in src
    assert re.search(r"= \(t\d+ / t\d+\);", src), src
    assert "1.0f /" not in src


def test_kernels_with_nothing_to_make_fast_are_refused_with_the_reason():
    x = torch.randn(8, 4096)
    # a LayerNorm divides once a row (the sums by the row length): nothing an element
    for fn in (lambda a: a.sum(1), lambda a: a * 2 + 1, lambda a: torch.amax(a, 1),
               lambda a: F.layer_norm(a, (4096,))):
        gm = _trace(fn, x)
        with pytest.raises(Unsupported, match="no fp32 exp"):
            generate(gm, "k", fast_math=True)
    d = _trace(lambda a: a.double().softmax(1), x)
    with pytest.raises(Unsupported, match="no fp32 exp"):
        generate(d, "k", fast_math=True)
    assert why_not_fast(generate(_trace(lambda a: torch.softmax(a, 1), x), "k").ir) is None


@pytest.mark.parametrize("what", sorted(CASES))
def test_the_fast_kernels_ir_gives_eagers_values_in_the_interpreter(what):
    """The rewrite (multiply by a reciprocal) keeps the region's meaning: the interpreter
    of the fast IR gives eager's values."""
    k, fn, xs = _kernel(what)
    assert k.ir.fast_math
    (got,) = k.interpret(xs)
    torch.testing.assert_close(got, fn(*xs), atol=1e-5, rtol=1e-5)


def test_every_fast_kernel_compiles_for_sm90a():
    assert_compiles_for_sm90a([_kernel(w)[0] for w in sorted(CASES)], "fast_math_cases")


@pytest.mark.gpu
@pytest.mark.parametrize("what", sorted(CASES))
def test_a_fast_kernel_gives_eagers_values_on_the_gpu(what):
    k, fn, xs = _kernel(what, device="cuda")
    assert_eager_values(k, fn, xs)


@pytest.mark.gpu
def test_the_fast_online_softmax_keeps_eagers_special_values_on_the_gpu():
    """A chunk's maximum first (``sfk_online_addv``) must end where eager does on rows of
    -inf (NaN: 0/0), a NaN (NaN), a +inf (NaN beside it, exp(inf - inf)), -inf among finite
    values (0 there) and values far below the row's maximum (underflow to 0)."""
    x = torch.randn(6, 32768, generator=torch.Generator().manual_seed(3))
    x[0] = -torch.inf
    x[1, 100] = torch.nan
    x[2, 5000] = torch.inf
    x[3, ::7] = -torch.inf
    x[4, :16384] -= 200.0
    x[5, 32767] = 80.0
    k = generate(_trace(CASES["softmax_cluster"][0], x), "f_special", layout="cluster",
                 fast_math=True)
    assert_eager_values(k, CASES["softmax_cluster"][0], [x.cuda()], equal_nan=True)
