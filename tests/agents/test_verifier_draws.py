"""Fresh draws (CPU): same seed, same draws; each device its own generator; the global
generator untouched; integer inputs stay permutations (indices remain valid)."""

from __future__ import annotations

import torch

from stitch_backend.agents.verifier import DeviceGenerators, fresh_draw


def test_draws_are_reproducible_and_leave_the_global_generator_alone():
    x = torch.randn(64, 32) * 3 + 1
    idx = torch.arange(50)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = fresh_draw([x, idx, 5], DeviceGenerators(1))
    b = fresh_draw([x, idx, 5], DeviceGenerators(1))
    c = fresh_draw([x, idx, 5], DeviceGenerators(2))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert a[0].shape == x.shape and a[0].stride() == x.stride()
    assert abs(float(a[0].mean()) - float(x.mean())) < 0.5     # around the real values
    assert torch.equal(a[1].sort().values, idx) and a[2] == 5
    # one plain generator still works (its device draws)
    d = fresh_draw([x], torch.Generator().manual_seed(1))
    assert d[0].shape == x.shape


def test_one_generator_per_device():
    gens = DeviceGenerators(3)
    assert gens(torch.device("cpu")) is gens(torch.device("cpu"))
    assert gens(torch.device("cpu")).initial_seed() == 3
