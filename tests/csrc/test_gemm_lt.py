"""csrc/runtime/gemm_lt.cu through stitch_backend.runtime.LtMatmul, checked against torch on the GPU.

fp32 strict must match eager (TF32 off) within 1e-4; TF32 must be as close to fp64 as
eager's TF32 is; fp16/bf16 within 1e-2. Backward epilogues are checked against autograd.
"""

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lt():
    from stitch_backend.runtime import LtMatmul

    m = LtMatmul()
    yield m
    m.close()


@pytest.fixture(autouse=True)
def _strict_fp32():
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _rand(*shape, dtype=None, seed=0, scale=1.0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype or torch.float32)


def _torch_epilogue(name, z):
    import torch.nn.functional as F

    if "RELU" in name:
        return z.relu()
    if "GELU" in name:
        return F.gelu(z, approximate="tanh")
    return z


FWD_EPILOGUES = ["DEFAULT", "BIAS", "RELU", "RELU_BIAS", "GELU", "GELU_BIAS"]
SHAPES = [(128, 256, 96), (1, 64, 33), (37, 129, 65), (256, 1024, 512)]


@pytest.mark.parametrize("epilogue", FWD_EPILOGUES)
@pytest.mark.parametrize("mkn", SHAPES)
def test_fp32_strict_matches_eager(lt, epilogue, mkn):
    import torch

    M, K, N = mkn
    a, b, bias = _rand(M, K, seed=1), _rand(K, N, seed=2), _rand(N, seed=3)
    use_bias = "BIAS" in epilogue
    out = lt.matmul(a, b, bias=bias if use_bias else None, epilogue=epilogue)
    ref = _torch_epilogue(epilogue, torch.addmm(bias, a, b) if use_bias else a @ b)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("epilogue", ["DEFAULT", "RELU_BIAS", "GELU_BIAS"])
def test_fp32_tf32_is_as_close_to_fp64_as_eager(lt, epilogue):
    import torch

    M, K, N = 256, 1024, 384
    a, b, bias = _rand(M, K, seed=4), _rand(K, N, seed=5), _rand(N, seed=6)
    use_bias = epilogue != "DEFAULT"
    kw = dict(bias=bias if use_bias else None, epilogue=epilogue)
    ref64 = _torch_epilogue(epilogue, (a.double() @ b.double()) + (bias.double() if use_bias else 0))
    torch.backends.cuda.matmul.allow_tf32 = True
    eager = _torch_epilogue(epilogue, torch.addmm(bias, a, b) if use_bias else a @ b)
    torch.backends.cuda.matmul.allow_tf32 = False
    tf32 = lt.matmul(a, b, allow_tf32=True, **kw)
    strict = lt.matmul(a, b, **kw)
    err = lambda x: (x.double() - ref64).abs().max().item()  # noqa: E731
    assert err(tf32) <= 2 * err(eager) + 1e-6, (err(tf32), err(eager))
    assert err(strict) < err(tf32) / 10, "allow_tf32=False gave TF32-level error"


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("epilogue", FWD_EPILOGUES)
def test_half_precision_matches_eager(lt, dtype_name, epilogue):
    import torch

    dtype = getattr(torch, dtype_name)
    M, K, N = 192, 320, 136
    a = _rand(M, K, dtype=dtype, seed=7, scale=K**-0.5)
    b, bias = _rand(K, N, dtype=dtype, seed=8), _rand(N, dtype=dtype, seed=9)
    use_bias = "BIAS" in epilogue
    out = lt.matmul(a, b, bias=bias if use_bias else None, epilogue=epilogue)
    assert out.dtype == dtype
    ref = _torch_epilogue(epilogue, (a.float() @ b.float()) + (bias.float() if use_bias else 0))
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("which", ["both", "a2d", "b2d"])
def test_batched(lt, which):
    import torch

    B, M, K, N = 4, 65, 96, 72
    a = _rand(M, K, seed=10) if which == "a2d" else _rand(B, M, K, seed=10)
    b = _rand(K, N, seed=11) if which == "b2d" else _rand(B, K, N, seed=11)
    bias = _rand(N, seed=12)
    out = lt.matmul(a, b, bias=bias, epilogue="RELU_BIAS")
    assert out.shape == (B, M, N)
    torch.testing.assert_close(out, (torch.matmul(a, b) + bias).relu(), rtol=1e-4, atol=1e-4)


def test_transposed_views_and_linear(lt):
    import torch
    import torch.nn.functional as F

    M, K, N = 50, 70, 90
    x, w, bias = _rand(M, K, seed=13), _rand(N, K, seed=14), _rand(N, seed=15)
    torch.testing.assert_close(lt.matmul(x, w, trans_b=True, bias=bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lt.matmul(x, w.t(), bias=bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    at = _rand(K, M, seed=16)  # a given as a transposed view
    torch.testing.assert_close(lt.matmul(at.t(), w.t()), at.t() @ w.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lt.matmul(at, w.t(), trans_a=True), at.t() @ w.t(), rtol=1e-4, atol=1e-4)


def test_strided_and_misaligned_operands(lt):
    import torch

    M, K, N = 33, 40, 24
    big = _rand(M * K + 1, seed=17)
    a = big[1:].view(M, K)  # 4-byte aligned only
    b = _rand(K, N + 8, seed=18)[:, :N]  # padded rows
    out_store = torch.full((M, N + 5), float("nan"), device="cuda")
    out = out_store[:, :N]
    lt.matmul(a, b, out=out)
    torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
    assert torch.isnan(out_store[:, N:]).all(), "wrote outside the output view"


def test_alpha_beta_c(lt):
    import torch

    M, K, N = 64, 48, 80
    a, b, c = _rand(M, K, seed=19), _rand(K, N, seed=20), _rand(M, N, seed=21)
    out = lt.matmul(a, b, alpha=0.5, beta=-2.0, c=c)
    torch.testing.assert_close(out, torch.addmm(c, a, b, beta=-2.0, alpha=0.5), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_gelu_aux_and_dgelu_match_autograd(lt, dtype_name):
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    M, K, N, P = 96, 64, 120, 56
    x = _rand(M, K, dtype=dtype, seed=22, scale=K**-0.5)
    w1, b1 = _rand(K, N, dtype=dtype, seed=23), _rand(N, dtype=dtype, seed=24)
    g, w2 = _rand(M, P, dtype=dtype, seed=25, scale=P**-0.5), _rand(P, N, dtype=dtype, seed=26)

    aux = lt.empty_aux("GELU_AUX_BIAS", (M, N), dtype, "cuda")
    y = lt.matmul(x, w1, bias=b1, epilogue="GELU_AUX_BIAS", aux=aux)
    z = (x.float() @ w1.float() + b1.float()).requires_grad_(True)
    torch.testing.assert_close(aux[:, :N].float(), z.detach(), rtol=tol, atol=tol)
    ref_y = F.gelu(z, approximate="tanh")
    torch.testing.assert_close(y.float(), ref_y.detach(), rtol=tol, atol=tol)

    dy = g @ w2
    ref_y.backward(dy.float())
    dz = lt.matmul(g, w2, epilogue="DGELU", aux=aux)
    torch.testing.assert_close(dz.float(), z.grad, rtol=tol, atol=tol)

    db = torch.empty(N, dtype=dtype, device="cuda")
    dz2 = lt.matmul(g, w2, epilogue="DGELU_BGRAD", aux=aux, bias=db)
    torch.testing.assert_close(dz2.float(), z.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(db.float(), z.grad.sum(0), rtol=tol, atol=tol * M**0.5)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_relu_aux_and_drelu_match_autograd(lt, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    M, K, N, P = 80, 64, 136, 48
    x = _rand(M, K, dtype=dtype, seed=27, scale=K**-0.5)
    w1, b1 = _rand(K, N, dtype=dtype, seed=28), _rand(N, dtype=dtype, seed=29)
    g, w2 = _rand(M, P, dtype=dtype, seed=30, scale=P**-0.5), _rand(P, N, dtype=dtype, seed=31)

    mask = lt.empty_aux("RELU_AUX_BIAS", (M, N), dtype, "cuda")
    y = lt.matmul(x, w1, bias=b1, epilogue="RELU_AUX_BIAS", aux=mask)
    z = (x.float() @ w1.float() + b1.float()).requires_grad_(True)
    ref_y = z.relu()
    torch.testing.assert_close(y.float(), ref_y.detach(), rtol=tol, atol=tol)

    dy = g @ w2
    ref_y.backward(dy.float())
    # Where z is within rounding of 0 the mask may legitimately differ from fp32's.
    settled = z.detach().abs() > 1e-3
    dz = lt.matmul(g, w2, epilogue="DRELU", aux=mask)
    torch.testing.assert_close(dz.float()[settled], z.grad[settled], rtol=tol, atol=tol)

    db = torch.empty(N, dtype=dtype, device="cuda")
    dz2 = lt.matmul(g, w2, epilogue="DRELU_BGRAD", aux=mask, bias=db)
    torch.testing.assert_close(dz2.float(), dz.float(), rtol=0, atol=0)
    torch.testing.assert_close(db.float(), dz.float().sum(0), rtol=tol, atol=tol * M**0.5)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_bias_gradients_bgrada_bgradb(lt, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    Mb, Nin, Nout = 128, 72, 40  # batch rows, layer in/out features
    x = _rand(Mb, Nin, dtype=dtype, seed=32)
    grad = _rand(Mb, Nout, dtype=dtype, seed=33, scale=Mb**-0.5)
    # dW = grad.T @ x with the bias gradient grad.sum(0) from BGRADB (torch's a = grad.T).
    db = torch.empty(Nout, dtype=dtype, device="cuda")
    dw = lt.matmul(grad, x, trans_a=True, epilogue="BGRADB", bias=db)
    torch.testing.assert_close(dw.float(), grad.float().t() @ x.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(db.float(), grad.float().sum(0), rtol=tol, atol=tol)
    # dW^T = x.T @ grad with the same bias gradient from BGRADA (torch's b = grad).
    db2 = torch.empty(Nout, dtype=dtype, device="cuda")
    dwt = lt.matmul(x, grad, trans_a=True, epilogue="BGRADA", bias=db2)
    torch.testing.assert_close(dwt.float(), x.float().t() @ grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(db2.float(), grad.float().sum(0), rtol=tol, atol=tol)


def test_heuristics_algo_index_and_tune(lt):
    import torch

    from stitch_backend.runtime import LtMatmulError

    a, b = _rand(512, 512, seed=34), _rand(512, 512, seed=35)
    count = lt.heuristics(a, b, max_algos=8)
    assert 1 <= count <= 8
    for idx in range(count):
        torch.testing.assert_close(lt.matmul(a, b, algo_index=idx), a @ b, rtol=1e-4, atol=1e-4)
    with pytest.raises(LtMatmulError, match="algo_index"):
        lt.matmul(a, b, algo_index=63)
    best = lt.tune(a, b, max_algos=4, iters=5)
    assert 0 <= best < min(count, 4)


def test_argument_errors(lt):
    a, b = _rand(8, 16), _rand(16, 4)
    with pytest.raises(ValueError, match="share one of"):
        lt.matmul(a, b.half())
    with pytest.raises(ValueError, match="inner dimensions"):
        lt.matmul(a, a)
    with pytest.raises(ValueError, match="needs bias"):
        lt.matmul(a, b, epilogue="RELU_BIAS")
    with pytest.raises(ValueError, match="needs aux"):
        lt.matmul(a, b, epilogue="GELU_AUX")
    with pytest.raises(ValueError, match="unknown epilogue"):
        lt.matmul(a, b, epilogue="SWISH")
    with pytest.raises(ValueError, match="allow_tf32"):
        lt.matmul(a.half(), b.half(), allow_tf32=True)


def test_cuda_graph_capture(lt):
    import torch

    a, b, bias = _rand(64, 32, seed=36), _rand(32, 48, seed=37), _rand(48, seed=38)
    out = torch.empty(64, 48, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lt.matmul(a, b, bias=bias, epilogue="RELU_BIAS", out=out)  # warm-up: plan + workspace on this stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        lt.matmul(a, b, bias=bias, epilogue="RELU_BIAS", out=out)
    out.zero_()
    a.copy_(_rand(64, 32, seed=39))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.addmm(bias, a, b).relu(), rtol=1e-4, atol=1e-4)
