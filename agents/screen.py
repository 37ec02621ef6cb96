"""Static screen of untrusted kernel source, before anything compiles or runs it.

An LLM-written kernel must be a drop-in replacement of its template kernel: one
``extern "C" __global__`` entry with the template's name and parameter types, launched
by the template's launch rule. The screen rejects what could escape that contract or
game the Verifier: includes other than the project's headers and cuda_fp16/bf16, host
code (any function that is not ``__device__``/``__global__``), calls into torch/ATen/
cuBLAS/cuDNN, allocation, streams, events, threads, files, printf, inline asm, state kept
between launches (namespace-scope ``__device__``/``__managed__``/``__constant__``
variables, ``static`` variables), dynamic shared memory (the launch gives none), float
atomics (non-deterministic; integer tickets as in the templates are fine), and a launch
bound below the template's. It is deliberately conservative: what it cannot read, it
rejects with the reason, and the reason goes back to the model as feedback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_SOURCE_CHARS = 200_000
ALLOWED_INCLUDES = frozenset({"fused_ops.cuh", "common.cuh", "cuda_fp16.h", "cuda_bf16.h"})

# Identifiers (whole words) that have no business in a kernel: host APIs, libraries,
# allocation, streams/events/graphs, threads, files, processes, output, inline asm.
_FORBIDDEN_WORDS = (
    r"torch|at\s*::|c10|ATen|pybind11|Py\w*|cublas\w*|cublasLt\w*|cudnn\w*|cufft\w*|curand\w*|"
    r"cusparse\w*|cusolver\w*|nccl\w*|cudaMalloc\w*|cudaFree\w*|cudaMemcpy\w*|cudaMemset\w*|"
    r"cudaStream\w*|cudaEvent\w*|cudaLaunch\w*|cudaGraph\w*|cudaDevice\w*|cudaSetDevice|"
    r"cudaHost\w*|cudaGetSymbol\w*|cudaMemcpyToSymbol\w*|cu[A-Z]\w*|malloc|calloc|realloc|"
    r"free|new|delete|std|thread|pthread_\w*|fork|exec\w*|system|popen|dlopen|dlsym|getenv|"
    r"fopen|fwrite|fread|fprintf|fputs|printf|puts|FILE|open|write|read|mmap|asm|__asm__|"
    r"__asm|main|__managed__|__constant__|namespace|goto|clock|clock64|"
    r"globaltimer|__nanosleep|cooperative_groups|grid_group|this_grid"
)
_FORBIDDEN_RE = re.compile(rf"(?<![\w.>])(?:{_FORBIDDEN_WORDS})\b")
_ATOMIC_RE = re.compile(r"\b((?:unsafe)?[Aa]tomic\w*|__atomic\w*|__sync_\w+)\s*\(")
_INT_TYPES = re.compile(
    r"^(?:(?:const|volatile)\s+)*(?:unsigned\s+long\s+long(?:\s+int)?|unsigned\s+int|"
    r"unsigned|long\s+long(?:\s+int)?|int|u?int(?:32|64)_t)(?:\s+(?:const|volatile))*$")
_TYPE_KEYWORDS = ("const", "volatile", "unsigned", "signed", "long", "short", "__restrict__")

_SIGNATURE_CODES = {
    "int": "i", "int32_t": "i", "unsigned int": "u", "unsigned": "u", "uint32_t": "u",
    "long long": "l", "long long int": "l", "int64_t": "l", "float": "f", "double": "d",
}


@dataclass(frozen=True)
class Screen:
    """The screen's verdict: ``ok``, else ``reason`` says what was found and where."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class EntrySignature:
    """An ``extern "C" __global__`` kernel's name, parameter types (qualifiers that do
    not change the ABI dropped) and launch bound (None when it declares none)."""

    name: str
    types: tuple[str, ...]
    names: tuple[str, ...] = field(default=(), compare=False)
    launch_bounds: int | None = field(default=None, compare=False)
    text: str = field(default="", compare=False)

    @property
    def codes(self) -> str:
        """The launch signature letters (p pointer, i int32, u uint32, l int64, f, d)."""
        return "".join("p" if t.endswith("*") else _SIGNATURE_CODES.get(t, "?")
                       for t in self.types)


class SourceError(ValueError):
    """Source the screen cannot read (an unterminated comment or literal)."""


# --------------------------------------------------------------------------- lexing


def _lex(source: str) -> tuple[str, list[tuple[int, str]]]:
    """The source with lines spliced and comments blanked (offsets kept), and every
    string/char literal as (offset, text)."""
    text = source.replace("\\\r\n", "").replace("\\\n", "")
    out = list(text)
    literals: list[tuple[int, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise SourceError("unterminated /* comment")
            out[i:j + 2] = [ch if ch == "\n" else " " for ch in text[i:j + 2]]
            i = j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\n":
                    raise SourceError(f"unterminated literal at line {_line(text, i)}")
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise SourceError(f"unterminated literal at line {_line(text, i)}")
            literals.append((i, text[i:j + 1]))
            i = j + 1
        else:
            i += 1
    return "".join(out), literals


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _matching(text: str, open_at: int, pair: str = "()") -> int:
    """Offset of the bracket closing the one at ``open_at``; -1 if none."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == pair[0]:
            depth += 1
        elif text[j] == pair[1]:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _top_level(code: str) -> list[tuple[int, str]]:
    """Statements at file scope as (offset, text), every brace body collapsed to ``{}``."""
    code = re.sub(r"^[ \t]*#.*$", lambda m: " " * len(m.group(0)), code, flags=re.M)
    pieces: list[tuple[int, str]] = []
    start, depth, buf = 0, 0, []
    for i, c in enumerate(code):
        if c == "{":
            if depth == 0:
                buf.append("{")
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                buf.append("}")
                rest = code[i + 1:].lstrip()
                if not rest.startswith(";"):  # a function body ends the statement
                    pieces.append((start, "".join(buf)))
                    buf, start = [], i + 1
        elif depth == 0:
            if c == ";":
                pieces.append((start, "".join(buf) + ";"))
                buf, start = [], i + 1
            else:
                buf.append(c)
    if "".join(buf).strip():
        pieces.append((start, "".join(buf)))
    return [(o, p.strip()) for o, p in pieces if p.strip()]


# --------------------------------------------------------------------------- the signature


def _normalise_type(decl: str) -> tuple[str, str]:
    """(type, name) of one parameter declaration, ABI-neutral qualifiers dropped."""
    decl = re.sub(r"\b(?:__restrict__|__restrict|restrict|const|volatile)\b", " ", decl)
    decl = re.sub(r"\s*\*\s*", "*", decl)
    decl = " ".join(decl.split())
    m = re.match(r"^(.*?[\w*>])\s*\b([A-Za-z_]\w*)$", decl)
    if m and m.group(1).strip() and not m.group(1).strip().endswith(("unsigned", "long")):
        typ, name = m.group(1), m.group(2)
    else:
        typ, name = decl, ""
    typ = re.sub(r"\s*\*", "*", typ).strip()
    return typ, name


def parse_entry(source: str) -> EntrySignature:
    """The single ``extern "C" __global__`` kernel of ``source``; SourceError when there
    is none, more than one, or its header cannot be read."""
    code, _ = _lex(source)
    starts = [m.start() for m in re.finditer(r'\bextern\s+"C"', code)]
    if len(starts) != 1:
        raise SourceError(f'expected exactly one extern "C" kernel, found {len(starts)}')
    start = starts[0]
    brace = code.find("{", start)
    if brace < 0:
        raise SourceError('the extern "C" kernel has no body')
    header = code[start:brace]
    close = header.rfind(")")
    open_ = _matching_back(header, close)
    if close < 0 or open_ < 0:
        raise SourceError('cannot read the extern "C" kernel\'s parameter list')
    head = header[:open_]
    m = re.search(r"([A-Za-z_]\w*)\s*$", head)
    if m is None or "__global__" not in head or not re.search(r"\bvoid\b", head):
        raise SourceError('the extern "C" entry must read `extern "C" __global__ void name(...)`')
    bounds = re.search(r"__launch_bounds__\s*\(\s*(\d+)", head)
    params = [p.strip() for p in header[open_ + 1:close].split(",")]
    params = [p for p in params if p and p != "void"]
    pairs = [_normalise_type(p) for p in params]
    return EntrySignature(name=m.group(1), types=tuple(t for t, _ in pairs),
                          names=tuple(n for _, n in pairs),
                          launch_bounds=int(bounds.group(1)) if bounds else None,
                          text=" ".join(header.split()))


def _matching_back(text: str, close_at: int) -> int:
    depth = 0
    for j in range(close_at, -1, -1):
        if text[j] == ")":
            depth += 1
        elif text[j] == "(":
            depth -= 1
            if depth == 0:
                return j
    return -1


# --------------------------------------------------------------------------- the checks


def screen(source: str, template: EntrySignature) -> Screen:
    """Whether ``source`` may be compiled and run in place of the kernel ``template``
    describes; the first problem found is the reason."""
    if len(source) > MAX_SOURCE_CHARS:
        return Screen(False, f"source is {len(source)} characters (limit {MAX_SOURCE_CHARS})")
    try:
        code, literals = _lex(source)
        entry = parse_entry(source)
    except SourceError as err:
        return Screen(False, str(err))
    for check in (_preprocessor_tricks, _forbidden_words, _includes_and_literals,
                  _file_scope, _statics, _dynamic_shared, _float_atomics):
        reason = check(code, literals)
        if reason:
            return Screen(False, reason)
    return _matches_template(entry, template)


def _includes_and_literals(code: str, literals: list[tuple[int, str]]) -> str:
    allowed_at: set[int] = set()
    for m in re.finditer(r"^[ \t]*#[ \t]*include\b(.*)$", code, re.M):
        arg = m.group(1).strip()
        inc = re.fullmatch(r'"([^"]+)"|<([^>]+)>', arg)
        if inc is None:
            return f"line {_line(code, m.start())}: #include must name a header literally"
        name = inc.group(1) or inc.group(2)
        if name not in ALLOWED_INCLUDES:
            return (f"line {_line(code, m.start())}: #include of {name!r} is not allowed "
                    f"(only {', '.join(sorted(ALLOWED_INCLUDES))})")
        allowed_at.add(m.start(1) + m.group(1).index(arg[0]))
    for m in re.finditer(r'\bextern\s+("C")', code):
        allowed_at.add(m.start(1))
    for offset, text in literals:
        if offset not in allowed_at:
            return (f"line {_line(code, offset)}: string/char literal {text[:40]!r}: kernels "
                    "print nothing and read no files")
    return ""


def _preprocessor_tricks(code: str, _literals) -> str:
    if "##" in code or "%:" in code:
        return "token pasting (## or %:) is not allowed: forbidden names must stay visible"
    if "<%" in code or "%>" in code:
        return "digraphs (<% %>) are not allowed"
    m = re.search(r"\\[uU][0-9A-Fa-f]", code)
    if m:
        return f"line {_line(code, m.start())}: universal character names are not allowed"
    return ""


def _forbidden_words(code: str, _literals) -> str:
    for m in _FORBIDDEN_RE.finditer(code):
        word = m.group(0)
        return (f"line {_line(code, m.start())}: `{word}` is not allowed in a kernel "
                "(no host APIs, libraries, allocation, streams, threads, I/O, asm or "
                "timers; device code only)")
    return ""


def _file_scope(code: str, _literals) -> str:
    """Every file-scope statement is a device/global function, a type, a template or a
    using/typedef; never a variable (state across launches) or a host function."""
    for offset, stmt in _top_level(code):
        line = _line(code, offset)
        body = stmt.endswith("}")
        words = set(re.findall(r"[A-Za-z_]\w*", stmt.split("{")[0]))
        paren = stmt.find("(")
        eq = stmt.find("=")
        is_function = paren >= 0 and (eq < 0 or eq > paren) and "[" not in stmt[:max(paren, 0)]
        if re.match(r"^(?:typedef|using)\b", stmt) or re.match(
                r"^(?:template\s*<[^{]*?>\s*)?(?:struct|class|union|enum)(?:\s+class)?\s+\w+"
                r"[^{;=()]*(?:\{\}\s*;|;)$", stmt, re.S):
            continue
        if re.search(r"\(\s*\*", stmt.split("{")[0]):
            return f"line {line}: function pointer at file scope: nothing may live between launches"
        if stmt.startswith("extern") and "__global__" in words:
            continue
        if is_function and words & {"__device__", "__global__"}:  # __host__ __device__ too
            if "__global__" in words:
                return (f"line {line}: a second kernel; only the one extern \"C\" entry may "
                        "be __global__")
            continue
        if is_function and (body or stmt.endswith(";")):
            return f"line {line}: host function `{stmt[:60]}`: no host code is allowed"
        return (f"line {line}: file-scope variable or statement `{stmt[:60]}`: nothing may "
                "live between launches")
    return ""


def _statics(code: str, _literals) -> str:
    for m in re.finditer(r"\bstatic\b(?!_)", code):
        rest = code[m.end():]
        stop = min((i for i in (rest.find(";"), rest.find("{"), rest.find("=")) if i >= 0),
                   default=len(rest))
        decl = rest[:stop]
        if "(" in decl or "__shared__" in decl:
            continue  # a static function, or per-block shared memory
        return f"line {_line(code, m.start())}: static variable: nothing may live between launches"
    return ""


def _dynamic_shared(code: str, _literals) -> str:
    m = re.search(r"\bextern\b(?!\s+\"C\")", code)
    if m:
        return (f"line {_line(code, m.start())}: `extern` declarations (dynamic shared memory "
                "included) are not allowed: the launch gives no dynamic shared memory")
    return ""


def _declared_type(code: str, name: str) -> str | None:
    """The declared element type of ``name`` (pointer or array), or None if not found."""
    words = (r"(?:(?:const|volatile|unsigned|signed|long|short|__restrict__|__shared__|"
             r"__align__\(\d+\))\s+)*")
    pat = re.compile(rf"\b({words}[A-Za-z_]\w*(?:\s+(?:int|long))?)\s*\*+\s*"
                     rf"(?:(?:const|__restrict__|volatile)\s*)*{re.escape(name)}\b"
                     rf"|\b({words}[A-Za-z_]\w*(?:\s+(?:int|long))?)\s+{re.escape(name)}\s*\[")
    m = pat.search(code)
    if m is None:
        return None
    typ = m.group(1) or m.group(2)
    typ = re.sub(r"\b(?:__restrict__|__shared__|__align__\(\d+\))", " ", typ)
    return " ".join(typ.split())


def _float_atomics(code: str, _literals) -> str:
    for m in _ATOMIC_RE.finditer(code):
        line = _line(code, m.start())
        close = _matching(code, m.end() - 1)
        args = code[m.end():close] if close > 0 else ""
        depth, first = 0, args
        for i, c in enumerate(args):
            depth += c in "([<"
            depth -= c in ")]>"
            if c == "," and depth == 0:
                first = args[:i]
                break
        cast = re.search(r"\(\s*([\w\s]+?)\s*\*+\s*\)|_cast\s*<\s*([\w\s]+?)\s*\*+\s*>", first)
        if cast:
            typ = cast.group(1) or cast.group(2)
        else:
            ident = re.search(r"[A-Za-z_]\w*", first)
            typ = _declared_type(code, ident.group(0)) if ident else None
        if typ is None:
            return (f"line {line}: {m.group(1)} on a value whose type the screen cannot "
                    "read; only integer atomics on declared int/unsigned buffers are allowed")
        if not _INT_TYPES.match(typ.strip()):
            return (f"line {line}: {m.group(1)} on {typ}: atomics on floating-point (or "
                    "non-integer) values are not deterministic and are not allowed")
    return ""


def _matches_template(entry: EntrySignature, template: EntrySignature) -> Screen:
    if entry.name != template.name:
        return Screen(False, f"entry is named {entry.name!r}; it must be {template.name!r}")
    if entry.types != template.types:
        return Screen(False, f"parameters ({', '.join(entry.types)}) differ from the "
                             f"template's ({', '.join(template.types)})")
    if (template.launch_bounds and entry.launch_bounds
            and entry.launch_bounds < template.launch_bounds):
        return Screen(False, f"__launch_bounds__({entry.launch_bounds}) is below the template's "
                             f"{template.launch_bounds}: the launch would fail")
    return Screen(True, "")
