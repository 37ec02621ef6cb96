"""A replayed Program reads its inputs where the caller keeps them while they stay at the
address its capture read, and copies them into buffers of its own from the first call
that passes one elsewhere (cudagraphs.GraphReplay). On the CPU, with a stand-in for the
captured graph that runs the Program on the graph's inputs, as a replay does."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.cudagraphs import DIRECT_RETURNS, STABLE_CALLS

aten = torch.ops.aten


def _replay_of(monkeypatch, fn, example, static=(), mutating=False):
    from stitch_backend import cudagraphs
    from stitch_backend.agents.planner import partition
    from stitch_backend.mutations import split_outputs, strip_input_mutations, write_back
    from stitch_backend.program import Program

    gm = make_fx(fn)(*example)
    writebacks = []
    if mutating:
        gm, writebacks = strip_input_mutations(gm)
    program = Program(gm, partition(gm, graph_name="g"))
    program.writebacks = writebacks
    replay = cudagraphs.GraphReplay(program, set(static))

    class _Graph:
        """Reads the tensors the capture read (a CUDA graph reads their addresses; here
        the caller's own tensors stand for the memory at them), writes its outputs."""

        def __init__(self):
            self.read = list(replay.static_inputs)

        def replay(self):
            fresh = program.run_inputs(self.read)
            own, values = split_outputs(fresh, writebacks)
            for dst, src in zip(replay.static_outputs, fresh):
                dst.copy_(src)
            inside, _ = replay._by_place(values)
            write_back([self.read[i] for i, _ in inside], [v for _, v in inside])

    monkeypatch.setattr(cudagraphs, "capture", lambda run: (_Graph(), run()))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cudagraphs, "wall_ms", lambda call: (call(), 1.0)[-1])
    replay.warm = True
    return replay


def _graph_reads(replay, i):
    """The tensor the stand-in graph reads for input ``i``."""
    return replay.graph.read[i]


def test_an_input_at_the_same_address_is_read_in_place_and_a_moved_one_copied_from_then_on(
        monkeypatch):
    replay = _replay_of(monkeypatch, lambda x, w: (aten.mul.Tensor(x, w),),
                        (torch.randn(6), torch.randn(6)), static={1})
    x, w = torch.randn(6), torch.randn(6)
    (out,) = replay([x, w])
    torch.testing.assert_close(out, x * w, rtol=0, atol=0)
    assert replay.direct == {0} and replay._copied == []
    assert _graph_reads(replay, 0) is x                       # no copy of the caller's input
    assert replay.static_inputs[0] is None                   # and no reference kept
    x.mul_(3.0)                                              # changed in place, same address
    (out,) = replay([x, w])
    torch.testing.assert_close(out, x * w, rtol=0, atol=0)
    assert replay.captures == 1

    y = torch.randn(6)                                       # a new tensor: copied in
    (out,) = replay([y, w])
    torch.testing.assert_close(out, y * w, rtol=0, atol=0)
    assert replay.direct == set() and replay._copied == [0]
    assert _graph_reads(replay, 0) is not y and _graph_reads(replay, 0) is not x
    assert replay.captures == 1 and replay.disabled is None  # not a moved parameter
    notes = replay.program.notes_sink
    assert any("copied in: input 0" in n for n in notes)
    # the copying graph's first replay was timed against running uncaptured again
    assert sum(n.startswith("one call: ") for n in notes) == 2
    z = torch.randn(6)
    for _ in range(STABLE_CALLS - 1):                        # no further capture yet
        (out,) = replay([z, w])
        torch.testing.assert_close(out, z * w, rtol=0, atol=0)
        assert replay.direct == set() and _graph_reads(replay, 0) is not z
    z.add_(1.0)
    (out,) = replay([z, w])                # stayed put: read in place again, re-checked
    torch.testing.assert_close(out, z * w, rtol=0, atol=0)
    assert replay.direct == {0} and _graph_reads(replay, 0) is z and replay._copied == []
    assert any("read in place again" in n for n in notes) and replay.captures == 1
    assert sum(n.startswith("one call: ") for n in notes) == 3


def test_in_place_reads_come_back_at_most_direct_returns_times(monkeypatch):
    replay = _replay_of(monkeypatch, lambda x: (aten.neg.default(x),), (torch.randn(5),))
    replay([torch.randn(5)])                                 # captured, read in place
    for round_ in range(DIRECT_RETURNS + 1):
        (out,) = replay([torch.randn(5)])                    # moved: copied in
        assert replay.direct == set()
        x = torch.randn(5)
        for _ in range(STABLE_CALLS):
            (out,) = replay([x])
            torch.testing.assert_close(out, -x, rtol=0, atol=0)
        assert replay.direct == ({0} if round_ < DIRECT_RETURNS else set()), round_
    assert replay.direct_returns == DIRECT_RETURNS and replay.disabled is None
    assert replay.captures == 1


def test_a_moved_parameter_still_counts_and_inputs_stay_read_in_place(monkeypatch):
    replay = _replay_of(monkeypatch, lambda x, w: (aten.add.Tensor(x, w),),
                        (torch.randn(4), torch.randn(4)), static={1})
    x, w = torch.randn(4), torch.randn(4)
    replay([x, w])
    w2 = torch.randn(4)                                      # the parameter moved
    (out,) = replay([x, w2])
    torch.testing.assert_close(out, x + w2, rtol=0, atol=0)
    assert replay.captures == 2 and replay.direct == {0}


def test_an_input_the_graph_mutates_is_copied_in_and_written_back(monkeypatch):
    def step(x, count):
        new = aten.add.Tensor(count, 1)
        aten.copy_.default(count, new)
        return (aten.mul.Tensor(x, new),)

    replay = _replay_of(monkeypatch, step, (torch.randn(3), torch.zeros(())), mutating=True)
    x, count = torch.randn(3), torch.zeros(())
    (out,) = replay([x, count])
    assert replay.direct == {0} and replay._copied == [1]
    assert count.item() == 1.0                               # written back once
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    (out,) = replay([x, count])
    assert count.item() == 2.0
    torch.testing.assert_close(out, x * 2.0, rtol=0, atol=0)
