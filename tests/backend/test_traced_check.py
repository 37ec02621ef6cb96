"""A Program's first call judged against the graph as traced (traced_check.py): the
Program's outputs where they meet DESIGN.md's rule, else the traced graph's, with the
reason remembered; a check that cannot run is no verdict; random draws are the same in
both runs and the generators end where the Program's run left them."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.traced_check import TracedCheck, judged


def _gm(fn, *inputs):
    return make_fx(fn)(*inputs)


def _check(fn, x):
    remembered: list[str] = []
    return TracedCheck(_gm(fn, x), "the test's rewrite", remembered.append), remembered


def test_outputs_that_meet_the_rule_are_the_programs():
    x = torch.randn(64)
    check, remembered = _check(lambda a: (a * 2).sum(), x)
    got = (x * 2).sum() * (1 + 1e-7)
    out, why = judged(check, [x], lambda: got)
    assert why is None and out is got and not remembered


def test_outputs_that_miss_it_are_the_traced_graphs_and_the_failure_is_remembered():
    x = torch.randn(64)
    check, remembered = _check(lambda a: torch.tanh(a) * 3, x)
    out, why = judged(check, [x], lambda: torch.tanh(x) * 3 * (1 + 1e-3))
    torch.testing.assert_close(out, torch.tanh(x) * 3, atol=0, rtol=0)
    assert why.startswith("on the first call's inputs, the test's rewrite gave outputs "
                          "that are not correct by the rule against the graph as traced (")
    assert "beyond 0.0001 of eager" in why and remembered == [why]


def test_a_traced_run_that_runs_out_of_memory_is_no_verdict():
    """The traced graph's run beside the Program's outputs runs out of memory: the
    Program's outputs are let go, the traced graph runs alone and its outputs are
    returned, and nothing is remembered (a later process may have the memory)."""
    x = torch.randn(8)
    runs = []

    class Traced(torch.nn.Module):
        graph = torch.fx.Graph()     # no random ops

        def forward(self, a):
            runs.append(1)
            if len(runs) == 1:
                raise torch.OutOfMemoryError("simulated")
            return a + 1

    remembered: list[str] = []
    check = TracedCheck(Traced(), "the test's rewrite", remembered.append)
    out, why = judged(check, [x], lambda: x + 1)
    torch.testing.assert_close(out, x + 1)
    assert "could not be judged" in why and "OutOfMemoryError" in why
    assert len(runs) == 2 and not remembered


def test_both_runs_draw_the_same_numbers_and_the_generator_ends_after_the_programs():
    """A graph that draws random numbers (dropout): the traced run draws what the
    Program's run drew (so a faithful Program passes), and the CPU generator ends where
    one call of the Program left it."""
    x = torch.ones(256)
    check, remembered = _check(lambda a: torch.nn.functional.dropout(a, 0.5, True), x)
    torch.manual_seed(3)
    out, why = judged(check, [x], lambda: torch.nn.functional.dropout(x, 0.5, True))
    after = torch.get_rng_state()
    torch.manual_seed(3)
    want = torch.nn.functional.dropout(x, 0.5, True)
    assert why is None and not remembered
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert torch.equal(after, torch.get_rng_state())


def test_an_fp64_run_that_fails_is_no_verdict_and_the_traced_graph_runs():
    """The Program misses 1e-4 of the traced graph and the fp64 run that would settle it
    fails: the traced graph's outputs are returned (correct whatever the verdict would
    have been), and nothing is remembered."""
    x = torch.randn(8)

    class Traced(torch.nn.Module):
        graph = torch.fx.Graph()     # no random ops

        def forward(self, a):
            if a.dtype == torch.float64:
                raise RuntimeError("no fp64 here")
            return a * 3

    remembered: list[str] = []
    check = TracedCheck(Traced(), "the test's rewrite", remembered.append)
    out, why = judged(check, [x], lambda: x * 3 * (1 + 1e-3))
    torch.testing.assert_close(out, x * 3, atol=0, rtol=0)
    assert "could not be judged" in why and "no fp64 here" in why, why
    assert not remembered
