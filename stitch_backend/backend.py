"""The backend callable: ``torch.compile(model, backend="stitchcuda")``.

Dynamo hands over an FX graph and example inputs; AOTAutograd turns it into functional
ATen graphs (an inference graph, or a forward and a backward graph when training); for
each, the Planner partitions it into regions, the Coder/Verifier replace regions by
verified kernels where they can (on CUDA), and a ``Program`` runs the result. What was
done for every graph is kept in ``GraphRecord``s, readable from Python and printed by
``stitchcuda explain``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from . import config as config_mod
from . import aot_direct, gc_pause, logs
from .decompositions import decomposition_table
from .exc import InvalidOptionError
from .graph import GraphKey, graph_key
from .ir import Plan, RegionKind
from .layout_race import races
from .memplan import MemoryEstimate
from .memplan import estimate as estimate_memory
from .mutations import Writeback, aot_mutated_inputs, strip_input_mutations
from .program import Program

log = logging.getLogger("stitch_backend.backend")

_MODES = {None: {}, "default": {}, "reduce-overhead": {"cudagraphs": True},
          "max-autotune": {"cudagraphs": True}, "max-autotune-no-cudagraphs": {"cudagraphs": False}}
_graph_counter = itertools.count()


@dataclass
class GraphRecord:
    """What the backend did with one ATen graph."""

    index: int
    stage: str                 # "inference", "forward" or "backward"
    key: GraphKey
    plan: Plan
    device: str                # "cuda", "cpu", "meta", ...
    dynamic: bool              # symbolic sizes among the inputs
    compile_ms: float
    notes: list[str] = field(default_factory=list)
    cached: bool = False       # loaded from the artifact cache
    # The eager guard found the graph as Dynamo traced it faster: it runs as written.
    runs_as_traced: bool = False
    # The ATen graph itself, for ``explain --emit-dir`` and tests; not serialised.
    gm: Any = field(default=None, repr=False, compare=False)
    program: Any = field(default=None, repr=False, compare=False)
    # Inputs AOTAutograd saw mutated (None: unknown); more than the Program's writebacks
    # means AOTAutograd applies some outside the graph.
    aot_mutations: int | None = None
    # Which of the backend's Dynamo graphs this ATen graph came from (its forward and
    # backward share it); -1 when compiled outside one.
    dynamo_graph: int = -1
    # Whether the channels-last rewrite applied (None: the pass was not considered).
    layout_applied: bool | None = None

    @property
    def name(self) -> str:
        return f"graph {self.index} ({self.stage})"

    def memory(self) -> MemoryEstimate | None:
        """The static peak-memory estimate as the regions run now (None without the graph;
        an estimate that failed says why in its line)."""
        if self.gm is None:
            return None
        try:
            return estimate_memory(self.gm, self.plan)
        except Exception as err:  # noqa: BLE001 - a report line, never a failed compile
            return MemoryEstimate(None, None, f"{type(err).__name__}: {err}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (the plan's regions in full)."""
        memory = self.memory()
        return {
            "index": self.index, "stage": self.stage, "key": self.key.digest,
            "device": self.device, "dynamic": self.dynamic, "cached": self.cached,
            "compile_ms": round(self.compile_ms, 3), "notes": list(self.notes),
            "verify_s": round(self.program.verify_s, 3) if self.program is not None else None,
            "runs_as_traced": self.runs_as_traced,
            "counts": self.plan.counts(),
            "memory": memory.to_dict() if memory is not None else None,
            "regions": [r.to_dict() for r in self.plan.regions],
        }


class StitchBackend:
    """A Dynamo backend object. ``records`` lists every graph it compiled.

    Use directly to inspect what was done::

        backend = StitchBackend(options={"cudagraphs": False})
        compiled = torch.compile(model, backend=backend)
        compiled(x)
        print(backend.report())
    """

    def __init__(self, options: dict[str, Any] | None = None, mode: str | None = None):
        if mode not in _MODES:
            raise InvalidOptionError(
                f"unknown torch.compile mode {mode!r} for stitchcuda; valid modes: "
                + ", ".join(repr(m) for m in _MODES if m))
        merged = dict(_MODES[mode])
        merged.update(options or {})
        self.config = config_mod.current().with_options(merged)
        logs.configure(self.config.log_level)
        self.records: list[GraphRecord] = []
        self.trajectories: list[Any] = []
        self.failures: list[str] = []   # graphs the backend could not compile (run on ATen)
        self.dynamo_graphs = 0
        # Dynamo graph -> its inference graph's compiled callable, why it needs
        # AOTAutograd's runtime wrapper (None: it does not), its argument count
        self._inference: dict[int, tuple[Callable, str | None, int]] = {}

    # Dynamo calls this once per captured graph.
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._dynamo.backends.common import aot_autograd

        self.dynamo_graphs += 1
        dynamo_graph = self.dynamo_graphs
        compile_stage = functools.partial
        aot = aot_autograd(
            fw_compiler=compile_stage(self._compile, "forward", dynamo_graph=dynamo_graph),
            bw_compiler=compile_stage(self._compile, "backward", dynamo_graph=dynamo_graph),
            inference_compiler=compile_stage(self._compile, "inference",
                                             dynamo_graph=dynamo_graph),
            decompositions=decomposition_table(),
            partition_fn=_partitioner(self.config.recompute),
            # Input mutations (BatchNorm's running statistics) stay in the graph, so the
            # Program writes them back itself: one launch per dtype, inside the CUDA graph
            # when replayed, instead of AOTAutograd's Python copy per buffer (mutations.py).
            keep_inference_input_mutations=True,
        )
        compiled = aot_direct.unwrapped(
            aot(gm, example_inputs), self._inference.pop(dynamo_graph, None), len(example_inputs),
            [r for r in self.records if r.dynamo_graph == dynamo_graph])
        return self._guarded(gm, compiled, dynamo_graph)

    def _guarded(self, gm: torch.fx.GraphModule, compiled: Callable,
                 dynamo_graph: int) -> Callable:
        """``compiled``, or an EagerGuard that times it against ``gm`` as traced (eager,
        undecomposed) once its Programs have settled and keeps the faster."""
        from . import eager_guard

        if not self.config.eager_guard:
            return compiled

        def of_this_graph() -> list[GraphRecord]:
            return [r for r in self.records if r.dynamo_graph == dynamo_graph]

        records = of_this_graph()
        why = eager_guard.ineligible(records)
        if why is not None:
            log.debug("eager guard off for %s: %s", [r.name for r in records], why)
            if any(r.device in eager_guard.DEVICES for r in records):
                for rec in records:   # where it would have run: the report says why not
                    rec.notes.append(f"eager guard off: {why}")
            return compiled
        return eager_guard.EagerGuard(eager_guard.direct_forward(gm), compiled, of_this_graph)

    def _compile(self, stage: str, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 dynamo_graph: int = -1) -> Callable:
        compiled = self._compile_or_traced(stage, gm, example_inputs, dynamo_graph)
        if stage == "inference":
            self._inference[dynamo_graph] = (compiled, aot_direct.why_not(gm, example_inputs),
                                             len(example_inputs))
        return compiled

    def _compile_or_traced(self, stage: str, gm: torch.fx.GraphModule,
                           example_inputs: list[Any], dynamo_graph: int) -> Callable:
        try:
            with gc_pause.paused():
                functional, writebacks = strip_input_mutations(gm)
                return self._compile_graph(stage, functional, example_inputs, writebacks,
                                           dynamo_graph=dynamo_graph)
        except Exception as err:  # noqa: BLE001 - a backend bug must not break the model
            if isinstance(err, InvalidOptionError):
                raise
            log.warning("stitchcuda: could not compile a %s graph (%s: %s); it runs on ATen "
                        "as traced", stage, type(err).__name__, err, exc_info=log.isEnabledFor(
                            logging.DEBUG))
            self.failures.append(f"{stage} graph: {type(err).__name__}: {err}")
            from torch._functorch.aot_autograd import make_boxed_func

            return make_boxed_func(gm)  # as traced: its in-graph mutations included

    def _compile_graph(self, stage: str, gm: torch.fx.GraphModule, example_inputs: list[Any],
                       writebacks: list[Writeback] | None = None,
                       dynamo_graph: int = -1, forced_layout: bool | None = None) -> Any:
        """The graph's Program (or, with ``layout_race``, a LayoutRace of its Programs in
        both layouts); ``forced_layout`` overrides the channels-last decision (the race's
        second Program)."""
        from stitch_backend.agents.planner import partition

        t0 = time.perf_counter()
        index = next(_graph_counter)
        device = _device_of(example_inputs)
        dynamic = any(isinstance(x, torch.SymInt) or (
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape))
            for x in example_inputs)
        # layout first: a pooling of a channels-last value is rewritten along C
        traced = gm
        gm, layout = self._layout(gm, stage, device, dynamic, forced_layout)
        gm, pools = self._pools(gm, device)
        gm, biases = self._conv_bias(gm, device)
        plan = partition(gm, graph_name=f"graph_{index}_{stage}",
                         defer_roots=self._fuse_roots(stage))
        arch = self._arch(device)
        key = graph_key(gm, example_inputs, options=self.config.code_options(), arch=arch)
        record = GraphRecord(index=index, stage=stage, key=key, plan=plan, device=device,
                             dynamic=dynamic, compile_ms=0.0, gm=gm,
                             aot_mutations=aot_mutated_inputs(), dynamo_graph=dynamo_graph)
        notes = record.notes
        if layout is not None:
            record.layout_applied = layout.applied
            notes.append(layout.note())
            if layout.remembered:
                notes.append(layout.remembered)
        if pools:
            notes.append(f"{pools} pooling(s) over disjoint windows run as amax/mean "
                         "reductions the Coder generates")
        if biases:
            notes.append(f"{biases} convolution bias(es) added in the epilogue instead of "
                         "ATen's separate pass after cuDNN")
        replay_why = (self._replay_ineligible(gm, example_inputs, record)
                      if device == "cuda" else "not a CUDA graph")
        if device == "meta":
            why = "traced on meta tensors: plan only, nothing runs"
            notes.append(why)
            self._mark_aten(plan, why)
            program = Program(gm, plan)
        elif device == "cpu" and self.config.cpu_interpret and self.config.codegen:
            notes.append("cpu_interpret: generated kernels run through the IR interpreter "
                         "(a testing aid)")
            program = self._build(gm, plan, key, arch, record, interpreted=True)
        elif device != "cuda":
            why = (f"inputs are on {device}: stitchcuda generates CUDA kernels only, "
                   "so every region of this graph runs on ATen")
            logs.warn_once(log, f"device:{device}", f"stitchcuda: {why}")
            notes.append(why)
            self._mark_aten(plan, why)
            program = Program(gm, plan)
        elif not self.config.codegen:
            why = "codegen=False: every region runs on ATen"
            notes.append(why)
            self._mark_aten(plan, why)
            program = Program(gm, plan)
        else:
            program = self._build(gm, plan, key, arch, record,
                                  graph_timing=replay_why is None)
        program.notes_sink = record.notes
        record.program = program
        if layout is not None and layout.applied and layout.whole_graph and device != "meta":
            program.judge_against = self._traced_check(traced)
        program.recheck_shapes = dynamic
        program.writebacks = list(writebacks or [])
        if writebacks:
            notes.append(f"{len(writebacks)} mutated input(s) (e.g. BatchNorm running "
                         "statistics) written back once per call, one launch per dtype")
        if device == "cuda":
            self._plan_replay(program, replay_why, record)
        record.compile_ms = (time.perf_counter() - t0) * 1e3
        self.records.append(record)
        _ALL_RECORDS.append(record)
        if (forced_layout is None and layout is not None
                and races(self.config.layout_race, layout)
                and self.config.channels_last is None and device != "meta"):
            race = self._layout_race(program, record, layout, stage, traced, example_inputs,
                                     writebacks, dynamo_graph)
            if race is not None:
                return race
        counts = plan.counts()
        log.info("%s: %d regions (%s), %d generated, key %s, %.0f ms", record.name,
                 len(plan.regions),
                 ", ".join(f"{counts[k.value]} {k.value}" for k in RegionKind if counts[k.value]),
                 counts["generated"], key.short, record.compile_ms)
        return program

    def _fuse_roots(self, stage: str) -> bool:
        """The Planner's ``defer_roots`` for a graph of ``stage`` ('auto': backward only)."""
        if self.config.fuse_roots is None:
            return stage == "backward"
        return self.config.fuse_roots

    def _layout(self, gm, stage: str, device: str, dynamic: bool,
                forced: bool | None = None):
        """``gm`` with its convolutions channels-last where that applies, and what was
        done (None where the pass is not considered: no convolutions, not CUDA, ...);
        ``forced``: the layout race's other choice (``layout_choice.decide``)."""
        from . import layout_choice

        if not layout_choice.considered(self.config, gm, stage, self._runs_kernels(device),
                                        dynamic):
            return gm, None
        return layout_choice.decide(self.config, self._notes(), gm, forced, self._arch(device))

    def _layout_race(self, program: Program, record: GraphRecord, result, stage: str,
                     traced: torch.fx.GraphModule, example_inputs: list[Any],
                     writebacks: list[Writeback] | None, dynamo_graph: int):
        """A LayoutRace of ``program`` against the same graph compiled in the other layout,
        or None (with a note) where the other layout does not apply."""
        from . import cudagraphs
        from .layout_race import LayoutRace, race_key, too_large

        big = too_large(traced)
        if big is not None:
            record.notes.append(f"layout race: not run, {big}")
            return None
        other = not result.applied
        second = self._compile_graph(stage, traced, example_inputs, writebacks,
                                     dynamo_graph=dynamo_graph, forced_layout=other)
        rec2 = self.records[-1]
        layout2 = rec2.layout_applied
        if layout2 != other:
            self.records.remove(rec2)
            _ALL_RECORDS.remove(rec2)
            record.notes.append("layout race: not run, the other layout does not apply "
                                f"({rec2.notes[0] if rec2.notes else 'no reason given'})")
            return None
        names = ["channels-last" if result.applied else "the traced layout",
                 "channels-last" if other else "the traced layout"]
        record.notes.append(f"layout race: against {rec2.name} ({names[1]})")
        rec2.notes.append(f"layout race: against {record.name} ({names[0]})")
        store = self._notes()      # where the verdict is kept for later processes
        key = (None if store is None else
               race_key(traced, self.config.code_options(), self._arch(record.device)))
        return LayoutRace(program, second, [record, rec2], names,
                          draws_random=cudagraphs.draws_random(traced), store=store, key=key)

    def _traced_check(self, traced: torch.fx.GraphModule):
        """The first-call check of a graph whose channels-last rewrite kept TF32
        convolutions on random draws (``traced_check``), remembering a failure in the
        cache's precision notes."""
        from .graph_precision import remember_failure
        from .traced_check import TracedCheck

        return TracedCheck(traced, "the channels-last rewrite's TF32 convolutions",
                           functools.partial(remember_failure, self._notes(), traced))

    def _notes(self):
        """The cache's Store, where small computed facts are kept (None: cache off)."""
        if not self.config.cache:
            return None
        from . import artifacts

        return artifacts.open_store(self.config.cache_dir)

    def _runs_kernels(self, device: str) -> bool:
        """Whether generated kernels run for graphs on ``device`` (CUDA, or the CPU
        interpreter, a testing aid), so the graph passes that feed them apply."""
        return device == "cuda" or (device == "cpu" and self.config.cpu_interpret)

    def _pools(self, gm, device: str):
        """``gm`` with its disjoint-window poolings as amax/mean reductions, and how many."""
        if not self.config.codegen or not self._runs_kernels(device):
            return gm, 0
        from .pooling import pools_as_reductions

        return pools_as_reductions(gm)

    def _conv_bias(self, gm, device: str):
        """``gm`` with its cuDNN convolutions' biases as epilogue adds, and how many."""
        from .conv_bias import cudnn_runs_convolutions, split_conv_bias

        if not self.config.codegen or not self._runs_kernels(device) or (
                device == "cuda" and not cudnn_runs_convolutions()):
            return gm, 0
        return split_conv_bias(gm, device)

    def _build(self, gm, plan: Plan, key: GraphKey, arch: str, record: GraphRecord, *,
               interpreted: bool = False, graph_timing: bool = False) -> Program:
        """Warm start from the cache, or Coder + compile now and Verifier on the first call
        (verification needs real inputs), then store the verified Program.

        ``interpreted`` (the cpu_interpret testing aid) runs the same pipeline with the
        kernel-IR interpreter in place of nvcc and the GPU. ``graph_timing``: the Program
        will be replayed as one CUDA graph, so candidates are timed as graph replays."""
        from . import artifacts
        from .kernels import InterpretedRunner, KernelRunner

        base = InterpretedRunner if interpreted else KernelRunner
        notes = record.notes
        sm_count = 132 if interpreted else torch.cuda.get_device_properties(
            torch.cuda.current_device()).multi_processor_count
        slot = None
        if self.config.cache and self.config.verify:
            store = artifacts.open_store(self.config.cache_dir)
            if not interpreted:
                from . import lt_ops

                lt_ops.remember_in(store)   # cuBLASLt algorithm choices persist too
            entry, slot = artifacts.claim(store, key.digest)
            if entry is not None:
                from .toolchain import has_clusters

                warm = artifacts.warm_start(entry, gm, plan, task_graph=_kernel_prefix(key),
                                            sm_count=sm_count, base=base,
                                            split_stats=self.config.split_stats,
                                            clusters=has_clusters(arch), notes=notes)
                if warm is not None:
                    notes.append(f"loaded from the cache ({len(warm.runners)} kernel(s), "
                                 f"key {key.short})")
                    record.cached = True
                    # No verification now (the entry was verified before it was stored);
                    # the verifier stays attached for new shapes of a symbolic graph.
                    return Program(gm, plan, warm.runners, verify=self._verifier_call(
                        base, graph_timing=graph_timing))
                notes.append("cache entry did not fit this graph: rebuilt, not stored")
        try:
            return self._generate(gm, plan, key, arch, record, slot, sm_count, base,
                                  graph_timing)
        except BaseException:
            if slot is not None:
                slot.release()
            raise

    def _generate(self, gm, plan: Plan, key: GraphKey, arch: str, record: GraphRecord,
                  slot, sm_count: int, base, graph_timing: bool = False) -> Program:
        from stitch_backend.agents.loop import CompileWait, implement
        from stitch_backend.agents.state import Task

        from . import artifacts
        from .kernels import InterpretedRunner, runner_for
        from .toolchain import ToolchainError, resolve_compiler

        notes = record.notes
        interpreted = base is InterpretedRunner
        try:
            if not interpreted:
                resolve_compiler(self.config.compiler)
        except ToolchainError as err:
            why = (f"no kernel compiler for compiler={self.config.compiler!r} "
                   f"({' '.join(str(err).split())}): region runs on ATen")
            notes.append(why)
            self._mark_aten(plan, why)
            return self._finish_uncompiled(gm, plan, record, slot)
        task = Task(graph=_kernel_prefix(key), key=key.digest, arch=arch,
                    device="cpu" if interpreted else "cuda")
        # Verified Programs compile their kernels in the background: the graph's first
        # call (its verification) waits for them, so compiling overlaps what comes
        # before it (the layout race's other Program, a backward graph, Dynamo's work).
        background = not interpreted and self.config.verify
        impl = implement(task, gm, plan, arch=arch, sm_count=sm_count,
                         workers=self.config.compile_workers or None, compile=not interpreted,
                         config=self.config, background=background)
        self.trajectories.append(impl.trajectory)
        compiled = CompileWait(impl, notes, report=not interpreted, background=background)
        make_runner = functools.partial(runner_for, base=base)
        if not background:
            compiled()
        if not self.config.verify:
            notes.append("verify=False: candidates installed UNVERIFIED (debugging only)")
            for rid, cand in impl.candidates.items():
                plan.regions[rid].backend, plan.regions[rid].kernel = "kernel", cand.name
            return Program(gm, plan, {rid: make_runner(c) for rid, c in impl.candidates.items()})
        if not impl.candidates:
            return self._finish_uncompiled(gm, plan, record, slot)

        def on_done(program: Program) -> None:
            if slot is not None:
                artifacts.store_program(slot, program, record, impl.candidates)

        extras = None
        if not interpreted:   # untrusted kernels run only on CUDA inputs
            from stitch_backend.agents.llm_extras import first_call_extras

            extras = first_call_extras(task, impl.subtasks, impl.candidates, arch=arch,
                                       cfg=self.config, trajectory=impl.trajectory,
                                       notes=notes)
        verify = self._verifier_call(base, graph_timing=graph_timing,
                                     trajectory=impl.trajectory, on_done=on_done,
                                     extras=extras)
        return Program(gm, plan, pending=impl.candidates, verify=compiled.before(verify))

    def _replay_ineligible(self, gm, example_inputs, record: GraphRecord) -> str | None:
        """Why this CUDA graph's Program cannot be replayed as one CUDA graph (None: it can)."""
        from . import cudagraphs

        if not self.config.cudagraphs:
            return "option cudagraphs=False"
        return cudagraphs.ineligible(gm, example_inputs, device=record.device,
                                     dynamic=record.dynamic, stage=record.stage,
                                     allow_training=self.config.cudagraphs_training)

    def _plan_replay(self, program: Program, why: str | None, record: GraphRecord) -> None:
        """Turn on whole-Program CUDA graph replay where it can work; say why not elsewhere."""
        from . import cudagraphs

        if why:
            record.notes.append(f"CUDA graph replay off: {why}")
            return
        static = cudagraphs.static_input_indices()
        if static is None:
            record.notes.append("static inputs unknown: every input is copied on replay")
        random = cudagraphs.draws_random(program.graph_module)
        program.replay = cudagraphs.GraphReplay(program, static, random=random)
        record.notes.append("CUDA graph replay on: captured after verification and one "
                            "warm-up call, checked bit for bit on its first replay"
                            + (" (random ops: replays draw from torch's default CUDA "
                               "generator as uncaptured calls would)" if random else ""))

    def _verifier_call(self, base, graph_timing: bool = False, **kw):
        """The first-call verification callback for Programs of this backend."""
        from stitch_backend.agents.acceptance import verify_first_call
        from stitch_backend.agents.verifier import Verifier, VerifySettings

        from .kernels import runner_for

        verifier = Verifier(VerifySettings(require_speedup=self.config.require_speedup,
                                           graph_timing=graph_timing))
        return functools.partial(verify_first_call, verifier=verifier,
                                 show_progress=self.config.progress,
                                 make_runner=functools.partial(runner_for, base=base), **kw)

    @staticmethod
    def _finish_uncompiled(gm, plan: Plan, record: GraphRecord, slot) -> Program:
        """An all-ATen Program; cached too, so a warm start skips the Coder."""
        from . import artifacts

        program = Program(gm, plan)
        if slot is not None:
            artifacts.store_program(slot, program, record, {})
        return program

    @staticmethod
    def _mark_aten(plan: Plan, why: str) -> None:
        for region in plan.regions:
            if region.kind is not RegionKind.FALLBACK and region.reason is None:
                region.reason = why

    def _arch(self, device: str) -> str:
        if self.config.arch:
            return self.config.arch
        if device == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        return device

    def report(self) -> str:
        """A readable summary of every graph compiled by this backend."""
        from .report import render_text

        text = render_text(self.records, dynamo_graphs=self.dynamo_graphs)
        for failure in self.failures:
            text += f"\nnot compiled (runs on ATen as traced): {failure}"
        return text


# Graphs compiled through the string entry point (``backend="stitchcuda"``), whose
# backend objects the user never sees; ``stitch_backend.compiled_graphs()`` returns them.
_ALL_RECORDS: list[GraphRecord] = []


def stitchcuda(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
    """The registered backend: ``torch.compile(m, backend="stitchcuda", options={...})``."""
    unknown = set(kwargs) - {"options", "mode"}
    if unknown:
        raise InvalidOptionError(f"unexpected stitchcuda arguments {sorted(unknown)}; "
                                 "pass settings through options={...}")
    backend = StitchBackend(options=kwargs.get("options"), mode=kwargs.get("mode"))
    return backend(gm, example_inputs)


def compiled_graphs() -> list[GraphRecord]:
    """Every GraphRecord made in this process, in order."""
    return list(_ALL_RECORDS)


def _kernel_prefix(key: GraphKey) -> str:
    """Kernel names start with this: fixed by the key (not by how many graphs this
    process compiled before), so a warm start regenerates byte-identical sources."""
    return f"sc_{key.digest[:12]}"


def _device_of(example_inputs: list[Any]) -> str:
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    if "cuda" in devices:
        return "cuda"
    return sorted(devices)[0] if devices else "cpu"


def _partitioner(recompute: bool) -> Callable:
    """AOTAutograd's split of a joint graph into forward and backward (option recompute)."""
    from torch._functorch.partitioners import (default_partition,
                                               min_cut_rematerialization_partition)

    return min_cut_rematerialization_partition if recompute else default_partition
