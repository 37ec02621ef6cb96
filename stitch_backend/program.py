"""The Program: a compiled graph as an ordered list of steps over numbered slots.

Each step runs one region (an ATen region module today; a verified kernel or library
call once the Coder has replaced it) and stores its outputs in slots; slots are freed
after their last use, so peak memory follows eager's. The Program is called by
AOTAutograd with a boxed list of inputs and returns the graph's outputs.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx

from . import alias_check, gc_pause
from .ir import Plan, Region
from .mutations import WriteBack, Writeback, split_outputs
from .regions import region_module

if TYPE_CHECKING:
    from .traced_check import TracedCheck

log = logging.getLogger("stitch_backend.program")

# Run verified Programs as one straight-line function (False: the step loop always; the
# host-overhead benchmark, ``python -m stitch_backend.bench.overhead``, compares both).
STRAIGHT_LINE = True


@dataclass
class Step:
    """One region's execution: read ``inputs`` slots, call ``fn``, write ``outputs`` slots."""

    region: Region
    fn: Callable[..., Sequence[Any]]
    aten: Callable[..., Sequence[Any]]
    inputs: list[int]
    outputs: list[int]
    free_after: list[int] = field(default_factory=list)
    # Shared by the steps of one Program: counts changes of any step's ``fn``, so the
    # Program knows when its straight-line function is stale without looking at each step.
    changes: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "fn" and "changes" in self.__dict__:
            self.changes[0] += 1
        object.__setattr__(self, name, value)


def unboxed(call_args: tuple) -> list[Any]:
    """A call's inputs as a new list. AOTAutograd calls boxed (one list, cleared here so
    that the inputs can die early) where it sees ``_boxed_call``, and unboxed where a
    wrapper hides that attribute."""
    if len(call_args) == 1 and isinstance(call_args[0], list):
        inputs = list(call_args[0])
        call_args[0].clear()
        return inputs
    return list(call_args)


class Program:
    """Runs a Plan step by step. Called as ``program(args_list)`` (boxed, as AOT wants)."""

    def __init__(self, gm: torch.fx.GraphModule, plan: Plan,
                 implementations: dict[int, Callable[..., Sequence[Any]]] | None = None,
                 pending: dict[int, Any] | None = None,
                 verify: Callable[["Program", list[Any]], Any] | None = None):
        """Build the steps of ``plan`` over ``gm``; ``implementations`` maps a region id to a
        replacement callable (same inputs/outputs as the region); the rest run on ATen.

        ``pending`` holds candidates that need verification on real inputs: the first
        call then goes through ``verify(program, args)``, which runs the graph on ATen,
        installs the candidates that pass and returns the ATen outputs."""
        self.plan = plan
        self.pending = dict(pending or {})
        self._verify = verify
        self.replay: Any = None          # cudagraphs.GraphReplay, set by the backend
        # Symbolic-shape Programs re-verify their kernels on every new input shape.
        self.recheck_shapes = False
        self.verified_shapes: set[tuple] = set()
        # Seconds the first call's verification took (the regions' ATen profile, every
        # candidate judged, the end-to-end check, the cache write), summed over the shapes
        # a symbolic-shape Program verified: the report's "verified in".
        self.verify_s = 0.0
        self.notes_sink: list[str] = []  # the GraphRecord's notes, for late events
        # Input mutations taken out of the graph (mutations.py): the graph returns the new
        # values after its own outputs and each call writes them back.
        self.writebacks: list[Writeback] = []
        self._write_back = WriteBack()    # their copies, grouped once for these targets
        self.calls = 0
        # When a list: each call appends the inputs it mutates (the eager guard saves
        # and restores them around its timing runs).
        self.seen_targets: list[torch.Tensor] | None = None
        # Set where a graph pass changed values beyond rounding (``traced_check``): the
        # first call is judged against the graph as traced; where it fails, ``as_traced``
        # runs every later call.
        self.judge_against: TracedCheck | None = None
        self.as_traced: Callable[..., Any] | None = None
        # An instance attribute (not a class one) so that functools.wraps, which Dynamo
        # uses to wrap the backward, copies it and AOTAutograd keeps calling us boxed.
        self._boxed_call = True
        # AOTAutograd's first-call aliasing check has nothing to look at (alias_check)
        self._skip_alias_check = not alias_check.has_custom_ops(gm)
        implementations = implementations or {}
        slot: dict[str, int] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n in placeholders:
            slot[n.name] = len(slot)
        self.num_inputs = len(placeholders)
        self.constants: list[tuple[int, Any]] = []
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                slot[n.name] = len(slot)
                self.constants.append((slot[n.name], _fetch_attr(gm, n.target)))
        self.steps: list[Step] = []
        self._changes = [0]
        for region in plan.regions:
            for name in region.outputs:
                slot[name] = len(slot)
            aten = region_module(gm, region)
            fn = implementations.get(region.id) or aten
            self.steps.append(Step(region=region, fn=fn, aten=aten,
                                   inputs=[slot[x] for x in region.inputs],
                                   outputs=[slot[x] for x in region.outputs],
                                   changes=self._changes))
        self.num_slots = len(slot)
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        self._out_spec = torch.fx.node.map_arg(out_node.args[0], lambda n: _Slot(slot[n.name]))
        self._plan_frees()
        self._gm = gm
        # The steps as one straight-line function (see ``_straight``), and the step
        # functions it was built for: rebuilt when a step changes.
        self._straight_fn: Callable[[list[Any]], Any] | None = None
        self._straight_for = -1   # the value of ``_changes[0]`` it was built for
        self.straight_error: str | None = None

    def _plan_frees(self) -> None:
        """Free every intermediate slot after the last step that reads it."""
        last_use: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for s in step.inputs:
                last_use[s] = i
        keep = set(_flatten(self._out_spec))
        for s, i in last_use.items():
            if s not in keep:
                self.steps[i].free_after.append(s)

    @property
    def settled(self) -> bool:
        """Verification done and CUDA graph replay decided (and, where on, checked on its
        first replay): what the eager guard and the layout race wait for."""
        if self.pending:
            return False
        replay = self.replay
        return replay is None or replay.disabled is not None or replay.checked

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The ATen graph the Program runs."""
        return self._gm

    def step_of(self, region_id: int) -> Step:
        return next(s for s in self.steps if s.region.id == region_id)

    def __call__(self, *call_args: Any) -> Any:
        inputs = unboxed(call_args)

        # the inputs the graph mutates: worked out only where this call needs them (the
        # settled replay path writes back its mutations itself)
        def targets() -> list[Any]:
            return [inputs[w.input_index] for w in self.writebacks]

        if self.seen_targets is not None:
            self.seen_targets.extend(targets())
        if self.as_traced is not None:
            return self.finish_call(self.as_traced(*inputs), targets())
        if self.judge_against is not None:
            return self.finish_call(self._judged_first_call(inputs), targets())
        if self.pending and self._verify is not None:
            return self.finish_call(self._verify_or_aten(inputs), targets())
        if self.recheck_shapes and self._verify is not None:
            key = _shape_key(inputs)
            if key not in self.verified_shapes:
                return self.finish_call(self._reverify(inputs, key), targets())
        if self.replay is not None:
            from .cudagraphs import NotCaptured

            try:
                return self.replay(inputs)  # writes back the mutations itself
            except NotCaptured:
                pass
        mutated = targets()
        straight = self._straight() if STRAIGHT_LINE else None
        if straight is not None:
            self.calls += 1
            return self.finish_call(straight(inputs), mutated)  # boxed: clears ``inputs``
        slots: list[Any] = [None] * self.num_slots
        slots[: self.num_inputs] = inputs
        inputs.clear()
        return self.finish_call(self.run(slots), mutated)

    def _straight(self) -> Callable[[list[Any]], Any] | None:
        """The Program as one generated Python function: ATen regions inlined as their
        ops, each other step one call, values freed after their last use (FX codegen).
        One frame per call instead of a module call and a slot loop per step: for
        uncaptured Programs (training, large inputs) the host time per step is that of
        the op itself. Rebuilt when any step's function changes; None (the step loop
        runs) where it could not be built, with the reason in ``straight_error``."""
        if self._changes[0] == self._straight_for:
            return self._straight_fn
        self._straight_for = self._changes[0]
        self._straight_fn = None
        try:
            self._straight_fn = _straight_line(self._gm, self.steps)
            self.straight_error = None
        except Exception as err:  # noqa: BLE001 - the step loop is the fallback
            self.straight_error = f"{type(err).__name__}: {err}"
            log.debug("straight-line Program for %s not built (%s); the step loop runs",
                      self.plan.graph_name, self.straight_error)
            self.notes_sink.append(f"runs as a step loop: its straight-line function "
                                   f"could not be built ({self.straight_error})")
        return self._straight_fn

    def finish_call(self, outputs: Any, targets: Sequence[torch.Tensor]) -> Any:
        """The graph's own outputs of a run's ``outputs``, after the new values of mutated
        inputs were written into ``targets`` (the call's inputs they belong to)."""
        if not self.writebacks:
            return outputs
        own, values = split_outputs(outputs, self.writebacks)
        self._write_back(targets, values)
        return own

    def _judged_first_call(self, inputs: list[Any]) -> Any:
        """The first call, judged against the graph as traced (``traced_check``); where it
        fails, the traced graph's outputs, and every later call runs that graph."""
        from .traced_check import judged

        check, self.judge_against = self.judge_against, None

        def first() -> Any:
            if self.pending and self._verify is not None:
                return self._verify_or_aten(inputs)
            return self.run_inputs(inputs)

        with alias_check.set_aside(self._skip_alias_check):
            outputs, why = judged(check, inputs, first)
        if why is not None:
            self.as_traced = check.traced
            self.use_aten(f"{why}: the graph runs as traced")
            for region in self.plan.regions:
                region.reason = region.reason or "the graph runs as traced"
            if self.replay is not None and self.replay.disabled is None:
                self.replay.disable("the graph runs as traced")
        return outputs

    def _reverify(self, inputs: list[Any], key: tuple) -> Any:
        """A symbolic-shape Program meets a new shape: its installed kernels were verified
        on other sizes, so they go back to pending and are verified again on these inputs
        (those that fail stay on ATen, with the reason)."""
        self.verified_shapes.add(key)
        installed = {s.region.id: s.fn.candidate for s in self.steps
                     if s.fn is not s.aten and hasattr(s.fn, "candidate")}
        if not installed:
            return self.run_inputs(inputs)
        for step in self.steps:
            if step.region.id in installed:
                step.fn = step.aten
                step.region.backend = "aten"
        self.pending = installed
        return self._verify_or_aten(inputs)

    def _verify_or_aten(self, inputs: list[Any]) -> Any:
        """First call: verification; if the verification machinery itself fails (a bug,
        not a bad candidate), every pending region stays on ATen, said in a warning and
        in the regions' reasons, and the user still gets eager's result."""
        pending = dict(self.pending)
        self.verified_shapes.add(_shape_key(inputs))
        t0 = time.perf_counter()
        try:
            with gc_pause.paused(), alias_check.set_aside(self._skip_alias_check):
                return self._verify(self, inputs)
        except Exception as err:  # noqa: BLE001 - must not take the user's model down
            log.warning("stitchcuda: verification of %s failed (%s: %s); its regions stay on "
                        "ATen", self.plan.graph_name, type(err).__name__, err)
            for step in self.steps:
                if step.region.id in pending:
                    step.fn = step.aten
                    step.region.backend = "aten"
                    step.region.reason = f"verification failed: {type(err).__name__}: {err}"
            self.pending = {}
            return self.run_inputs(inputs)
        finally:
            self.verify_s += time.perf_counter() - t0

    def run_inputs(self, inputs: Sequence[Any],
                   observe: Callable[[Step, list[Any], Sequence[Any]], None] | None = None,
                   on_aten: bool = False) -> Any:
        """Run on ``inputs`` (not consumed); ``observe(step, step_inputs, outputs)`` sees
        every step (the Verifier's hook); ``on_aten`` runs every region's ATen ops."""
        slots: list[Any] = [None] * self.num_slots
        slots[: self.num_inputs] = list(inputs)
        return self.run(slots, observe, on_aten)

    def generated_steps(self) -> list[Step]:
        """The steps that run something other than their region's ATen ops."""
        return [s for s in self.steps if s.fn is not s.aten]

    def use_aten(self, reason: str) -> None:
        """Every region back on ATen (their kernels stay verified, just unused), with the
        reason in each region's record and the graph's notes."""
        for step in self.generated_steps():
            step.fn = step.aten
            step.region.backend = "aten"
            step.region.reason = reason
        self.notes_sink.append(f"every region on ATen: {reason}")

    def run(self, slots: list[Any], observe=None, on_aten: bool = False) -> Any:
        """Execute every step over ``slots`` (inputs already placed)."""
        for s, value in self.constants:
            slots[s] = value
        for step in self.steps:
            step_inputs = [slots[s] for s in step.inputs]
            fn = step.aten if on_aten else step.fn
            boxed = getattr(fn, "call_boxed", None) if observe is None else None
            if boxed is not None:
                # as in the straight-line function: the step may free what it read last
                # (``free_after`` holds only this step's inputs, see ``_plan_frees``)
                for s in step.free_after:
                    slots[s] = None
                outs = boxed(step_inputs)
            else:
                outs = fn(*step_inputs)
            if observe is not None:
                observe(step, step_inputs, outs)
            for s, v in zip(step.outputs, outs):
                slots[s] = v
            step_inputs = outs = v = None     # the slots alone hold values between steps
            for s in step.free_after:
                slots[s] = None
        self.calls += 1
        return _unflatten(self._out_spec, slots)


def _straight_line(gm: torch.fx.GraphModule, steps: Sequence[Step]) -> Callable[[list[Any]], Any]:
    """One boxed function (takes the input list, clears it) running ``steps`` over ``gm``:
    the nodes of a step still on ATen copied in, any other step called as one function."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = {n.name: n for n in gm.graph.nodes}

    def copy(node: torch.fx.Node) -> None:
        if node not in env:
            env[node] = graph.node_copy(node, lambda a: env[a])

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            copy(node)
    for step in steps:
        if step.fn is step.aten:
            for name in step.region.nodes:
                copy(nodes[name])
            continue
        args = tuple(env[nodes[x]] for x in step.region.inputs)
        boxed_call = getattr(step.fn, "call_boxed", None)
        if boxed_call is not None:
            # the inputs go in a list the step empties: FX drops this function's own
            # references after the packing, so a value the step reads last can be freed
            # inside it (a convolution's input before its epilogue's output exists)
            args = (graph.call_function(_box, args),)
        call = graph.call_function(_named(boxed_call or step.fn, f"region_{step.region.id}"),
                                   args)
        for i, name in enumerate(step.region.outputs):
            env[nodes[name]] = graph.call_function(operator.getitem, (call, i))
    copy(next(n for n in gm.graph.nodes if n.op == "output"))
    graph.lint()  # every value defined before its use
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = _direct(node.target)
    boxed = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if boxed is not None:
        graph.set_codegen(boxed())
    module = torch.fx.GraphModule(gm, graph)
    _unwrap_direct(type(module).forward)
    if boxed is not None:
        return module.forward

    def unboxed(inputs: list[Any]) -> Any:
        args = list(inputs)
        inputs.clear()
        return module.forward(*args)

    return unboxed


class _Direct:
    """Stands for an ATen overload in the straight-line function's graph; its C++ entry
    (``OpOverload._op``) then replaces it in the generated code's globals, so each op is
    called without ``OpOverload.__call__``'s Python frame (~0.3 us of host time an op,
    measured on the CPU; a training step of a 30-block MLP runs ~1250 ops)."""

    __module__ = __name__

    def __init__(self, op: torch._ops.OpOverload):
        self.op = op
        self.__name__ = "aten_" + str(op).replace("aten.", "").replace(".", "_")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)


def _direct(op: torch._ops.OpOverload) -> Any:
    return _Direct(op) if callable(getattr(op, "_op", None)) else op


def _unwrap_direct(forward: Callable[..., Any]) -> None:
    """In ``forward``'s globals (FX puts each call target there), every ``_Direct`` by
    its overload's C++ entry; where FX keeps them elsewhere, they stay and still work."""
    names = getattr(forward, "__globals__", {})
    for key, value in list(names.items()):
        if isinstance(value, _Direct):
            names[key] = value.op._op


def _box(*values: Any) -> list[Any]:
    return list(values)


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` behind a plain function called ``name`` (what FX names its global)."""
    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _shape_key(inputs: Sequence[Any]) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                 for x in inputs)


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Slot(int):
    """A slot index inside the output spec (distinct from a literal int output)."""


def _flatten(spec: Any) -> list[int]:
    if isinstance(spec, _Slot):
        return [int(spec)]
    if isinstance(spec, (list, tuple)):
        return [x for item in spec for x in _flatten(item)]
    return []


def _unflatten(spec: Any, slots: list[Any]) -> Any:
    if isinstance(spec, _Slot):
        return slots[spec]
    if isinstance(spec, tuple):
        return tuple(_unflatten(x, slots) for x in spec)
    if isinstance(spec, list):
        return [_unflatten(x, slots) for x in spec]
    return spec  # None and other constants
