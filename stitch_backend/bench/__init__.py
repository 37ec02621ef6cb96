"""``stitchcuda bench``: eager vs Inductor vs stitchcuda on KernelBench-format problems.

Pieces, in pipeline order:

- ``problems``: find and load problems (KernelBench-format files or ``module:factory``)
- ``worker``:   the child process that runs one problem under every backend
- (the correctness rule, KernelBench's and DESIGN.md's, is ``stitch_backend.correctness``,
  shared with the Verifier)
- ``timing``:   CUDA-event / perf_counter timing with warm-up and L2 flush
- ``records``:  the JSON-lines record written per task and backend
- ``metrics``:  correct counts, geomean speedups, fast_p
- ``report``:   markdown summary and the optional speedup plot
- ``runner``:   one child process per task, timeouts, resume, progress bar
- ``cli``:      ``add_parser(subparsers)`` and ``run(args)`` for the ``stitchcuda`` CLI

Importing this package has no side effects and does not import torch.
"""
