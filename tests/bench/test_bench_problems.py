"""Problem loading: KernelBench-format files, module:factory specs, level selection."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stitch_backend.bench.problems import (ProblemError, load_problem, parse_task_numbers,
                                           ref_for, select_kernelbench)
from stitch_backend.examples import list_examples, load_example

KB_ROOT = Path(__file__).resolve().parents[2] / "kb"

TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.lin = nn.Linear(n, n)

        def forward(self, x):
            return self.lin(x) * {scale}

    def get_inputs():
        return [torch.randn(2, 4)]

    def get_init_inputs():
        return [4]
""")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_load_file_gives_seeded_model_and_inputs(tmp_path):
    path = _write(tmp_path / "7_Scaled.py", TASK.format(scale=2))
    problem = load_problem(str(path))
    assert problem.name == "7_Scaled"
    assert problem.path == path.resolve()
    assert problem.init_inputs == [4]
    torch.manual_seed(0)
    a = problem.make_model()
    torch.manual_seed(0)
    b = problem.make_model()
    assert isinstance(a, torch.nn.Module) and a is not b
    assert torch.equal(a.lin.weight, b.lin.weight)      # same seed, same weights
    (x,) = problem.make_inputs()
    assert x.shape == (2, 4)
    assert torch.allclose(a(x), 2 * a.lin(x))


def test_two_files_with_same_stem_do_not_share_a_module(tmp_path):
    p1 = _write(tmp_path / "a" / "model.py", TASK.format(scale=1))
    p2 = _write(tmp_path / "b" / "model.py", TASK.format(scale=3))
    m1, m2 = load_problem(str(p1)), load_problem(str(p2))
    torch.manual_seed(0)
    x = torch.ones(2, 4)
    torch.manual_seed(1)
    a = m1.make_model()
    torch.manual_seed(1)
    b = m2.make_model()
    assert torch.allclose(3 * a(x), b(x))


def test_file_missing_kernelbench_functions_is_a_problem_error(tmp_path):
    path = _write(tmp_path / "bad.py", "import torch\nclass Model(torch.nn.Module):\n    pass\n")
    with pytest.raises(ProblemError, match="get_inputs"):
        load_problem(str(path))
    with pytest.raises(ProblemError, match="no such file"):
        load_problem(str(tmp_path / "absent.py"))


def test_factory_spec(tmp_path, monkeypatch):
    _write(tmp_path / "bench_factory_mod.py", textwrap.dedent("""
        import torch

        def make():
            model = torch.nn.Linear(3, 5)
            return model, [torch.randn(4, 3)]

        def broken():
            return torch.nn.Linear(3, 5)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = load_problem("bench_factory_mod:make")
    assert problem.name == "bench_factory_mod:make"
    assert problem.init_inputs == []
    torch.manual_seed(3)
    model = problem.make_model()
    (x,) = problem.make_inputs()
    assert model(x).shape == (4, 5)
    with pytest.raises(ProblemError, match=r"\(model, inputs\)"):
        load_problem("bench_factory_mod:broken").make_model()
    with pytest.raises(ProblemError, match="no callable"):
        load_problem("bench_factory_mod:absent")
    sys.modules.pop("bench_factory_mod", None)


def test_ref_for_does_not_execute(tmp_path):
    path = _write(tmp_path / "boom.py", "raise SystemExit('executed!')\n")
    ref = ref_for(str(path))
    assert ref.name == "boom" and ref.spec == str(path.resolve())
    assert ref_for("pkg.mod:factory").name == "pkg.mod:factory"
    with pytest.raises(ProblemError):
        ref_for("not_a_spec")


def test_parse_task_numbers():
    assert parse_task_numbers("1-3,5") == {1, 2, 3, 5}
    assert parse_task_numbers(" 7 ") == {7}
    for bad in ("a-b", "5-3", "", "1-"):
        with pytest.raises(ValueError):
            parse_task_numbers(bad)


def test_kernelbench_selection_sorted_by_task_number(tmp_path):
    level = tmp_path / "KernelBench" / "level2"
    for name in ("10_Big.py", "2_Two.py", "1_One.py"):
        _write(level / name, TASK.format(scale=1))
    _write(level / "helpers.py", "")                 # not a task: no leading number
    refs = select_kernelbench(tmp_path, 2)
    assert [r.name for r in refs] == ["level2/1_One", "level2/2_Two", "level2/10_Big"]
    assert [r.name for r in select_kernelbench(tmp_path, 2, "2-10")] == ["level2/2_Two", "level2/10_Big"]
    assert [r.name for r in select_kernelbench(tmp_path, 2, "1,10,99")] == ["level2/1_One", "level2/10_Big"]
    # the inner KernelBench folder works as the root too
    assert len(select_kernelbench(tmp_path / "KernelBench", 2)) == 3
    with pytest.raises(ProblemError, match="level3"):
        select_kernelbench(tmp_path, 3)
    # a selected file loads
    problem = load_problem(refs[2].spec)
    assert problem.name == "10_Big"


@pytest.mark.skipif(not (KB_ROOT / "KernelBench" / "level3").is_dir(), reason="no KernelBench checkout")
def test_real_kernelbench_level3_selection():
    refs = select_kernelbench(KB_ROOT, 3, "1-3,50")
    assert [r.name.split("_")[0] for r in refs] == ["level3/1", "level3/2", "level3/3", "level3/50"]
    assert len(select_kernelbench(KB_ROOT, 3)) == 50


def test_examples_load_and_run_in_fp32_and_fp64():
    paths = list_examples()
    names = {p.stem for p in paths}
    assert names >= {"mlp_gelu", "conv_bn_relu", "residual_block", "depthwise_separable",
                     "transformer_block", "softmax_rows", "gru_cell", "norm_zoo"}
    with torch.no_grad():
        for name in sorted(names):
            problem = load_example(name)
            torch.manual_seed(0)
            model = problem.make_model()
            assert model.training                        # KernelBench leaves training mode on
            inputs = problem.make_inputs()
            out = model(*inputs)
            out64 = model.double()(*[x.double() for x in inputs])
            outs = out if isinstance(out, tuple) else (out,)
            outs64 = out64 if isinstance(out64, tuple) else (out64,)
            for o, o64 in zip(outs, outs64):
                assert torch.isfinite(o).all(), name
                assert torch.allclose(o.double(), o64, atol=1e-3, rtol=1e-3), name
    with pytest.raises(KeyError, match="available"):
        load_example("no_such_example")


def test_coverage_counts_nodes_inside_generated_kernels(tmp_path):
    from stitch_backend.bench.coverage import coverage_of
    from stitch_backend.examples import list_examples

    softmax = next(p for p in list_examples() if p.stem == "softmax_rows")
    cov = coverage_of(str(softmax))
    assert cov.error is None and cov.total > 0
    assert 0 < cov.covered <= cov.total
