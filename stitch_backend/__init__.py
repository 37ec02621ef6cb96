"""stitchcuda: a PyTorch compiler backend of verified, fused CUDA kernels.

Use it through ``torch.compile(model, backend="stitchcuda")``; the backend is
registered by the ``torch_dynamo_backends`` entry point, so nothing needs importing.
Importing this package has no side effects.
"""

from .version import __version__

__all__ = ["__version__"]
