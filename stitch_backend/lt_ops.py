"""Library epilogues: a matrix product and the activation after it as one cuBLASLt call.

``addmm(bias, a, b)`` followed by ``relu`` (or tanh-``gelu``: cuBLASLt's GELU is the tanh
form, so exact GELU never maps here) is ``LtMatmul.matmul(a, b, bias=bias,
epilogue="RELU_BIAS")``: the product is written once, already activated, instead of
written, read and written again by an epilogue kernel. The Coder proposes it as an
alternative candidate for gemm regions (``agents.coder``); the Verifier judges and times
it like any other, so it is used only where it is correct and faster.

A gemm region with nothing to fuse (a Linear whose output goes straight to the next
layer) gets the library call alone as its candidate: cuBLASLt with the algorithm the
first call times fastest (``_matmul``), raced against ATen's call the same way.

The functions here are what the candidate's stage module calls (an FX graph with the
product and activation replaced by one call). The runtime is built and loaded on first
use (``stitch_backend.runtime``), never at import.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

from .notes import read_note, write_note

log = logging.getLogger("stitch_backend.lt_ops")

aten = torch.ops.aten

_lock = threading.Lock()
_lt: Any = None


def _runtime() -> Any:
    global _lt
    if _lt is None:
        with _lock:
            if _lt is None:
                from .runtime import LtMatmul

                _lt = LtMatmul()
    return _lt


def _tf32(a: torch.Tensor) -> bool:
    """torch's own setting for fp32 products (eager's addmm follows it too)."""
    return a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
            epilogue: str, c: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``epilogue(a @ b (+ c) (+ bias))``: ``c``, where given, added with beta = 1;
    written into ``out`` (any rows-contiguous layout, ``lt_heads``) where given."""
    lt = _runtime()
    tf32 = _tf32(a)
    added = {} if c is None else {"c": c, "beta": 1.0}
    algo = _choose(a, b, bias, epilogue, tf32, added)
    into = {} if out is None else {"out": out}
    return lt.matmul(a, b, bias=bias, epilogue=epilogue, allow_tf32=tf32, algo_index=algo,
                     **added, **into)


def _bgrad(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g.T @ x, g.sum(0))`` by cuBLASLt's BGRADB epilogue, the heuristics' first
    algorithm (not timed: its problems are backward ones, met once per step)."""
    lt = _runtime()
    db = torch.empty(g.shape[1], dtype=g.dtype, device=g.device)
    out = lt.matmul(g, x, trans_a=True, epilogue="BGRADB", bias=db, allow_tf32=_tf32(g))
    return out, db


def _choose(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
            tf32: bool, added: dict[str, Any] | None = None) -> int:
    """The algorithm index for this problem (``added``: the ``c`` and ``beta`` of a
    residual): remembered by this process, else stored in the cache (``remember_in``),
    else timed now and remembered in both."""
    added = added or {}
    key = _problem(a, b, bias, epilogue, tf32, added.get("c"))
    algo = _algos.get(key)
    if algo is not None:
        return algo
    if torch.cuda.is_current_stream_capturing():
        # no timing inside a capture: cuBLASLt's first choice, not remembered
        log.debug("cuBLASLt problem first seen while capturing: heuristics' first algorithm")
        return 0
    store = _store
    note = _note_key(key, a.device) if store is not None else None
    algo = read_note(store, NOTE_KIND, note, _valid_algo)
    if algo is None:
        algo = _runtime().tune(a, b, bias=bias, epilogue=epilogue, allow_tf32=tf32,
                               max_algos=TUNE_ALGOS, iters=TUNE_ITERS, **added)
        write_note(store, NOTE_KIND, note, algo)
    _algos[key] = algo
    return algo


def remember_in(store: Any) -> None:
    """Keep the algorithms chosen from now on in ``store`` (a ``stitch_backend.cache``
    Store) as well, and look there before timing: other processes and warm starts then
    run the same algorithm without timing again. None: this process only. The backend
    calls it when its cache is on (the last backend's cache wins in a process)."""
    global _store
    _store = store


# cuBLASLt's heuristics rank algorithms by a model, not by a clock: the first call of each
# problem times the first TUNE_ALGOS of them (median of TUNE_ITERS runs each) and the
# process keeps the fastest for that problem (sizes, strides, dtype, epilogue, TF32, the
# operands' alignment: whatever changes the ranked list).
TUNE_ALGOS = 4
TUNE_ITERS = 10
_algos: dict[tuple, int] = {}
_store: Any = None
NOTE_KIND = "lt-algo-1"


def _note_key(key: tuple, device: torch.device) -> dict:
    """What a stored choice depends on: the problem (not the device index), the GPU,
    cuBLASLt's version and how many algorithms were timed."""
    from .runtime import load_runtime

    return {"problem": repr(key[1:]), "gpu": torch.cuda.get_device_name(device),
            "cublaslt": int(load_runtime().sc_lt_cublaslt_version()), "torch": torch.__version__,
            "timed": TUNE_ALGOS}


def _valid_algo(value: Any) -> bool:
    """A stored choice is data from disk: an index among the timed ones."""
    return type(value) is int and 0 <= value < TUNE_ALGOS


def _alignment(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    ptr = t.data_ptr()
    return min(ptr & -ptr, 256) if ptr else 256


def _problem(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
             tf32: bool, c: torch.Tensor | None = None) -> tuple:
    key = (a.device.index, a.dtype, tuple(a.shape), a.stride(), tuple(b.shape), b.stride(),
           epilogue, bias is not None, tf32, _alignment(a), _alignment(b), _alignment(bias))
    # a residual's problem (C read) is another one; without, the key is as it was
    return key if c is None else key + ("residual", c.stride(), _alignment(c))


def lt_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``act(bias + a @ b)`` for a ``*_BIAS`` epilogue, in one cuBLASLt call."""
    return _matmul(a, b, bias, epilogue)


def lt_mm(a: torch.Tensor, b: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``act(a @ b)``, in one cuBLASLt call."""
    return _matmul(a, b, None, epilogue)


def lt_residual(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``a @ b (+ bias) + residual`` in one cuBLASLt call: the residual is its C
    (beta = 1), read by the product's epilogue instead of by a kernel after it."""
    return _matmul(a, b, bias, epilogue, residual)


def lt_mm_bgrad(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear's weight and bias gradients from its output gradient ``g``:
    ``(mm(t(g), x), g.sum(0))`` in one cuBLASLt call. The graphs the Coder writes hold
    this function; it looks ``_bgrad`` up at each call, so that tests can stand in for
    the library (as ``lt_mm``/``lt_addmm`` do through ``_matmul``)."""
    return _bgrad(g, x)


def activation_epilogue(node: torch.fx.Node) -> str | None:
    """The cuBLASLt epilogue name of an activation node ("RELU", "GELU"), or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.relu.default:
        return "RELU"
    if node.target is aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "GELU" if approximate == "tanh" else None
    return None


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lt_chain(mm: torch.fx.Node, product: torch.fx.Node, first: torch.fx.Node,
              compute: list[str]) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """The epilogue nodes one cuBLASLt call can take over after ``mm`` (whose value the
    epilogue reads as ``product``, the mm or the one view after it), starting at its
    only user ``first``, which must open the epilogue's ``compute`` nodes: a relu or
    tanh-gelu; or, after an mm without bias, the add of a bias row of N (either operand
    order, no alpha), then perhaps one of those activations as its only user. ([], None)
    where none applies; else (the nodes, the bias node or None)."""
    if not compute or compute[0] != first.name:
        return [], None
    if activation_epilogue(first) is not None:
        return [first], None
    if mm.target is not aten.mm.default or first.target is not aten.add.Tensor or first.kwargs:
        return [], None
    others = [a for a in first.args if a is not product]
    bias = others[0] if len(others) == 1 and len(first.args) == 2 else None
    want = mm.meta["val"]
    bv = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
    if (not isinstance(bv, torch.Tensor) or bv.dim() != 1 or bv.shape[0] != want.shape[1]
            or bv.dtype != want.dtype or bias.name in compute):
        return [], None
    chain = [first]
    if len(first.users) == 1 and len(compute) > 1:
        (nxt,) = first.users
        if nxt.name == compute[1] and activation_epilogue(nxt) is not None:
            chain.append(nxt)
    return chain, bias


def _scalar_arg(node: torch.fx.Node, target: Any, x: Any, value: float) -> bool:
    """``node`` is ``target(x, value)`` or ``target(value, x)``, ``value`` to 1e-6."""
    if node.op != "call_function" or node.target is not target or node.kwargs \
            or len(node.args) != 2 or x not in node.args:
        return False
    (other,) = [a for a in node.args if a is not x] or [None]
    return isinstance(other, (int, float)) and abs(other - value) <= 1e-6 * abs(value)


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one user of ``node``, or None."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def tanh_gelu_chain(x: torch.fx.Node, compute: list[str]) -> list[torch.fx.Node]:
    """The nodes, in graph order, of tanh-GELU written out on ``x`` (GPT-2's NewGELU,
    L3 MiniGPT's MLP: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``),
    which cuBLASLt's GELU epilogue computes; the last is its result. [] unless ``x``'s
    users are exactly those nodes, each intermediate read only by the next, all among
    ``compute``."""
    users = list(x.users)
    if len(users) != 3:
        return []
    half = next((u for u in users if _scalar_arg(u, aten.mul.Tensor, x, 0.5)), None)
    cube = next((u for u in users if _scalar_arg(u, aten.pow.Tensor_Scalar, x, 3.0)), None)
    inner = next((u for u in users if u.target is aten.add.Tensor and u not in (half, cube)), None)
    if half is None or cube is None or inner is None:
        return []
    scaled = only_user(cube)
    if scaled is None or not _scalar_arg(scaled, aten.mul.Tensor, cube, 0.044715) \
            or only_user(scaled) is not inner or set(inner.args) != {x, scaled} or inner.kwargs:
        return []
    arg = only_user(inner)
    if arg is None or not _scalar_arg(arg, aten.mul.Tensor, inner, math.sqrt(2.0 / math.pi)):
        return []
    th = only_user(arg)
    if th is None or th.target is not aten.tanh.default:
        return []
    one = only_user(th)
    if one is None or not _scalar_arg(one, aten.add.Tensor, th, 1.0):
        return []
    out = only_user(one)
    if out is None or out is not only_user(half) or out.target is not aten.mul.Tensor \
            or set(out.args) != {half, one} or out.kwargs:
        return []
    chain = [half, cube, scaled, inner, arg, th, one, out]
    if not {n.name for n in chain} <= set(compute):
        return []
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def residual_chain(product: torch.fx.Node, compute: list[str], inputs: set[str]
                   ) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """After ``product`` (a product or the one view after it), its only user opening the
    epilogue's ``compute`` nodes: perhaps a clone (a dropout of p = 0 traces to one; L3
    MiniGPT's residual branches), then the add of a region input (``inputs``) of the
    product's shape and dtype, contiguous, no alpha: cuBLASLt's C with beta = 1. ([],
    None) where that does not apply; else (the nodes, the residual)."""
    node, src, chain = only_user(product), product, []
    if node is None or not compute or node.name != compute[0]:
        return [], None
    if node.target is aten.clone.default and node.kwargs.get(
            "memory_format", torch.preserve_format) in (torch.preserve_format,
                                                        torch.contiguous_format):
        chain, src, node = [node], node, only_user(node)
    if (node is None or node.target is not aten.add.Tensor or node.kwargs
            or len(node.args) != 2 or node.name not in compute):
        return [], None
    others = [x for x in node.args if x is not src]
    want = product.meta.get("val")
    res = others[0] if len(others) == 1 and isinstance(others[0], torch.fx.Node) else None
    rv = res.meta.get("val") if res is not None and res.name in inputs else None
    if (not isinstance(rv, torch.Tensor) or not isinstance(want, torch.Tensor)
            or tuple(rv.shape) != tuple(want.shape) or rv.dtype != want.dtype
            or not rv.is_contiguous()):
        return [], None
    return chain + [node], res


def epilogue_name(activation: str | None, has_bias: bool) -> str:
    """cuBLASLt's epilogue name: the activation's, with _BIAS when a bias is added."""
    if activation is None:
        return "BIAS" if has_bias else "DEFAULT"
    return f"{activation}_BIAS" if has_bias else activation


def lt_call(graph: torch.fx.Graph, l_mm: torch.fx.Node, bias: torch.fx.Node | None,
            epilogue: str, residual: torch.fx.Node | None = None) -> torch.fx.Node:
    """The ``lt_ops`` call computing ``l_mm`` (an addmm's own bias, or ``bias`` added to an
    mm) with ``epilogue`` (and ``residual``, viewed as the product, added as C), inserted
    at the graph's insertion point, with ``l_mm``'s meta."""
    if l_mm.target is aten.addmm.default:
        bias, a, b = l_mm.args[:3]
    else:
        a, b = l_mm.args[:2]
    if residual is not None:
        c = graph.call_function(aten.view.default, (residual, list(l_mm.meta["val"].shape)))
        call = graph.call_function(lt_residual, (a, b, bias, c, epilogue))
    elif bias is not None:
        call = graph.call_function(lt_addmm, (bias, a, b, epilogue))
    else:
        call = graph.call_function(lt_mm, (a, b, epilogue))
    call.meta = dict(l_mm.meta)
    return call


__all__ = ["DTYPES", "activation_epilogue", "epilogue_name", "lt_addmm", "lt_call", "lt_chain",
           "lt_mm", "lt_mm_bgrad", "lt_residual", "only_user", "residual_chain",
           "tanh_gelu_chain"]
