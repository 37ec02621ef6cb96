"""Loads issued ahead of their use in a reduction pass's loop over a row
(``emit_reduction``): the global loads of several chunks, or of several steps of one
element, fetched into registers first, then used, where ptxas's own schedule of an
unrolled loop left one load in flight a thread."""

from __future__ import annotations

import re

from .emit_expr import IssuedLoad, Scope
from .kernel_ir import Load

# Chunks whose global loads a pass issues together (``batched_loop``). A cluster-layout
# block holds one row share an SM (its shared memory), so its 1024 threads are all the
# loads in flight there. A pass of one element a thread and step (4-byte loads): ptxas
# reused one register for the loads of L1 39's unrolled steps, each waiting for the one
# before (SASS of its template, sm_90a, nvcc 13); 4 steps a batch keep its kernels at 32
# registers (two blocks of 1024 threads an SM: 32 KB of loads in flight), 8 took 44-50.
BATCH = 4
# The inner layout's vector path batched too: off until measured (its SASS for L1 23's
# softmax has one or two 16-byte loads in flight a thread, yet that template moved
# 3.9 TB/s on the H200 in session 37); a flag so that one process can time both forms.
# A tuning switch, not an option: set at run time it is in no cache key (the key's code
# digest covers its default, as written here), so only timing scripts that bypass the
# cache flip it.
BATCH_INNER_VECTOR = False


def batches(vector: bool, kept, batch_rows: bool) -> bool:
    """Whether a pass's loop issues several chunks' loads ahead (``batched_loop``): the
    cluster layout's vector passes, the rows' scalar passes, and the inner layout's
    vector passes where BATCH_INNER_VECTOR is set (read here, at generation)."""
    if vector:
        return kept is not None or (BATCH_INNER_VECTOR and batch_rows)
    return batch_rows


def batched_width(issued: list[IssuedLoad]) -> int:
    """How many chunks' global loads ``batched_loop`` issues before using the first:
    BATCH, fewer where the chunk has more than two loads (their registers); 0 where it
    has none (a pass that reads the row from shared memory)."""
    n = len(issued)
    return 0 if n == 0 else max(1, BATCH * 2 // max(n, 2))


def leading_loads(el: Scope) -> list[IssuedLoad]:
    """The global loads that lead a scalar chunk's lines (``const T tN = VALUE;`` of a
    Load, before any other line of the element), for ``batched_loop`` to issue ahead;
    a load after a computed line, or whose address reads another value, stays where it
    is (only the index lines of ``el.pre`` come before them, so the batch's fetch loop
    reads nothing it has not defined)."""
    names = {n: e for e, n in el.names.items() if isinstance(e, Load)}
    out = []
    for line in el.lines:
        m = _DEF.match(line)
        if m is None or m.group(2) not in names or _NAME.search(m.group(3)):
            break
        out.append(IssuedLoad(line, m.group(2), m.group(1), m.group(3)))
    return out


_DEF = re.compile(r"\s*const (.+?) (t\d+) = (.*);$")
_NAME = re.compile(r"\bt\d+\b")


def batched_loop(IDX: str, chunk: Scope, vec: int, span: tuple[str, str], ind: str,
                 width: int) -> list[str] | None:
    """The pass's loop over its chunks with the global loads of U = ``width`` chunks
    (``batched_width``) issued together, then used: ``#pragma unroll 4`` alone left one
    load in flight a thread (the loop's exit test between chunks, and a softmax's online
    maximum branching in each, keep the compiler from moving the next chunk's load up;
    seen in the SASS of L1 23's cluster kernel). Whole groups of U chunks first, the last
    chunks one at a time, in a block of their own. None (the plain loop) where fewer than
    two chunks batch, or a line before the last load is not a constant definition (the
    chunk's index arithmetic)."""
    if width < 2:
        return None
    lines = chunk.render()
    by_line = {ld.line: ld for ld in chunk.issued}
    last = max(i for i, line in enumerate(lines) if line in by_line)
    if not all(line.lstrip().startswith("const ") for line in lines[:last + 1]):
        return None
    step = f"({IDX})TK * {vec}"
    fetch, use = [], []
    for i, line in enumerate(lines):
        ld = by_line.get(line)
        lead = line[:len(line) - len(line.lstrip())] + "  "
        if ld is None:
            use.append("  " + line)
            if i <= last:
                fetch.append("  " + line)
            continue
        fetch.append(f"{lead}pf_{ld.name}[u] = {ld.value};")
        got = f"pf_{ld.name}[u]" if ld.fill is None else f"({ld.fill} = pf_{ld.name}[u])"
        use.append(f"{lead}const {ld.vt} {ld.name} = {got};")
    out = [f"{ind}{IDX} kq = {span[0]}({IDX})tk * {vec};",
           f"{ind}for (; kq + {width - 1} * {step} < {span[1]}; kq += {width} * {step}) {{"]
    out += [f"{ind}  {ld.vt} pf_{ld.name}[{width}];" for ld in chunk.issued]
    for body in (fetch, use):
        out += [f"{ind}  #pragma unroll", f"{ind}  for (int u = 0; u < {width}; ++u) {{",
                f"{ind}    const {IDX} k0 = kq + ({IDX})u * {step};"]
        out += body
        out.append(f"{ind}  }}")
    out.append(f"{ind}}}")
    out.append(f"{ind}for ({IDX} k0 = kq; k0 < {span[1]}; k0 += {step}) {{")
    out += lines
    out.append(f"{ind}}}")
    # a block of its own: each pass over the row declares its kq
    return [f"{ind}{{"] + ["  " + line for line in out] + [f"{ind}}}"]
