"""Selection indices (max pooling's, max.dim's, argmax's) that differ from eager's only
where the values they select are nearly equal are judged as eager's; other differences
still fail the end-to-end check."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.agents.ties import settle

aten = torch.ops.aten


def _pool_graph(x, dims=2):
    op = aten.max_pool2d_with_indices if dims == 2 else aten.max_pool3d_with_indices

    def fn(x):
        y = x * 1.0
        vals, idx = op(y, [2] * dims)
        return y, vals, idx

    return make_fx(fn)(x), fn


def _near_tie_input(dims=2):
    """An input whose first window holds two values 1e-6 apart at positions 0 and 1."""
    torch.manual_seed(0)
    x = torch.randn((2, 3) + (4,) * dims)
    window = (0, 0) + (0,) * dims                  # flat position 0 of the first window
    other = (0, 0) + (0,) * (dims - 1) + (1,)      # flat position 1, the same window
    x[window] = 5.0
    x[other] = 5.0 - 1e-6
    return x, window, other


def _swap_first_pick(idx, dims):
    """Eager's indices with the first window's pick moved to flat position 1."""
    ours = idx.clone()
    lead = (0, 0) + (0,) * dims
    ours[lead] = 1
    return ours


def test_a_near_tie_in_a_max_pooling_is_judged_as_eager():
    for dims in (2, 3):
        x, window, other = _near_tie_input(dims)
        gm, fn = _pool_graph(x, dims)
        y, vals, idx = fn(x)
        assert idx[(0, 0) + (0,) * dims] == 0
        ours = _swap_first_pick(idx, dims)
        got, settled = settle(gm, [x], (y, vals, ours), (y, vals, idx))
        assert torch.equal(got[2], idx)
        assert [(s.output, s.differing, s.total) for s in settled] == [(2, 1, idx.numel())]


def test_a_clearly_smaller_pick_still_differs():
    x, window, other = _near_tie_input()
    x[other] = 4.0                          # 1.0 below the maximum: no tie
    gm, fn = _pool_graph(x)
    y, vals, idx = fn(x)
    ours = _swap_first_pick(idx, 2)
    got, settled = settle(gm, [x], (y, vals, ours), (y, vals, idx))
    assert settled == [] and torch.equal(got[2], ours)


def test_indices_whose_values_are_not_at_hand_are_not_settled():
    x, _, _ = _near_tie_input()

    def fn(x):                               # the pooled input is neither output nor input
        vals, idx = aten.max_pool2d_with_indices(x * 1.0, [2, 2])
        return vals, idx

    gm = make_fx(fn)(x)
    vals, idx = fn(x)
    ours = _swap_first_pick(idx, 2)
    got, settled = settle(gm, [x], (vals, ours), (vals, idx))
    assert settled == [] and torch.equal(got[1], ours)


def test_out_of_range_indices_are_no_tie():
    x, _, _ = _near_tie_input()
    gm, fn = _pool_graph(x)
    y, vals, idx = fn(x)
    ours = idx.clone()
    ours[0, 0, 0, 0] = 10_000
    got, settled = settle(gm, [x], (y, vals, ours), (y, vals, idx))
    assert settled == [] and torch.equal(got[2], ours)


def test_max_dim_and_argmax_ties_over_graph_inputs():
    x = torch.randn(4, 6)
    x[1, 2] = 3.0
    x[1, 4] = 3.0 + 2e-5          # within 1e-4 relative of 3.0

    def fn(x):
        m, i = aten.max.dim(x, 1)
        return m, i, aten.argmax.default(x, 1, True), aten.argmax.default(x)

    gm = make_fx(fn)(x)
    m, i, a, flat = fn(x)
    assert i[1] == 4 and a[1, 0] == 4
    i_ours, a_ours = i.clone(), a.clone()
    i_ours[1], a_ours[1, 0] = 2, 2
    got, settled = settle(gm, [x], (m, i_ours, a_ours, flat), (m, i, a, flat))
    assert [s.output for s in settled] == [1, 2]
    assert torch.equal(got[1], i) and torch.equal(got[2], a)
    # the flat argmax over the whole tensor: position (1, 2) against (1, 4)
    x2 = x.clone()
    x2[1, 4] = 100.0
    x2[1, 2] = 100.0 - 1e-3        # 1e-5 relative: a tie at fp32's tolerance
    flat_eager = aten.argmax.default(x2)
    got, settled = settle(gm, [x2], (m, i, a, torch.tensor(1 * 6 + 2)), (m, i, a, flat_eager))
    assert [s.output for s in settled] == [3]


def test_a_training_step_with_max_pooling_keeps_its_kernels_when_picks_tie(monkeypatch):
    """Through the backend (CPU interpreter): a fused kernel that rounds so that one
    window's pick moves to a near tie no longer sends the graph back to ATen."""
    from stitch_backend import kernels
    from stitch_backend.backend import StitchBackend

    class Net(torch.nn.Module):
        def forward(self, x, w):
            y = torch.relu(x * w + 0.5)
            return torch.nn.functional.max_pool2d(y, 2).sum()

    x, _, _ = _near_tie_input()
    x = x - 0.5
    w = torch.ones(4, 4, requires_grad=True)
    original = kernels.InterpretedRunner.__call__

    def rounds_differently(self, *args):
        outs = original(self, *args)
        for o in outs:   # the second of the tied pair 2e-6 up: now the larger
            if o.is_floating_point() and o.shape == x.shape:
                o[0, 0, 0, 1] += 2e-6
        return outs

    monkeypatch.setattr(kernels.InterpretedRunner, "__call__", rounds_differently)
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False})
    loss = torch.compile(Net(), backend=backend)(x, w)
    loss.backward()
    forward = next(r for r in backend.records if r.stage == "forward")
    assert any(r.backend == "kernel" for r in forward.plan.regions), backend.report()
    assert any("near tie" in n for n in forward.notes), forward.notes
    torch.testing.assert_close(loss, Net()(x, w.detach()))


def test_values_that_differ_from_eager_widen_the_tie_by_twice_their_difference():
    """bf16 values under autocast differ from eager's by an ulp. Here the Program's values
    differ from eager's by up to 1e-3, which moves the first window's maximum to the
    other position, 1.9e-3 above (more than 1e-4 of 5.0, less than 2 x 1e-3 more): a
    tie. A pick of a position 1e-2 below the maximum is not."""
    x, window, other = _near_tie_input()
    gm, fn = _pool_graph(x)
    y, vals, idx = fn(x)
    ours_y = y.clone()
    ours_y[window] = 5.0 - 1e-3
    ours_y[other] = 5.0 - 1e-6 + 9e-4
    ours = _swap_first_pick(idx, 2)                   # flat position 1: ``other``
    got, settled = settle(gm, [x], (ours_y, vals, ours), (y, vals, idx))
    assert [s.output for s in settled] == [2] and torch.equal(got[2], idx)
    third = (0, 0, 1, 0)                              # flat position 4, the same window
    ours_y[third] = ours_y[window] - 1e-2
    y3 = y.clone()
    y3[third] = ours_y[third]
    ours = idx.clone()
    ours[0, 0, 0, 0] = 4
    got, settled = settle(gm, [x], (ours_y, vals, ours), (y3, vals, idx))
    assert settled == [] and torch.equal(got[2], ours)


def _relu_mask_graph(x):
    """A training forward's ReLU: its output and the mask the backward reads."""
    def fn(x):
        y = torch.relu(x * 2.0)
        return y, aten.le.Scalar(aten.alias.default(y), 0)

    return make_fx(fn)(x), fn


def test_a_relu_mask_that_differs_only_at_the_threshold_is_judged_as_eager():
    """Eager's pre-activation 1e-7 above zero, the Program's at zero: the masks differ
    there and nowhere else, and the values agree within tolerance: a near tie."""
    x = torch.randn(4, 8)
    x[0, 0] = 5e-8
    gm, fn = _relu_mask_graph(x)
    y, mask = fn(x)
    assert not mask[0, 0]
    ours_y = y.clone()
    ours_y[0, 0] = 0.0
    ours_mask = mask.clone()
    ours_mask[0, 0] = True
    got, settled = settle(gm, [x], (ours_y, ours_mask), (y, mask))
    assert torch.equal(got[1], mask)
    assert [(s.output, s.differing, s.total) for s in settled] == [(1, 1, mask.numel())]


def test_a_relu_mask_that_differs_away_from_the_threshold_still_differs():
    x = torch.randn(4, 8)
    x[0, 0] = 0.5
    gm, fn = _relu_mask_graph(x)
    y, mask = fn(x)
    ours_mask = mask.clone()
    ours_mask[0, 0] = True                    # the value is 1.0: no tie
    got, settled = settle(gm, [x], (y, ours_mask), (y, mask))
    assert settled == [] and torch.equal(got[1], ours_mask)
