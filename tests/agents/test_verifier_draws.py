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


def _lean_check(candidate, monkeypatch):
    """Verifier.check of ``candidate`` against x * 2 (CPU, untimed), recording how many
    draws' inputs were alive at each eager call and how many fp64 runs it made."""
    import gc
    import weakref

    from stitch_backend.agents import verifier as verifier_mod

    seen: list[weakref.ref] = []
    alive: list[int] = []
    fp64_runs = []

    def eager(x):
        gc.collect()
        alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(x))
        return (x * 2,)

    real_fp64 = verifier_mod.run_fp64

    def counted_fp64(fn, args):
        fp64_runs.append(1)
        return real_fp64(fn, args)

    monkeypatch.setattr(verifier_mod, "run_fp64", counted_fp64)
    x = torch.randn(64, 32)
    settings = verifier_mod.VerifySettings(draws=3)
    verdict = verifier_mod.Verifier(settings).check(candidate, eager, [x])
    return verdict, alive[1:], fp64_runs   # alive[0]: the caller's own inputs' call


def test_check_holds_one_draw_at_a_time_and_runs_fp64_only_where_1e4_fails(monkeypatch):
    """A region of 6 GiB inputs ran the Verifier out of memory on an 80 GiB H100 while it
    held every draw, every reference and every fp64 run at once. Now each draw's tensors
    are freed before the next is made (besides the caller's inputs, at most the one
    being checked is alive at an eager call), and the fp64 run is made only for a draw
    whose result misses 1e-4 of eager."""
    exact, alive, fp64 = _lean_check(lambda x: (x * 2,), monkeypatch)
    assert exact.ok and exact.draws == 4, exact
    assert alive and max(alive) == 1, alive     # the caller's inputs only
    assert fp64 == []                           # within 1e-4 of eager: no fp64 run
    # 1e-3 off everywhere: beyond 1e-4 of eager, and farther from fp64 than eager is
    off, _, fp64 = _lean_check(lambda x: (x * 2 + 1e-3,), monkeypatch)
    assert not off.ok and off.correct is False and "wrong result" in off.reason
    assert fp64 == [1]                          # the first draw failed: one fp64 run
