"""An inference graph's compiled Program called without AOTAutograd's runtime wrapper.

AOTAutograd hands Dynamo a wrapper around what the backend compiled: it dedupes
arguments, replays input mutations and regenerates outputs that alias inputs or
intermediates, and turns grad mode and autocast off around the call. For an inference
graph with none of those to do, the wrapper's work a call is overhead on the host path,
which the GPU waits for where a call starts on an idle GPU (a short graph: KernelBench
L1 12 spends 0.048 ms of host time a call under stitchcuda on an H100 against 0.038
under Dynamo's eager backend, of a 0.084 ms call). How much of that gap the wrapper is
depends on torch: on this project's CPU machine (torch 2.13, whose wrapper is generated
straight-line code) an 8 x 8 broadcast multiply took 22-23 µs a call either way, Dynamo's
eager backend 17-18; the GPU image's torch 2.11 is not measured yet
(``python3 -P -m stitch_backend.bench.overhead``, its last line).

``why_not`` reads AOTAutograd's metadata while it compiles the graph and says why the
wrapper is needed; where nothing is, and AOTAutograd passes the compiled Program as
many arguments as Dynamo passes (no deduplication), the backend hands Dynamo a
``DirectCall`` of the Program: the same arguments in the same order, grad mode and
autocast off for the call as the wrapper has them. Training graphs always keep the
wrapper (its autograd.Function).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def why_not(gm: torch.fx.GraphModule, aot_inputs: Sequence[Any]) -> str | None:
    """Why the inference graph AOTAutograd is compiling now (``gm``, its inputs
    ``aot_inputs``) needs AOTAutograd's runtime wrapper; None where it does not. Read
    inside the inference compiler (AOTAutograd's tracing context holds the metadata
    then)."""
    from .alias_check import has_custom_ops

    if has_custom_ops(gm):
        return "custom operators (its first call checks that they alias no input)"
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return "AOTAutograd's metadata is not readable"
    if not hasattr(torch._C, "_DisableAutocast"):
        return "this torch has no torch._C._DisableAutocast"
    try:
        if any(info.mutates_data or info.mutates_metadata for info in meta.input_info):
            return "it mutates inputs"
        kinds = {str(getattr(info.output_type, "name", info.output_type))
                 for info in meta.output_info}
        if kinds - {"non_alias"}:
            return f"outputs alias inputs or intermediates ({', '.join(sorted(kinds))})"
        if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized:
            return "intermediate bases, effect tokens or functionalized random ops"
        if any(not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta"
               for m in meta.subclass_inp_meta):
            return "tensor subclass inputs"
    except AttributeError as err:   # another torch's metadata: keep the wrapper
        return f"AOTAutograd's metadata lacks {err.name!r}"
    if any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in x.shape)) for x in aot_inputs):
        return "symbolic sizes"
    return None


def unwrapped(compiled: Callable, inference: tuple[Callable, str | None, int] | None,
              n_inputs: int, records: Sequence[Any]) -> Callable:
    """What the backend hands Dynamo for one of its graphs: ``compiled`` (AOTAutograd's
    callable), or a ``DirectCall`` of the inference graph's compiled Program where
    ``inference`` (that Program, ``why_not``'s answer, its argument count) says nothing
    of the wrapper applies and Dynamo passes as many arguments (``n_inputs``). The
    graph's ``records`` say which, and why."""
    if inference is None:
        return compiled
    inner, why, n_aot = inference
    if why is None and n_aot != n_inputs:
        why = f"AOTAutograd passes it {n_aot} arguments where Dynamo passes {n_inputs}"
    for rec in records:
        rec.notes.append("called without AOTAutograd's runtime wrapper (nothing of it "
                         "applies)" if why is None else
                         f"called through AOTAutograd's runtime wrapper: {why}")
    return compiled if why is not None else DirectCall(inner)


class DirectCall:
    """Dynamo's call of an inference graph, straight to the compiled Program (or layout
    race): a fresh argument list (the Program may free its entries as it goes); grad
    mode and autocast off for the call, as AOTAutograd's wrapper has them (autocast is
    on here only where it was when Dynamo traced: its guards see to that, and the
    wrapper then turns it off)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[list[Any]], Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        if torch._C._is_any_autocast_enabled():
            with torch._C._DisableAutocast():
                return self._call(args)
        return self._call(args)

    def _call(self, args: tuple[Any, ...]) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.fn(list(args))
        return self.fn(list(args))


__all__ = ["DirectCall", "unwrapped", "why_not"]
