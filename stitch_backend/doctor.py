"""``stitchcuda doctor``: what this machine offers the backend, and what is missing."""

from __future__ import annotations

import platform
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from . import config as config_mod
from .toolchain import (ToolchainError, find_nvcc, nvcc_version, nvrtc_version,
                        resolve_compiler)
from .version import __version__


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    ok: bool
    detail: str
    required: bool = True  # a failed required check makes the exit code non-zero


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return all(c.ok for c in self.checks if c.required)

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "facts": self.facts,
                "checks": [asdict(c) for c in self.checks]}


def diagnose() -> DoctorReport:
    """Inspect torch, CUDA, the GPU, nvcc, the cache directory and the LLM settings.

    A machine without a GPU is healthy (the backend then runs graphs on ATen); the
    report says what is missing for code generation.
    """
    report = DoctorReport()
    cfg = config_mod.Config.from_env()
    report.facts["stitchcuda"] = __version__
    report.facts["python"] = platform.python_version()
    try:
        import torch
    except ImportError as err:  # pragma: no cover - torch is a dependency
        report.checks.append(Check("torch", False, f"cannot import torch: {err}"))
        return report
    report.facts["torch"] = torch.__version__
    report.facts["torch_cuda"] = str(torch.version.cuda)
    report.checks.append(Check("torch", True, f"torch {torch.__version__}"))

    import torch._dynamo

    registered = "stitchcuda" in torch._dynamo.list_backends()
    report.checks.append(Check(
        "backend registered", registered,
        "torch.compile(backend='stitchcuda') is available" if registered else
        "the torch_dynamo_backends entry point is missing: reinstall with pip install ."))

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        props = torch.cuda.get_device_properties(0)
        report.facts.update(gpu=props.name, arch=arch, sm_count=props.multi_processor_count,
                            gpu_memory_gib=round(props.total_memory / 2**30, 1))
        report.checks.append(Check("GPU", True, f"{props.name}, {arch}, "
                                   f"{props.multi_processor_count} SMs"))
    else:
        why = ("torch is a CPU build" if torch.version.cuda is None
               else "no CUDA device is visible")
        report.checks.append(Check("GPU", False, f"{why}: compiled graphs run on ATen, "
                                   "no kernels are generated", required=False))

    nvcc = find_nvcc()
    try:
        version = nvcc_version(nvcc) if nvcc else None
    except (ToolchainError, OSError):
        version = None
    report.facts["nvcc"] = version
    report.checks.append(Check("nvcc", nvcc is not None,
                               f"{nvcc} ({version})" if nvcc else
                               "not found (set CUDA_HOME or put nvcc on PATH); the cuBLASLt "
                               "runtime cannot be built", required=False))
    try:
        nvrtc = nvrtc_version()
    except ToolchainError:
        nvrtc = None
    report.facts["nvrtc"] = nvrtc
    report.checks.append(Check("NVRTC", nvrtc is not None,
                               f"libnvrtc {nvrtc}" if nvrtc else "libnvrtc does not load "
                               "(pip install nvidia-cuda-nvrtc)", required=False))
    try:
        compiler = resolve_compiler(cfg.compiler)
    except ToolchainError:
        compiler = None
    report.facts["compiler"] = compiler
    report.checks.append(Check("kernel compiler", compiler is not None,
                               f"{compiler} (setting compiler={cfg.compiler!r})" if compiler
                               else f"none for compiler={cfg.compiler!r}: generated kernels "
                               "cannot be compiled", required=False))

    root = cfg.cache_root()
    report.facts["cache_dir"] = str(root)
    report.checks.append(_check_writable(root))

    if cfg.llm_base_url:
        has_key = bool(config_mod.llm_api_key())
        report.checks.append(Check(
            "LLM endpoint", True,
            f"{cfg.llm_base_url} model {cfg.llm_model or '(unset)'}; API key "
            f"{'set' if has_key else 'not set'}", required=False))
    else:
        report.checks.append(Check("LLM endpoint", True,
                                   "not configured (the offline template Coder is used)",
                                   required=False))
    return report


def _check_writable(root) -> Check:
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
            pass
    except OSError as err:
        return Check("cache dir", False, f"{root} is not writable: {err}")
    return Check("cache dir", True, f"{root} is writable")


def render(report: DoctorReport) -> str:
    """The report as aligned text lines."""
    lines = [f"stitchcuda {report.facts.get('stitchcuda')} doctor"]
    for c in report.checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "miss")
        lines.append(f"  [{mark}] {c.name:20s} {c.detail}")
    lines.append("healthy" if report.healthy else "NOT healthy: see FAIL lines above")
    return "\n".join(lines)
