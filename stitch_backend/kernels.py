"""Running a compiled candidate kernel in place of its region.

A ``KernelRunner`` loads the candidate's cubin once (driver API, no torch headers),
and on each call lets the kernel's launch rule allocate the outputs and pack the raw
arguments, then launches on torch's current stream. With ``poison=True`` (the Verifier's
runs) every output is filled with NaN (or an integer sentinel) first, so an element the
kernel forgets to write cannot pass the comparison.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

_INT_POISON = -7777777


class KernelRunner:
    """Callable with the region's inputs, returning its outputs (a list of tensors)."""

    def __init__(self, candidate: Any, *, poison: bool = False):
        from .cuda_driver import CudaModule

        if candidate.cubin is None:
            raise ValueError(f"candidate {candidate.name} has no cubin")
        self.candidate = candidate
        self.kernel = candidate.kernel
        self.poison = poison
        self._module = CudaModule(candidate.cubin)
        self._fn = self._module.function(candidate.kernel.entry, candidate.kernel.signature)

    def poisoning(self) -> "KernelRunner":
        """A runner over the same loaded module that poisons its outputs first."""
        twin = object.__new__(KernelRunner)
        twin.__dict__.update(self.__dict__)
        twin.poison = True
        return twin

    def __call__(self, *inputs: Any) -> Sequence[torch.Tensor]:
        launch = self.kernel.prepare(inputs)
        if self.poison:
            for out in launch.outputs:
                if out.is_floating_point():
                    out.fill_(float("nan"))
                elif out.dtype == torch.bool:
                    out.fill_(True)
                else:
                    out.fill_(_INT_POISON)
        if launch.grid[0] * launch.grid[1] * launch.grid[2] > 0:
            self._fn.launch(launch.grid, launch.block, launch.args, launch.shared_mem)
        return launch.outputs


class InterpretedRunner:
    """The ``cpu_interpret`` stand-in for a KernelRunner: the candidate's kernel IR run
    by the CPU interpreter (which poisons its outputs itself). A testing aid."""

    def __init__(self, candidate: Any, *, poison: bool = True):
        self.candidate = candidate
        self.kernel = candidate.kernel

    def poisoning(self) -> "InterpretedRunner":
        return self

    def __call__(self, *inputs: Any) -> Sequence[torch.Tensor]:
        return self.kernel.interpret(inputs)


class CompositeRunner:
    """A gemm/conv region run as its library call (ATen: cuBLAS/cuDNN) followed by one
    generated epilogue kernel that reads the product once."""

    def __init__(self, prologue: Any, kernel_runner: Any):
        self.prologue = prologue          # agents.state.Prologue
        self.kernel_runner = kernel_runner
        self.candidate = kernel_runner.candidate

    def poisoning(self) -> "CompositeRunner":
        return CompositeRunner(self.prologue, self.kernel_runner.poisoning())

    def __call__(self, *inputs: Any) -> list[Any]:
        p = self.prologue
        env = dict(zip(p.region_inputs, inputs))
        env.update(zip(p.head.outputs, p.head_module(*[env[n] for n in p.head.inputs])))
        env.update(zip(p.tail.outputs, self.kernel_runner(*[env[n] for n in p.tail.inputs])))
        return [env[n] for n in p.region_outputs]


def runner_for(candidate: Any, base: Any = None) -> Any:
    """The callable that runs ``candidate`` in place of its region: its kernel through
    ``base`` (KernelRunner on the GPU, InterpretedRunner for cpu_interpret), preceded by
    the library call when the candidate is a gemm/conv epilogue."""
    kernel_runner = (base or KernelRunner)(candidate)
    if getattr(candidate, "prologue", None) is None:
        return kernel_runner
    return CompositeRunner(candidate.prologue, kernel_runner)
