"""On a GPU: replayed Programs write mutated inputs back exactly once a call, and replay
turns itself off where it is slower than running uncaptured."""

from __future__ import annotations

import copy

import pytest
import torch

from stitch_backend.backend import StitchBackend
from tests.backend.test_mutations import _Counting

pytestmark = pytest.mark.gpu


def _replay_notes(backend):
    (rec,) = backend.records
    return [n for n in rec.notes if "replay" in n or "uncaptured" in n]


def test_replayed_training_mode_batchnorm_updates_its_statistics_once_a_call():
    """KernelBench's way (training mode under no_grad): running statistics and the step
    counter are written inside the CUDA graph; a user input mutated in place after it."""
    torch.manual_seed(0)
    model = _Counting().cuda().train()
    ref = copy.deepcopy(model)
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    acc, ref_acc = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    with torch.no_grad():
        for _ in range(6):   # verification, warm-up, first replay (checked, timed), replays
            x = torch.randn(2, 3, 8, 8, device="cuda")
            torch.testing.assert_close(compiled(x, acc), ref(x, ref_acc), atol=1e-4, rtol=1e-4)
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 6
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    torch.testing.assert_close(acc, ref_acc)
    notes = _replay_notes(backend)
    assert any(n.startswith("CUDA graph replay on") for n in notes), notes
    assert any(n.startswith("one call:") for n in notes), notes   # the first replay was timed
    assert not any("differed" in n or "capture failed" in n for n in notes), notes


def test_replay_is_turned_off_where_copies_cost_more_than_launches():
    """One pointwise kernel over 1 GiB: a replay adds a 1 GiB copy in and out."""
    model = torch.nn.Hardtanh().cuda()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(256 * 2**20, device="cuda")
    with torch.no_grad():
        outs = [compiled(x) for _ in range(4)]
    for y in outs:
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    notes = _replay_notes(backend)
    assert any("replay off: slower than running uncaptured" in n for n in notes), notes


class _SlicedState(torch.nn.Module):
    """Returns a slice of a wider intermediate, as KernelBench's Mamba2 final state is:
    eager's output is a view with gaps in its strides."""

    def forward(self, x):
        y = torch.tanh(x) * 2.0
        return y[..., 16:32], y.sum(-1)


def test_replayed_outputs_keep_eagers_strides():
    model = _SlicedState().cuda()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8, 64, 48, device="cuda")
            got, ref = compiled(x), model(x)
            for g, r in zip(got, ref):
                assert g.stride() == r.stride() and g.shape == r.shape
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert any(n.startswith("CUDA graph replay on") for n in _replay_notes(backend))
