"""Fused CUDA kernels for pointwise / reduction / normalisation regions.

``generate(gm, name) -> FusedKernel`` lowers a region GraphModule to the kernel IR
(``kernel_ir``), emits CUDA C++ (``emit_cuda``) and returns a handle whose ``prepare``
gives everything a launch needs. ``Unsupported`` says why a region cannot be fused.
"""

from .fused import FusedKernel, LaunchPlan, generate
from .kernel_ir import Unsupported

__all__ = ["FusedKernel", "LaunchPlan", "Unsupported", "generate"]
