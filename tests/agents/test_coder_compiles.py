"""Every kernel the Coder writes for the zoo compiles with nvcc for the H200 (sm_90a)."""

from __future__ import annotations

import itertools

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


def test_replanned_candidate_compiles_with_every_stage_entry():
    """A candidate of several kernel stages is one source and one cubin holding every
    stage's entry point."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.state import Subtask
    from stitch_backend.backend import StitchBackend
    from stitch_backend.regions import region_module

    backend = StitchBackend()
    fn = lambda x: torch.softmax(x * 3.0, dim=-1).sum(dim=0) + 1.0
    with torch.no_grad():
        torch.compile(fn, backend=backend)(torch.randn(16, 32))
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if r.kind.value == "fused"]
    sub = Subtask(region_id=region.id, region_name="staged", kind="fused", ops=region.ops,
                  module=region_module(rec.gm, region), graph=rec.gm, region=region)
    cand = TemplateCoder().propose(sub)
    assert cand.stages is not None
    (result,) = compile_many([CompileJob(source=cand.source, name=cand.name, arch="sm_90a")])
    assert not isinstance(result, CompileError), str(result)
    for kernel in cand.kernels:
        assert kernel.entry.encode() in result.cubin


def test_every_candidate_for_the_zoo_compiles_after_the_cuda_passes(monkeypatch):
    """With the graph passes that run before the Coder on CUDA (channels-last, poolings,
    convolution biases; cpu_interpret turns them on) and BatchNorms in training mode as
    KernelBench runs them, every candidate the Coder proposes compiles, alternatives
    included (split statistics, generated convolutions)."""
    from stitch_backend.agents.coder import NoCandidate, TemplateCoder
    from stitch_backend.agents.state import subtask_for
    from stitch_backend.backend import StitchBackend
    from stitch_backend.program import Program

    def planned_only(self, gm, plan, key, arch, record, **kwargs):
        self._mark_aten(plan, "planned only")
        return Program(gm, plan)

    monkeypatch.setattr(StitchBackend, "_build", planned_only)
    coder = TemplateCoder()
    sources: dict[str, str] = {}
    for (name, (cls, make_inputs)), channels_last in itertools.product(
            sorted(zoo().items()), (True, False)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                         "channels_last": channels_last})
        with torch.no_grad():
            torch.compile(cls().train(), backend=backend)(*make_inputs(4))
        for rec in backend.records:
            for region in rec.plan.regions:
                if region.kind.value == "fallback":
                    continue
                try:
                    cand = coder.propose(subtask_for(
                        rec.gm, region, f"{name}_{int(channels_last)}{rec.index}_{region.id}"))
                except NoCandidate:
                    continue
                for c in [cand, *cand.alternatives]:
                    for k in c.kernels:
                        sources.setdefault(k.source, k.entry)
    entries = list(sources.values())
    assert any(e.endswith("_sc") for e in entries) and any(e.endswith("_dw") for e in entries)
    assert any("split1p" in e for e in entries), entries
    results = compile_many([CompileJob(source=s, name=e, arch="sm_90a") for s, e in sources.items()])
    failures = [(e, r) for e, r in zip(entries, results) if isinstance(r, CompileError)]
    assert not failures, "\n\n".join(f"{e}:\n{r}" for e, r in failures[:3])
