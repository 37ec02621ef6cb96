"""cuBLASLt's algorithm choice (``lt_ops._choose``): timed once per problem, remembered
by the process and, with the cache on, stored for other processes; never timed inside a
capture; a stored value that is not a timed index is ignored. The library is a stand-in
here (the real call is GPU-tested in tests/csrc/test_gemm_lt.py and
tests/agents/test_lt_alternative.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from stitch_backend import lt_ops, runtime
from stitch_backend.cache import Store


class FakeLt:
    def __init__(self, best: int):
        self.best, self.tuned, self.ran = best, 0, []

    def tune(self, a, b, **kw):
        self.tuned += 1
        return self.best

    def matmul(self, a, b, *, bias=None, epilogue, allow_tf32, algo_index):
        self.ran.append(algo_index)
        return a @ b + (bias if bias is not None else 0)


class FakeLib:
    @staticmethod
    def sc_lt_cublaslt_version():
        return 130100


@pytest.fixture
def fake(monkeypatch):
    lt = FakeLt(best=2)
    monkeypatch.setattr(lt_ops, "_lt", lt)
    monkeypatch.setattr(lt_ops, "_algos", {})
    monkeypatch.setattr(lt_ops, "_store", None)
    monkeypatch.setattr(runtime, "load_runtime", lambda: FakeLib())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # the CPU allocator's alignment varies between calls; CUDA's caching allocator's
    # blocks are 512-byte aligned (the key's own alignment term is tested below)
    monkeypatch.setattr(lt_ops, "_alignment", lambda t: 0 if t is None else 256)
    return lt


def _call(bias=True):
    torch.manual_seed(0)
    a, b, c = torch.randn(20, 32), torch.randn(32, 48), torch.randn(48)
    out = lt_ops.lt_addmm(c, a, b, "BIAS") if bias else lt_ops.lt_mm(a, b, "DEFAULT")
    torch.testing.assert_close(out, a @ b + (c if bias else 0))


def test_timed_once_per_problem_in_a_process(fake):
    _call()
    _call()
    assert fake.tuned == 1 and fake.ran == [2, 2]
    _call(bias=False)                      # another problem: timed on its own
    assert fake.tuned == 2


def test_the_cache_keeps_the_choice_for_the_next_process(fake, monkeypatch, tmp_path):
    lt_ops.remember_in(Store(str(tmp_path)))
    _call()
    assert fake.tuned == 1
    monkeypatch.setattr(lt_ops, "_algos", {})          # a new process, same cache
    _call()
    assert fake.tuned == 1 and fake.ran == [2, 2]
    monkeypatch.setattr(lt_ops, "_algos", {})
    lt_ops.remember_in(None)                           # no cache: timed again
    _call()
    assert fake.tuned == 2


@pytest.mark.parametrize("stored", [99, -1, "2", True, None, [2]])
def test_a_stored_value_that_is_not_a_timed_index_is_ignored(fake, monkeypatch, tmp_path,
                                                              stored):
    store = Store(str(tmp_path))
    lt_ops.remember_in(store)
    _call()
    (path,) = [p for p in (tmp_path / "notes").rglob("*") if p.is_file()]
    monkeypatch.setattr(lt_ops, "_algos", {})
    real_read = store.read_note
    monkeypatch.setattr(store, "read_note",
                        lambda kind, key: stored if real_read(kind, key) is not None else None)
    _call()
    assert fake.tuned == 2 and path.exists()


def test_not_timed_inside_a_capture(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _call()
    assert fake.tuned == 0 and fake.ran == [0] and lt_ops._algos == {}


def test_the_operands_alignment_is_part_of_the_problem():
    """cuBLASLt's heuristics are told each pointer's alignment (csrc/runtime/gemm_lt.cu),
    so an operand 4 bytes off is another problem."""
    base = torch.randn(20 * 32 + 1)
    a, shifted = base[:640].view(20, 32), base[1:].view(20, 32)
    b = torch.randn(32, 48)
    assert lt_ops._alignment(a) >= 16 and lt_ops._alignment(shifted) == 4
    assert lt_ops._problem(a, b, None, "DEFAULT", False) != lt_ops._problem(
        shifted, b, None, "DEFAULT", False)


@pytest.mark.gpu
def test_on_cuda_a_cached_compile_stores_the_choice(tmp_path, monkeypatch):
    """A compile with the cache on stores the algorithm its library candidate timed; a
    fresh process (the memo cleared) reads it back instead of timing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine with -m gpu)")
    from stitch_backend.backend import StitchBackend

    monkeypatch.setattr(lt_ops, "_algos", {})
    model = torch.nn.Linear(32, 48).cuda()
    x = torch.randn(20, 32, device="cuda")
    torch._dynamo.reset()
    backend = StitchBackend(options={"cache_dir": str(tmp_path), "eager_guard": False})
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x),
                                   rtol=1e-4, atol=1e-4)
    chosen = dict(lt_ops._algos)
    assert chosen, "the library candidate never ran"
    notes = [p for p in (tmp_path / "notes").rglob("*") if p.is_file()]
    assert notes
    monkeypatch.setattr(lt_ops, "_algos", {})
    monkeypatch.setattr(lt_ops._lt, "tune", lambda *a, **k: pytest.fail("timed again"))
    a, w = x, model.weight.t()
    lt_ops.lt_addmm(model.bias, a, w, "BIAS")
    torch.cuda.synchronize()
