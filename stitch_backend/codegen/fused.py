"""The handle the backend uses: ``generate(gm, name) -> FusedKernel``.

A ``FusedKernel`` holds the CUDA source of one fused region and knows how to launch it:
``prepare(inputs)`` allocates the outputs (eager's shapes, strides and dtypes, on the
inputs' device), picks grid/block from the sizes and the SM count, and returns the flat
argument list for ``CudaFunction.launch`` (signature codes: p pointer, i int32, l int64).
``interpret(inputs)`` runs the same kernel IR on CPU with torch ops.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx

from .binding import bind, extents, output_layout
from .emit_cuda import TILE, TILE_ROWS, Emitted, emit
from .cluster import CLUSTER
from .fast_math import fast_math as fast_math_ir
from .emit_staged import STAGE_ROWS, STAGE_THREADS
from .interp import interpret as _interpret
from .kernel_ir import KernelIR, Unsupported
from .lower import lower
from .split import split_full_reductions

log = logging.getLogger("stitch_backend.codegen.fused")
code_log = logging.getLogger("stitch_backend.codegen.source")

POINTWISE_THREADS = 256
MAX_THREADS = 1024
# Above this many threads a row at 4 chunks each, a row gets 8 chunks a thread instead.
LONG_ROW_TK = 512
SERIAL_THREADS = 256             # reductions of short rows, one thread a row
RESIDENT_THREADS_PER_SM = 2048  # H100/H200; used only to size grid-stride grids
INT32_MAX = 2 ** 31 - 1
MAX_GRID_X = 2 ** 31 - 1          # CUDA's limit on gridDim.x
MAX_ROW_BLOCKS = 1 << 20        # inner-layout reductions: above this, blocks loop over rows


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch needs. Keep the plan alive until the launch has run
    (``scratch`` holds the workspaces the kernel writes)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple
    outputs: tuple[torch.Tensor, ...]
    scratch: tuple[torch.Tensor, ...] = ()
    reads: tuple[torch.Tensor, ...] = ()     # the region inputs the kernel reads


@dataclass(frozen=True)
class Layout:
    """What ``prepare`` derives from one input layout (validated once); the same on any
    device, so a verified kernel's layouts can be stored with it (``to_json``)."""

    outputs: tuple            # (shape, stride, dtype) per output
    scratch: tuple            # (elements, dtype) per workspace; 0 elements: the ticket
    positions: tuple          # region-input position of each pointer argument
    tail: tuple               # size symbols, then log2_tk for a reduction
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0       # dynamic shared memory a block

    def to_json(self) -> dict:
        return {"outputs": [[list(s), list(st), _dtype_name(dt)] for s, st, dt in self.outputs],
                "scratch": [[n, _dtype_name(dt)] for n, dt in self.scratch],
                "positions": list(self.positions), "tail": list(self.tail),
                "grid": list(self.grid), "block": list(self.block),
                "shared_mem": self.shared_mem}

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        return cls(tuple((tuple(s), tuple(st), _dtype(dt)) for s, st, dt in d["outputs"]),
                   tuple((int(n), _dtype(dt)) for n, dt in d["scratch"]),
                   tuple(int(p) for p in d["positions"]), tuple(int(t) for t in d["tail"]),
                   tuple(int(g) for g in d["grid"]), tuple(int(b) for b in d["block"]),
                   int(d.get("shared_mem", 0)))


_MAX_LAYOUTS = 64  # a symbolic kernel seen at many sizes stops memoising, still correct


def layout_key(inputs: Sequence) -> tuple:
    """The memo key of an input list: each tensor's shape, strides, dtype and device type.

    On every launch's host path, so a plain loop: ``torch.Size`` hashes and compares as
    the tuple it is, and ``is_cuda`` skips building a device object for the common case."""
    key = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            key.append((x.shape, x.stride(), x.dtype, "cuda" if x.is_cuda else x.device.type))
        else:
            key.append(("int", int(x)))
    return tuple(key)


def key_to_json(key: tuple) -> list:
    return [["int", k[1]] if k[0] == "int" else [list(k[0]), list(k[1]), _dtype_name(k[2]), k[3]]
            for k in key]


def key_from_json(items: list) -> tuple:
    return tuple(("int", int(k[1])) if k[0] == "int"
                 else (tuple(k[0]), tuple(k[1]), _dtype(k[2]), k[3]) for k in items)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def launch_plan(layout: Layout, inputs: Sequence[torch.Tensor | int]) -> "LaunchPlan":
    """The launch for ``inputs`` of a layout already validated: fresh outputs and
    workspaces on the inputs' device, and the packed argument list."""
    # the device of what the kernel reads: a region input it does not read (a CPU
    # scalar constant it inlined) must not place the outputs in host memory
    read = tuple(x for x in (inputs[p] for p in layout.positions) if isinstance(x, torch.Tensor))
    placed = read or [x for x in inputs if isinstance(x, torch.Tensor)]
    device = placed[0].device if placed else torch.device("cuda")
    args = [x.data_ptr() for x in read]
    if len(args) != len(layout.positions):
        raise ValueError(f"a pointer argument of the kernel is not a tensor: positions "
                         f"{layout.positions}, inputs {[type(x).__name__ for x in inputs]}")
    outputs = []
    for shape, stride, dt in layout.outputs:
        out = torch.empty_strided(shape, stride, dtype=dt, device=device)
        outputs.append(out)
        args.append(out.data_ptr())
    scratch = []
    for n, dt in layout.scratch:
        t = (torch.empty(n, dtype=dt, device=device) if n
             else torch.zeros(1, dtype=torch.int32, device=device))
        scratch.append(t)
        args.append(t.data_ptr())
    args += layout.tail
    return LaunchPlan(layout.grid, layout.block, layout.shared_mem, tuple(args), tuple(outputs),
                      tuple(scratch), read)


# Elements a thread takes in each pass over a row in a lean column launch. The template's
# 4 spread a short row over many threads: KernelBench L2 92's logsumexp over 64 channels
# (after a group norm, tanh and hardswish, recomputed in each of its two passes) takes 16
# threads a row, each reading 4 values and then combining 16 partial values from shared
# memory between two barriers, twice. The split candidate that ends in that kernel took
# 1.59 ms on an H100, where moving its bytes once takes about 0.35 ms. Reasoned, not yet
# measured: the Verifier races the lean launch against the template's.
LEAN_CHUNKS = 16


def column_shape(rows: int, reduce_len: int, sm_count: int, *, narrow: bool = False,
                 lean: bool = False) -> tuple[int, int]:
    """(rows a block, threads a row) of a column-layout reduction's launch."""
    # 32 consecutive rows per block coalesce best; with few rows, 8 (one 32-byte sector
    # of fp32) leaves more blocks for the SMs.
    rb = 32 if rows >= 32 * sm_count else 8
    if narrow:
        # fewer rows a block, down to one, until the blocks cover the SMs: a warp then
        # reads scattered rows (a sector for each element), which only pays where the
        # value is small enough to stay in L2 (the Verifier races this against the
        # template's launch)
        while rb > 1 and rows < rb * sm_count:
            rb //= 2
    rb = min(rb, _pow2_at_least(max(rows, 1)))
    tk = _pow2_at_least(max(1, _cdiv(reduce_len, LEAN_CHUNKS if lean else 4)))
    tk = max(min(tk, MAX_THREADS // rb), max(1, 32 // rb))
    # Short rows in plenty (a pooling window): more rows a block, not one warp.
    while rb * tk < 128 and rows >= 4 * rb * sm_count:
        rb *= 2
    return rb, tk


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FusedKernel:
    """One generated kernel for one fused region."""

    name: str
    source: str
    entry: str
    ops: list[str]
    signature: str
    sm_count: int = 132
    ir: KernelIR = field(repr=False, compare=False, default=None)
    emitted: Emitted = field(repr=False, compare=False, default=None)
    # column layout: as many blocks as the rows allow (``launch_shape``), an alternative
    # the Coder offers beside the template's launch (agents.launch_alternatives.narrow_columns)
    narrow: bool = False
    # column layout: LEAN_CHUNKS elements a thread and pass rather than 4 (fewer threads a
    # row, so fewer partial values to combine across the block after each pass; the
    # Coder's alternative agents.launch_alternatives.lean_columns)
    lean: bool = False
    # cluster layout: launched with as many clusters as can be resident at once, each
    # looping over rows (the kernel's row loop steps by the grid), rather than a cluster a
    # row (``kernels.KernelRunner`` asks the driver; the Coder's alternative
    # agents.launch_alternatives.cluster_rows ``_cl_r``)
    resident: bool = False
    _layouts: dict = field(repr=False, compare=False, default_factory=dict)

    @property
    def kind(self) -> str:
        """"pointwise" or "reduction"."""
        return self.emitted.kind

    def launch_shape(self, rows: int, reduce_len: int) -> tuple[int, int, int]:
        """(blocks, threads per block, log2 of threads per row) for these sizes."""
        em = self.emitted
        resident = self.sm_count * RESIDENT_THREADS_PER_SM
        if em.layout == "tiled":    # one TILE x TILE tile per block (its loop steps by the grid)
            # as for pointwise kernels below, a block per tile rather than a grid of
            # resident threads: on the H200 (kb/tune/transpose.py, one run) an NHWC -> NCHW
            # copy of (128, 128, 126, 126) fp32 took 0.526 ms so against 0.908 capped
            threads = TILE * TILE_ROWS
            blocks = min(_cdiv(max(rows, 1), TILE * TILE), MAX_GRID_X)
            return max(blocks, 1), threads, 0
        if em.layout == "staged":   # STAGE_ROWS rows a block (its loop steps by the grid)
            blocks = min(_cdiv(max(rows, 1), STAGE_ROWS), MAX_ROW_BLOCKS)
            return max(blocks, 1), STAGE_THREADS, 0
        if em.kind == "pointwise":
            # One vector a thread, not a grid-stride grid of resident threads: on the H200
            # (kb/tune/stream.py, ReLU over 4096x196608 fp32) 1.494 ms so against 1.634
            # capped (eager 1.513); two vectors a thread 1.509, eight 1.551.
            threads = POINTWISE_THREADS
            per_block = threads * em.vec
            blocks = _cdiv(max(rows, 1), per_block)
            if not em.idx64:
                # 32-bit indices: a thread's index plus the grid's step stays below 2^31
                # (the emitter leaves at least 2^24 of headroom above the element count).
                blocks = min(blocks, max(resident // threads, (INT32_MAX - rows) // per_block))
            return max(min(blocks, MAX_GRID_X), 1), threads, 0
        if em.serial:               # one thread a row (emit_reduction.SERIAL_MAX_K)
            threads = SERIAL_THREADS
            return max(min(_cdiv(max(rows, 1), threads), MAX_ROW_BLOCKS), 1), threads, 0
        if em.layout == "cluster":  # a cluster of CLUSTER blocks a row, a share each
            chunks = _cdiv(_cdiv(reduce_len, CLUSTER), em.vec)
            # one row a block (the cluster combines one value a reduction per block)
            tk = min(MAX_THREADS, em.max_threads, _pow2_at_least(max(32, _cdiv(chunks, 8))))
            groups = min(max(rows, 1), MAX_ROW_BLOCKS // CLUSTER)
            return groups * CLUSTER, tk, tk.bit_length() - 1
        if em.layout == "inner":
            chunks = _cdiv(reduce_len, em.vec)
            tk = _pow2_at_least(max(1, _cdiv(chunks, 4)))
            if tk > LONG_ROW_TK:
                # Long rows: 8 chunks a thread rather than 4. On an H100 (kb/tune/rownorm.py,
                # one run), instance norm rows of 126*126 fp32 (L2 17's (128, 128) images)
                # took 0.772 ms at 512 threads a row against 0.948 at 1024 (eager 2.134);
                # group norm rows of 32768 were fastest at 1024 threads, which both
                # rules give. Rows of at most 4096 chunks (or 2048) keep their shape.
                tk = _pow2_at_least(max(1, _cdiv(chunks, 8)))
            tk = min(MAX_THREADS, em.max_threads, tk)
            threads = max(tk, 128)
            rb = threads // tk
            # One block per group of rows, not a grid-stride grid of resident threads:
            # on the H200 (kb/tune/rows.py, one run) the template's softmax over
            # 524288x512 rows ran 0.589 ms so against 0.691, 65536x1024 0.163 vs 0.195,
            # layer norm 65536x768 0.112 vs 0.124; no shape measured slower.
            return min(_cdiv(max(rows, 1), rb), MAX_ROW_BLOCKS), threads, tk.bit_length() - 1
        else:
            rb, tk = column_shape(rows, reduce_len, self.sm_count, narrow=self.narrow,
                                  lean=self.lean)
            threads = rb * tk
        blocks = min(_cdiv(max(rows, 1), rb), max(1, resident // threads))
        return max(blocks, 1), threads, tk.bit_length() - 1

    def prepare(self, inputs: Sequence[torch.Tensor | int]) -> LaunchPlan:
        """Allocate the outputs and compute the launch for these inputs.

        Raises ValueError when the inputs' shapes/strides/dtypes differ from what the
        kernel was generated for (under its symbolic sizes). The checks and the size
        arithmetic run once per input layout; later calls with that layout only
        allocate and pack pointers (this is on every launch's host path).
        """
        key = layout_key(inputs)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(inputs)
            if len(self._layouts) < _MAX_LAYOUTS:
                self._layouts[key] = layout
        return launch_plan(layout, inputs)

    def _layout(self, inputs: Sequence[torch.Tensor | int]) -> "Layout":
        ir = self.ir
        values = bind(ir, inputs)
        outputs = tuple((tuple(shape), tuple(stride), o.dtype)
                        for o, (shape, stride) in zip(ir.outputs, output_layout(ir, values)))
        rows, red = extents(ir, values)
        blocks, threads, log2_tk = self.launch_shape(rows, red)
        scratch = [(max(rows, 1), dt) for _, dt in self.emitted.workspaces]
        if self.emitted.workspaces:
            scratch.append((0, torch.int32))  # the ticket, zeroed on every launch
        tail = [values[b.symbol] for b in ir.symbols]
        if self.emitted.kind == "reduction":
            tail.append(log2_tk)
        return Layout(outputs, tuple(scratch), tuple(a.position for a in ir.inputs),
                      tuple(tail), (blocks, 1, 1), (threads, 1, 1), self.emitted.shared_mem)

    def renamed(self, name: str) -> "FusedKernel":
        """The same kernel under entry point ``name`` (the source differs only there):
        regions of one structure share a generation."""
        if name == self.name:
            return self
        if not _IDENT.match(name):
            raise ValueError(f"kernel name {name!r} is not a C identifier")
        old = re.compile(rf"\b{re.escape(self.name)}\b")
        source = old.sub(name, self.source)
        emitted = dataclasses.replace(self.emitted, source=old.sub(name, self.emitted.source),
                                      entry=name)
        return dataclasses.replace(self, name=name, source=source, entry=name,
                                   ir=dataclasses.replace(self.ir, name=name),
                                   emitted=emitted, _layouts={})

    def interpret(self, inputs: Sequence[torch.Tensor | int]) -> list[torch.Tensor]:
        """The region's outputs computed by the CPU interpreter of the kernel IR."""
        return _interpret(self.ir, inputs)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def generate(gm: torch.fx.GraphModule, name: str, *, sm_count: int = 132,
             layout: str | None = None, narrow: bool = False,
             cache_values: bool = False, single_pass_stats: bool = False,
             peel: bool = False, fast_math: bool = False) -> FusedKernel:
    """The fused CUDA kernel for region ``gm``, entry point ``name``; ``layout`` forces a
    reduction's thread layout (``emit_reduction``), ``narrow`` a column reduction's
    launch of few rows a block (``FusedKernel.narrow``), ``cache_values`` its
    persistent rows' registers of computed values (``persist.value_passes``),
    ``single_pass_stats`` variances in one pass over shifted values
    (``lower_reductions._shifted_moments``), ``peel`` a row reduction's vector path over
    rows that start anywhere (``codegen.peel``), ``fast_math`` fp32 exponentials and
    divisions by a row's value in their fast forms (``codegen.fast_math``).

    Raises ``Unsupported`` (with the op and the reason) for what the templates cannot
    express, ValueError for a name that is not a C identifier.
    """
    if not _IDENT.match(name):
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    ir = split_full_reductions(lower(gm, name, single_pass_stats=single_pass_stats), sm_count)
    if fast_math:
        ir = fast_math_ir(ir)
    em = emit(ir, layout, cache_values, peel)
    ops = list(dict.fromkeys(ir.ops))
    code_log.debug("generated %s:\n%s", name, em.source)
    return FusedKernel(name=name, source=em.source, entry=em.entry, ops=ops,
                       signature=em.signature, sm_count=sm_count, ir=ir, emitted=em,
                       narrow=narrow)


__all__ = ["FusedKernel", "LEAN_CHUNKS", "LaunchPlan", "Layout", "Unsupported", "column_shape",
           "generate", "key_from_json", "key_to_json", "launch_plan", "layout_key"]
