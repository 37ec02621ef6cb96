"""The CPU sweep tool: KernelBench-format problems shrunk and run through the interpreter."""

from __future__ import annotations

import textwrap

from stitch_backend.bench.cpu_sweep import main, shrink

TOY = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self, features, groups):
            super().__init__()
            self.fc = nn.Linear(features, features)
            self.norm = nn.GroupNorm(groups, features)

        def forward(self, x):
            return torch.softmax(self.norm(torch.relu(self.fc(x))) * 2.0, dim=-1)

    batch_size = 128
    features = 4096
    num_groups = 64

    def get_inputs():
        return [torch.randn(batch_size, features)]

    def get_init_inputs():
        return [features, num_groups]
""")

BROKEN = TOY.replace("self.fc = nn.Linear(features, features)", "raise ValueError('no')")


def test_shrink_rewrites_batch_sizes_and_groups_only():
    text = shrink("batch_size = 128\nfeatures = 4096\nnum_groups = 64\nkernel_size = 3\n"
                  "scale = 2.0\nheight = width = 224\n")
    assert text.splitlines() == ["batch_size = 2", "features = 32", "num_groups = 8",
                                 "kernel_size = 3", "scale = 2.0", "height = width = 32"]
    assert "features = 4096" in shrink("features = 4096\n", sizes=False)


def test_shrink_rewrites_lists_of_sizes():
    text = shrink("hidden_layer_sizes = [32768, 16]\nlayer_sizes = [1024] * 16  # deep\n"
                  "strides = [2, 64]\n")
    assert text.splitlines() == ["hidden_layer_sizes = [32, 16]",
                                 "layer_sizes = [32] * 16  # deep", "strides = [2, 64]"]
    assert "[32768, 16]" in shrink("hidden_layer_sizes = [32768, 16]\n", sizes=False)


def test_shrink_reads_products_and_tuples_of_sizes():
    """L1 98 (KLDivLoss): ``batch_size = 8192 * 2`` and ``input_shape = (8192 * 2,)``
    kept whole made 16384 x 16384 inputs, and the OOM killer ended the sweep."""
    text = shrink("batch_size = 8192 * 2\ninput_shape = (8192 * 2,)\ndim = 4 * 1024\n"
                  "kernel_shape = (3, 64)\n")
    assert text.splitlines() == ["batch_size = 2", "input_shape = (32,)", "dim = 32",
                                 "kernel_shape = (3, 32)"]


def test_a_sweep_runs_training_steps_and_says_what_broke(tmp_path, capsys):
    level = tmp_path / "level2"
    level.mkdir()
    (level / "1_Toy.py").write_text(TOY)
    assert main([str(tmp_path), "2"]) == 0
    out = capsys.readouterr().out
    assert "level2/1_Toy: ok (" in out and "graphs f,b" in out and "1 of 1 ok" in out
    kernels = int(out.split("ok (", 1)[1].split(" kernels", 1)[0])
    assert kernels > 0
    assert main([str(tmp_path), "2", "--autocast", "bf16", "--batches"]) == 0
    out = capsys.readouterr().out
    assert "f*" in out and "b*" in out, out
    (level / "2_Broken.py").write_text(BROKEN)
    assert main([str(tmp_path), "2", "--problems", "2"]) == 1
    out = capsys.readouterr().out
    assert "level2/2_Broken: ERROR ValueError: no" in out and "0 of 1 ok" in out


def test_a_graph_the_backend_could_not_compile_is_not_called_ok(tmp_path, capsys, monkeypatch):
    """Right results through a graph that ran as traced after the backend failed on it
    are UNCOMPILED, and the sweep exits 1 (L3 46/47's backward graphs read "ok")."""
    from stitch_backend.backend import StitchBackend

    def broken(self, stage, *args, **kwargs):
        if stage == "backward":
            raise ValueError("planner bug")
        return real(self, stage, *args, **kwargs)

    real = StitchBackend._compile_graph
    monkeypatch.setattr(StitchBackend, "_compile_graph", broken)
    level = tmp_path / "level2"
    level.mkdir()
    (level / "1_Toy.py").write_text(TOY)
    assert main([str(tmp_path), "2"]) == 1
    out = capsys.readouterr().out
    assert "level2/1_Toy: UNCOMPILED (" in out and "planner bug" in out
    assert "0 of 1 ok, 1 with a graph the backend could not compile" in out


LAMBDA = TOY.replace(
    "        self.norm = nn.GroupNorm(groups, features)",
    "        self.norm = nn.GroupNorm(groups, features)\n"
    "        fc = self.fc\n"
    "        self.head = lambda x: fc(x)   # as L3 44's mlpf: a closure over a submodule")
LAMBDA = LAMBDA.replace("torch.relu(self.fc(x))", "torch.relu(self.head(x))")


def test_models_holding_a_closure_over_their_layers_are_built_not_copied(tmp_path, capsys):
    """A deep copy shares the closure, so the fp64 copy ran the float model's layer
    ("mat1 and mat2 must have the same dtype") and the compiled copy the eager one's."""
    level = tmp_path / "level3"
    level.mkdir()
    (level / "1_Closure.py").write_text(LAMBDA)
    assert main([str(tmp_path), "3"]) == 0
    out = capsys.readouterr().out
    assert "level3/1_Closure: ok (" in out, out


STATEFUL = TOY.replace(
    "        return torch.softmax(self.norm(torch.relu(self.fc(x))) * 2.0, dim=-1)",
    "        y = torch.relu(self.fc(x))\n"
    "        y.mul_(2.0)   # in place on what relu's backward saved: eager's backward raises\n"
    "        return torch.softmax(self.norm(y), dim=-1)")
assert STATEFUL != TOY


def test_a_problem_whose_eager_step_raises_is_not_run_not_failed(tmp_path, capsys):
    level = tmp_path / "level3"
    level.mkdir()
    (level / "1_Stateful.py").write_text(STATEFUL)
    (level / "2_Toy.py").write_text(TOY)
    assert main([str(tmp_path), "3"]) == 0
    out = capsys.readouterr().out
    assert "level3/1_Stateful: NOT RUN: eager's own step raises RuntimeError" in out, out
    assert "level3/2_Toy: ok (" in out and "1 of 2 ok, 1 not run" in out
