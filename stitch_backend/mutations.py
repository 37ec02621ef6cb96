"""Input mutations of inference graphs (BatchNorm's running statistics, counters).

The backend asks AOTAutograd to keep an inference graph's input mutations in the graph
(``keep_inference_input_mutations``), as Inductor does: the graph then ends in
``copy_(placeholder, new_value)`` nodes instead of returning the new values for a Python
epilogue to copy, one ``copy_`` call per buffer per step (60 for a ResNet18 in training
mode). Here those nodes are taken out again: the Program runs the functional graph, which
also returns the new values, and writes them back once per call, one fused
``_foreach_copy_`` launch per dtype (inside the CUDA graph when the Program is replayed). Every
extra run the backend makes (verification, warm-up, the replay check, timing) stays
free of side effects that way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.fx

COPY_ = torch.ops.aten.copy_.default


class UnsupportedMutation(ValueError):
    """An in-graph mutation this module does not take apart (the graph then runs on ATen
    as traced, which applies it)."""


@dataclass(frozen=True)
class Writeback:
    """After a call, graph input ``input_index`` takes the value of flat output
    ``output_index``."""

    input_index: int
    output_index: int


def strip_input_mutations(gm: torch.fx.GraphModule
                          ) -> tuple[torch.fx.GraphModule, list[Writeback]]:
    """``gm`` without its trailing ``copy_(input, value)`` nodes: a copy whose graph returns
    the values after its own outputs, and the writebacks that put them in place (an output
    that was a copy's result, or the input it overwrote, becomes the value copied). ``gm`` itself is not changed; a
    graph without mutations comes back as it is.

    Raises UnsupportedMutation for any other mutation (a copy into something that is not
    an input, an input read after it was overwritten, another mutable op)."""
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is COPY_]
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is not COPY_
                and isinstance(node.target, torch._ops.OpOverload)
                and node.target._schema.is_mutable):
            raise UnsupportedMutation(f"in-graph mutation by {node.target}")
    if not copies:
        return gm, []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in copies:
        dst = node.args[0]
        if not (isinstance(dst, torch.fx.Node) and dst.op == "placeholder"):
            raise UnsupportedMutation(f"{node.name} copies into {dst}, not into a graph input")
        if any(u.op != "output" for u in node.users):
            raise UnsupportedMutation(f"the result of {node.name} is used")
        late = [u for u in dst.users
                if u is not node and u.op != "output" and order[u] > order[node]]
        if late:
            raise UnsupportedMutation(f"input {dst.name} is read by {late[0].name} after "
                                      f"{node.name} overwrote it")
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    values: list[tuple[int, torch.fx.Node]] = []
    after: dict[torch.fx.Node, torch.fx.Node] = {}   # an input -> its new value
    out_node = None
    for node in gm.graph.nodes:
        if node.op == "output":
            out_node = node
            continue
        if node.op == "call_function" and node.target is COPY_:
            values.append((placeholders.index(node.args[0]), env[node.args[1]]))
            # Returned too (copy_ returns its input): AOTAutograd hands the user the input
            # itself for such an output; the new value stands in for it here.
            env[node] = after[node.args[0]] = env[node.args[1]]
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    assert out_node is not None
    outputs = torch.fx.node.map_arg(out_node.args[0], lambda n: after.get(n, env[n]))
    if not isinstance(outputs, (tuple, list)):
        raise UnsupportedMutation("the graph's outputs are not a tuple")
    user = list(outputs)
    writebacks = [Writeback(i, len(user) + k) for k, (i, _) in enumerate(values)]
    graph.output(tuple(user + [v for _, v in values]))
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new, writebacks


def write_back(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``t.copy_(v)`` for each pair: one ``_foreach_copy_`` launch per (device, dtype)
    group (its fast path needs one dtype: BatchNorm's int64 step counters beside its fp32
    statistics make two groups) where shapes and dtypes match pairwise and no value shares
    memory with a target, so that order cannot matter; else one by one, in order, exactly
    as the graph's copies ran."""
    if targets:
        _copy(targets, values, _groups(targets, values))


class WriteBack:
    """``write_back`` for one Program's calls: its checks and grouping (Python work over
    every pair: 0.16 ms a call for MobileNetV2's 156 BatchNorm buffers on this project's
    CPU machine, against 0.05 ms for the two ``_foreach_copy_`` calls) are worked out on
    the first call and kept while the targets are the same tensor objects (held here,
    so their ids cannot be reused); the values are the Program's outputs, whose shapes,
    dtypes and aliasing the graph fixes."""

    def __init__(self) -> None:
        self._targets: list[torch.Tensor] = []
        self._groups: list[list[int]] | None = None    # None: one by one, in order

    def __call__(self, targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if not targets:
            return
        if len(targets) != len(self._targets) or any(
                t is not u for t, u in zip(targets, self._targets)):
            self._targets = list(targets)
            self._groups = _groups(targets, values)
        _copy(targets, values, self._groups)


def _copy(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
          groups: list[list[int]] | None) -> None:
    if groups is None:
        for t, v in zip(targets, values):
            t.copy_(v)
        return
    for group in groups:
        torch._foreach_copy_([targets[i] for i in group], [values[i] for i in group])


def _groups(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
            ) -> list[list[int]] | None:
    """Indices of the pairs one ``_foreach_copy_`` can write, per (device, dtype), or None
    where the copies must run one by one (see ``write_back``)."""
    same = all(isinstance(v, torch.Tensor) and t.shape == v.shape and t.dtype == v.dtype
               and t.device == v.device for t, v in zip(targets, values))
    if same:
        written = {t.untyped_storage().data_ptr() for t in targets}
        same = not any(v.untyped_storage().data_ptr() in written for v in values)
    if not (same and hasattr(torch, "_foreach_copy_")):
        return None
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes a copy of ``tensors`` takes."""
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def restored(targets: Sequence[torch.Tensor]) -> Iterator[None]:
    """Runs the block, then puts ``targets`` back as they were before it (timing runs of a
    graph that mutates its inputs must not leave their updates behind)."""
    saved = [t.clone() for t in targets]
    try:
        yield
    finally:
        with torch.no_grad():
            write_back(targets, saved)


def split_outputs(outputs: Any, writebacks: Sequence[Writeback]) -> tuple[Any, list[Any]]:
    """(the graph's own outputs, the written-back values) of a stripped graph's outputs."""
    if not writebacks:
        return outputs, []
    first = writebacks[0].output_index
    own = outputs[:first]
    return (tuple(own) if isinstance(outputs, tuple) else list(own)), \
        [outputs[w.output_index] for w in writebacks]


def aot_mutated_inputs() -> int | None:
    """How many inputs of the graph AOTAutograd is compiling now it found mutated (data or
    metadata), from its tracing context; None where that is not readable."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        if ctx is None or ctx.fw_metadata is None:
            return None
        return sum(1 for info in ctx.fw_metadata.input_info
                   if info.mutates_data or info.mutates_metadata)
    except AttributeError:
        return None
