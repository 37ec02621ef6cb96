"""Loads that a ``where`` makes unnecessary: skip reading what no branch taken uses.

A causal attention mask is ``where(mask == 0, -inf, scores)``: where the mask is zero
the scores are never read, yet a kernel that loads first and selects later moves them
all from memory. ``guarded_loads`` finds each vector load whose every use (in every
store, reduction and index of the kernel) goes through one branch of one ``where``
whose condition does not read it. The emitter then evaluates that condition for the
chunk's lanes first and loads the chunk only when some lane takes the branch that reads
it (``emit_cuda._vector_chunk``). The values are the same bit for bit: a lane that takes
the other branch never looks at the load, whatever it holds (NaN included), and the
stores are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernel_ir import Expr, KernelIR, Load, Op, RedRef, children, walk


@dataclass(frozen=True)
class Guard:
    """Load the chunk unless ``cond`` equals ``skip_when`` in every lane."""

    cond: Expr
    skip_when: bool


def _roots(ir: KernelIR) -> list[Expr]:
    return ([s.value for s in ir.stores] + [r.body for r in ir.reductions]
            + [e for _, e in ir.data_vars])


def _reaches(roots: list[Expr], target: Expr, cut: Op | None = None, branch: int = 0) -> bool:
    """Whether ``target`` is a sub-expression of ``roots`` when the ``branch``-th argument
    of ``cut`` is not followed."""
    seen: set = set()
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e == target:
            return True
        if e in seen:
            continue
        seen.add(e)
        kids = children(e)
        if cut is not None and e == cut:
            kids = tuple(c for i, c in enumerate(kids) if i != branch)
        stack.extend(kids)
    return False


def guarded_loads(ir: KernelIR, vloads: dict) -> dict[Load, Guard]:
    """For each of ``vloads`` (the kernel's vector loads) that only one branch of one
    ``where`` reads, the condition under which a chunk need not be loaded. A condition
    that reads a reduction's result or another guarded load disqualifies its guard, so
    every condition can be evaluated from loads made before the guarded ones."""
    roots = _roots(ir)
    wheres = [e for e in walk(roots) if isinstance(e, Op) and e.name == "where"]
    out: dict[Load, Guard] = {}
    for ld in vloads:
        for w in wheres:
            cond = w.args[0]
            if any(isinstance(n, RedRef) for n in walk([cond])) or _reaches([cond], ld):
                continue
            for branch, skip_when in ((2, True), (1, False)):
                if _reaches([w.args[branch]], ld) and not _reaches(roots, ld, w, branch):
                    out[ld] = Guard(cond, skip_when)
                    break
            if ld in out:
                break
    changed = True
    while changed:
        changed = False
        for ld, g in list(out.items()):
            if any(_reaches([g.cond], other) for other in out if other != ld):
                del out[ld]
                changed = True
    return out


__all__ = ["Guard", "guarded_loads"]
