"""Every kernel the Coder writes for the zoo compiles with nvcc for the H200 (sm_90a)."""

from __future__ import annotations

import pytest
import torch

from stitch_backend.explain import emit_sources, trace
from stitch_backend.toolchain import CompileError, CompileJob, compile_many
from tests.zoo import zoo

pytestmark = pytest.mark.nvcc


def _emit_all(tmp_path, training: bool):
    paths = []
    for name, (cls, make_inputs) in sorted(zoo().items()):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = cls()
            inputs = make_inputs(4)
        if training:
            inputs = [x.requires_grad_(True) for x in inputs]
        explanation = trace(model, inputs, training=training)
        emitted = emit_sources(explanation.records, tmp_path / name)
        paths += [e.path for e in emitted if e.path]
    return paths


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_zoo_kernels_compile_for_sm90a(tmp_path, training):
    from pathlib import Path

    paths = _emit_all(tmp_path, training)
    assert len(paths) >= 10, "the Coder generated almost nothing for the zoo"
    jobs = [CompileJob(source=Path(p).read_text(), name=Path(p).stem, arch="sm_90a")
            for p in paths]
    results = compile_many(jobs)
    failures = [(p, r) for p, r in zip(paths, results) if isinstance(r, CompileError)]
    assert not failures, "\n\n".join(f"{p}:\n{r}" for p, r in failures[:3])
    assert all(r.cubin[:4] == b"\x7fELF" for r in results)
