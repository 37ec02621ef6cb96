"""Every setting of the backend, typed and commented, in one place.

Each setting has a default, may be overridden by a ``STITCHCUDA_*`` environment
variable (read here and nowhere else), and may be overridden per compile through
``torch.compile(m, backend="stitchcuda", options={...})``. Tests use ``patch``.

Settings marked ``changes_code`` alter what the backend generates and are folded into
the cache key; the others (logging, cache location) do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from . import toolchain
from .exc import InvalidOptionError


def _meta(env: str | None, changes_code: bool, doc: str,
          choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A setting's metadata; ``choices``: a string setting's valid values."""
    return {"env": env, "changes_code": changes_code, "doc": doc, "choices": choices}


@dataclass
class Config:
    """The backend's settings. Construct with ``Config.from_env()`` then ``with_options``."""

    # --- what runs ---------------------------------------------------------------
    codegen: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_CODEGEN", True,
                       "Generate kernels for regions; False keeps every region on ATen."),
    )
    coder: str = field(
        default="template",
        metadata=_meta("STITCHCUDA_CODER", True,
                       "'template' (offline, default) or 'template+llm' (adds LLM candidates).",
                       choices=("template", "template+llm")),
    )
    verify: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_VERIFY", True,
                       "Verify every candidate against eager before use. Turning this off "
                       "is for debugging only; unverified kernels are then never cached."),
    )
    require_speedup: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_REQUIRE_SPEEDUP", True,
                       "Reject a verified candidate that is not faster than the eager region."),
    )
    cudagraphs: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_CUDAGRAPHS", True,
                       "Capture static-shape inference Programs into one CUDA graph."),
    )
    cudagraphs_training: bool = field(
        default=False,
        metadata=_meta("STITCHCUDA_CUDAGRAPHS_TRAINING", True,
                       "Also capture training graphs (off by default, as DESIGN.md says)."),
    )
    eager_guard: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_EAGER_GUARD", False,
                       "Time each CUDA graph, once settled, against the graph as traced "
                       "(eager, undecomposed; a training graph as a forward and backward "
                       "step) and run whichever is faster."),
    )
    channels_last: bool | None = field(
        default=None,
        metadata=_meta("STITCHCUDA_CHANNELS_LAST", True,
                       "Run the 2-D convolutions of inference graphs channels-last (NHWC), "
                       "converting layouts once at the graph's edges; outputs keep eager's "
                       "strides. 'auto' (None): only where every training BatchNorm has at "
                       "least layout_auto.AUTO_MIN_POSITIONS positions per channel. Never where a "
                       "convolution would lose precision (cuDNN's TF32 NHWC kernels; checked "
                       "at compile time, the verdicts kept in the cache): 'auto' then keeps "
                       "the graph as traced, True keeps only those convolutions NCHW. "
                       "README has the measurements behind the default, 'auto'."),
    )
    layout_race: bool | None = field(
        default=None,
        metadata=_meta("STITCHCUDA_LAYOUT_RACE", False,
                       "Under channels_last 'auto', compile an inference convolution graph in "
                       "both layouts, time the two Programs on the first real inputs once "
                       "both have settled, and keep the faster (twice the compile time, and "
                       "the other Program's work in the first calls; layout_race.py). "
                       "'auto' (None, the default): only where 'auto' kept the traced layout "
                       "for its BatchNorm positions rule, a guess that measurements went "
                       "both ways on (layout_auto.few_positions), or where the rewrite runs "
                       "a convolution with cuDNN's TF32 off (precision)."),
    )
    split_stats: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_SPLIT_STATS", True,
                       "Also race split-statistics candidates for training BatchNorm over "
                       "few channels of an NCHW input and for layer norm over few rows "
                       "(the Verifier keeps the faster; README has the measurement behind "
                       "the default)."),
    )
    fuse_roots: bool | None = field(
        default=None,
        metadata=_meta("STITCHCUDA_FUSE_ROOTS", True,
                       "Planner: a pointwise op reading only graph inputs joins its first "
                       "fused consumer's region instead of opening its own (KLDiv's loss "
                       "becomes one region; a training BatchNorm's backward one kernel "
                       "instead of four). 'auto' (None, the default): in backward graphs "
                       "only; README has the measurements behind it."),
    )
    recompute: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_RECOMPUTE", True,
                       "Training: split the joint graph with AOTAutograd's min-cut "
                       "rematerialisation partitioner (as Inductor does): the forward saves "
                       "fewer activations and the backward recomputes cheap pointwise ops "
                       "(RegNet's forward saves 817 MiB instead of 1160). False: the default "
                       "partitioner, which saves every forward value the backward reads."),
    )
    cpu_interpret: bool = field(
        default=False,
        metadata=_meta("STITCHCUDA_CPU_INTERPRET", True,
                       "Testing aid: on CPU inputs, run generated kernels through the kernel-IR "
                       "interpreter, so the Coder/Verifier/Program pipeline runs without a "
                       "GPU. Never faster than ATen."),
    )
    # Precision: defaults follow eager under the user's settings (DESIGN.md). The
    # looser modes are opt-in by name.
    allow_tanh_gelu: bool = field(
        default=False,
        metadata=_meta("STITCHCUDA_ALLOW_TANH_GELU", True,
                       "Permit replacing exact (erf) GELU by the tanh form (looser)."),
    )
    dynamic: bool | None = field(
        default=None,
        metadata=_meta("STITCHCUDA_DYNAMIC", True,
                       "None: follow Dynamo; True/False forces symbolic/static sizes in AOT."),
    )
    arch: str | None = field(
        default=None,
        metadata=_meta("STITCHCUDA_ARCH", True,
                       "Target arch such as 'sm_90a'; None reads it off the current device."),
    )
    # --- budgets -----------------------------------------------------------------
    max_attempts: int = field(
        default=3,
        metadata=_meta("STITCHCUDA_MAX_ATTEMPTS", True,
                       "Coder/Verifier iterations per region before it stays on ATen."),
    )
    progress: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_PROGRESS", False,
                       "Progress bars on a terminal for steps that run over 2 s (compiling "
                       "candidates, the LLM Coder, verifying at the first call)."),
    )
    compiler: str = field(
        default="auto",
        metadata=_meta("STITCHCUDA_COMPILER", True,
                       "What compiles generated kernels: 'auto' (NVRTC when libnvrtc loads, "
                       "else nvcc), 'nvrtc' or 'nvcc'. NVRTC compiles in this process, 2.3-5x "
                       "faster a kernel than an nvcc process (toolchain.py).",
                       choices=toolchain.COMPILERS),
    )
    compile_workers: int = field(
        default=0,
        metadata=_meta("STITCHCUDA_COMPILE_WORKERS", False,
                       "Parallel compiles (NVRTC threads or nvcc processes); 0 means one per "
                       "CPU core."),
    )
    # --- cache and logging (do not change code) ----------------------------------
    cache: bool = field(
        default=True,
        metadata=_meta("STITCHCUDA_CACHE", False, "Read and write the artifact cache."),
    )
    cache_dir: str = field(
        default="",
        metadata=_meta("STITCHCUDA_CACHE_DIR", False,
                       "Cache root; empty means ~/.cache/stitchcuda."),
    )
    log_level: str = field(
        default="",
        metadata=_meta("STITCHCUDA_LOG", False,
                       "Logging level for 'stitch_backend' loggers (DEBUG, INFO, ...)."),
    )
    llm_base_url: str = field(
        default="",
        metadata=_meta("STITCHCUDA_LLM_BASE_URL", False,
                       "OpenAI-compatible endpoint for the optional LLM Coder."),
    )
    llm_model: str = field(
        default="",
        metadata=_meta("STITCHCUDA_LLM_MODEL", False, "Model name for the LLM Coder."),
    )
    # The API key is deliberately not a setting: settings are reported and hashed, the
    # key must never be. ``llm_api_key()`` reads it from the environment when needed.
    llm_timeout_s: int = field(
        default=120,
        metadata=_meta("STITCHCUDA_LLM_TIMEOUT_S", False,
                       "Seconds one LLM request may take before it counts as failed."),
    )
    llm_max_tokens: int = field(
        default=8192,
        metadata=_meta("STITCHCUDA_LLM_MAX_TOKENS", False,
                       "Completion tokens one LLM reply may use."),
    )
    llm_iterations: int = field(
        default=4,
        metadata=_meta("STITCHCUDA_LLM_ITERATIONS", False,
                       "LLM Coder budget per region: model calls (generate + repairs)."),
    )
    llm_budget_tokens: int = field(
        default=100_000,
        metadata=_meta("STITCHCUDA_LLM_BUDGET_TOKENS", False,
                       "LLM Coder budget per region: prompt + completion tokens."),
    )
    llm_budget_s: int = field(
        default=600,
        metadata=_meta("STITCHCUDA_LLM_BUDGET_S", False,
                       "LLM Coder budget per region: wall seconds."),
    )
    llm_hot_percent: int = field(
        default=90,
        metadata=_meta("STITCHCUDA_LLM_HOT_PERCENT", False,
                       "The LLM Coder works on a graph's hottest regions, slowest first, "
                       "until they cover this percentage of the ATen time measured at the "
                       "first call (1-100; 100: every region it can take)."),
    )
    llm_trajectory_dir: str = field(
        default="",
        metadata=_meta("STITCHCUDA_LLM_TRAJECTORY_DIR", False,
                       "Folder for the LLM Coder's trajectories (JSONL, one file per graph, "
                       "appended after every step); empty keeps them in memory only."),
    )
    llm_sandbox_timeout_s: int = field(
        default=120,
        metadata=_meta("STITCHCUDA_LLM_SANDBOX_TIMEOUT_S", False,
                       "Seconds the child process may take to compile or first-run one "
                       "LLM candidate before it is killed and the candidate rejected."),
    )

    # ------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Config":
        """A Config with defaults overridden by the ``STITCHCUDA_*`` environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata["env"]
            if var and var in env and env[var] != "":
                values[f.name] = _parse(f, env[var], source=var)
        return cls(**values)

    def with_options(self, options: dict[str, Any] | None) -> "Config":
        """A copy with ``options`` applied; unknown names raise InvalidOptionError."""
        if not options:
            return dataclasses.replace(self)
        known = {f.name: f for f in fields(self)}
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise InvalidOptionError(
                    f"unknown stitchcuda option {name!r}.{hint} Valid options: "
                    + ", ".join(sorted(known))
                )
            values[name] = _parse(known[name], value, source=f"options[{name!r}]")
        return dataclasses.replace(self, **values)

    def code_options(self) -> dict[str, Any]:
        """The settings that change generated code: these go into the cache key."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["changes_code"]}

    def cache_root(self) -> Path:
        """Where the artifact cache lives."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else (
            Path.home() / ".cache" / "stitchcuda")

    @staticmethod
    def describe() -> list[tuple[str, str, str, str]]:
        """(name, type, env var, doc) for every setting, for ``stitchcuda doctor``."""
        return [(f.name, str(f.type), f.metadata["env"] or "", f.metadata["doc"])
                for f in fields(Config)]


LLM_API_KEY_ENV: tuple[str, ...] = ("STITCHCUDA_LLM_API_KEY", "OPENAI_API_KEY")


def llm_api_key(environ: dict[str, str] | None = None) -> str:
    """The LLM endpoint's API key from ``STITCHCUDA_LLM_API_KEY``, else ``OPENAI_API_KEY``;
    "" when neither is set. Callers hand it to the client only: it is never part of a
    Config, a cache key, a log line, a trajectory or a report."""
    env = os.environ if environ is None else environ
    for var in LLM_API_KEY_ENV:
        if env.get(var):
            return env[var]
    return ""


def _parse(f: dataclasses.Field, value: Any, *, source: str) -> Any:
    """Coerce ``value`` (a string from the environment, or a Python value) to ``f``'s type."""
    kind = str(f.type)
    try:
        if kind.startswith("bool"):
            if value is None and "None" in kind:
                return None
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            if text in ("none", "auto") and "None" in kind:
                return None
            raise ValueError(f"expected a boolean, got {value!r}")
        if kind.startswith("int"):
            if isinstance(value, bool):
                raise ValueError(f"expected an integer, got {value!r}")
            number = int(value)
            if f.name == "llm_hot_percent" and not 1 <= number <= 100:
                raise ValueError(f"expected a percentage from 1 to 100, got {number}")
            return number
        if kind.startswith("str"):
            if value is None and "None" in kind:
                return None
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            choices = f.metadata["choices"]
            if choices is not None and value not in choices:
                raise ValueError("expected one of " + ", ".join(map(repr, choices)))
            return value
    except ValueError as err:
        raise InvalidOptionError(f"stitchcuda setting {f.name} from {source}: {err}") from None
    raise AssertionError(f"unhandled config type {kind}")


_patched: Config | None = None


def current() -> Config:
    """The process-wide settings: the environment as it is now (read on each call, so a
    backend made after ``os.environ`` changes sees the change), or a ``patch``."""
    return _patched if _patched is not None else Config.from_env()


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[Config]:
    """Temporarily change process-wide settings (for tests): ``with config.patch(codegen=False)``."""
    global _patched
    before = _patched
    _patched = current().with_options(changes)
    try:
        yield _patched
    finally:
        _patched = before
