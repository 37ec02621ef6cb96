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

class KernelRunner:
    """Callable with the region's inputs, returning its outputs (a list of tensors)."""

    def __init__(self, candidate: Any, *, kernel: Any = None, module: Any = None,
                 poison: bool = False):
        """Run ``kernel`` (default: the candidate's only kernel) from the candidate's cubin;
        stages of one candidate share one loaded ``module``."""
        from .cuda_driver import CudaModule

        if candidate.cubin is None:
            raise ValueError(f"candidate {candidate.name} has no cubin")
        self.candidate = candidate
        self.kernel = kernel or candidate.kernel
        self.poison = poison
        self._module = module or CudaModule(candidate.cubin)
        self._fn = self._module.function(self.kernel.entry, self.kernel.signature)
        self._clusters: dict[tuple[int, int], int] = {}   # resident clusters' blocks by block shape

    def poisoning(self) -> "KernelRunner":
        """A runner over the same loaded module that poisons its outputs first."""
        twin = object.__new__(KernelRunner)
        twin.__dict__.update(self.__dict__)
        twin.poison = True
        return twin

    def __call__(self, *inputs: Any) -> Sequence[torch.Tensor]:
        launch = self.kernel.prepare(inputs)
        for x in launch.reads:     # not the constants it inlined (CPU scalars)
            if not x.is_cuda:
                raise ValueError(f"{self.kernel.name}: input on {x.device}; the kernel "
                                 "reads CUDA memory only")
        if self.poison:
            for out in launch.outputs:
                if out.is_floating_point():
                    out.fill_(float("nan"))
                elif out.dtype == torch.bool:
                    out.fill_(True)
                else:
                    out.fill_(torch.iinfo(out.dtype).max)  # an unlikely value, any int width
        grid = launch.grid
        if getattr(self.kernel, "resident", False):
            grid = self._resident(grid, launch.block[0], launch.shared_mem)
        if grid[0] * grid[1] * grid[2] > 0:
            self._fn.launch(grid, launch.block, launch.args, launch.shared_mem)
        return launch.outputs

    def _resident(self, grid: tuple[int, int, int], block_x: int, shared_mem: int
                  ) -> tuple[int, int, int]:
        """A cluster kernel's grid cut to the clusters that can be resident at once
        (``FusedKernel.resident``; asked of the driver once per block shape, the blocks
        they make kept)."""
        key = (block_x, shared_mem)
        blocks = self._clusters.get(key)
        if blocks is None:
            from .codegen.cluster import CLUSTER

            blocks = self._clusters[key] = CLUSTER * self._fn.max_active_clusters(
                grid[0], block_x, shared_mem)
        if blocks < 1:      # none fits: the launch itself says why
            return grid
        return (min(grid[0], blocks), grid[1], grid[2])


class InterpretedRunner:
    """The ``cpu_interpret`` stand-in for a KernelRunner: the candidate's kernel IR run
    by the CPU interpreter (which poisons its outputs itself). A testing aid."""

    def __init__(self, candidate: Any, *, kernel: Any = None, module: Any = None,
                 poison: bool = True):
        self.candidate = candidate
        self.kernel = kernel or candidate.kernel

    def poisoning(self) -> "InterpretedRunner":
        return self

    def __call__(self, *inputs: Any) -> Sequence[torch.Tensor]:
        return self.kernel.interpret(inputs)


class StagedRunner:
    """A candidate made of stages: generated kernels, and ATen for the pieces the
    templates do not cover (a gemm/conv library call, a replanned remainder), stitched
    over the region's boundary values."""

    def __init__(self, candidate: Any, steps: list[tuple[Any, Any]]):
        self.candidate = candidate
        self.steps = steps  # (stage region, callable)
        # the values each stage reads last (not the region's outputs): dropped after it
        keep = set(candidate.region_outputs)
        last = {n: i for i, (region, _) in enumerate(steps) for n in region.inputs}
        self._dead_after = [[n for n, j in last.items() if j == i and n not in keep]
                            for i in range(len(steps))]

    def poisoning(self) -> "StagedRunner":
        return StagedRunner(self.candidate, [
            (region, fn.poisoning() if hasattr(fn, "poisoning") else fn)
            for region, fn in self.steps])

    def __call__(self, *inputs: Any) -> list[Any]:
        return self.call_boxed(list(inputs))

    def call_boxed(self, box: list[Any]) -> list[Any]:
        """The region on the inputs in ``box``, which it empties: a value is released
        after the last stage that reads it, so where the caller holds no other reference
        (the Program's straight-line function passes a box), a convolution's input is
        freed before its epilogue allocates the output (L2 31: 512 MiB of the peak)."""
        env = dict(zip(self.candidate.region_inputs, box))
        box.clear()
        for (region, fn), dead in zip(self.steps, self._dead_after):
            env.update(zip(region.outputs, fn(*[env[n] for n in region.inputs])))
            for n in dead:
                env.pop(n, None)
        return [env[n] for n in self.candidate.region_outputs]


def runner_for(candidate: Any, base: Any = None) -> Any:
    """The callable that runs ``candidate`` in place of its region, its kernels launched
    through ``base`` (KernelRunner on the GPU, InterpretedRunner for cpu_interpret)."""
    base = base or KernelRunner
    if candidate.stages is None:
        return base(candidate)
    module = None
    if base is KernelRunner and candidate.kernels:   # library-only candidates load nothing
        from .cuda_driver import CudaModule

        module = CudaModule(candidate.cubin)
    steps = [(stage.region,
              base(candidate, kernel=stage.kernel, module=module) if stage.kernel is not None
              else stage.module)
             for stage in candidate.stages]
    return StagedRunner(candidate, steps)
