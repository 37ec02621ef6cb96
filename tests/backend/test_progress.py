"""Progress bars: on a terminal, for steps that run a while; nowhere else."""

from __future__ import annotations

import io

import torch

from stitch_backend import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_shows_on_a_terminal_once_the_step_runs_a_while(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.bar(3, "compiling g", "kernel") as shown:
        for _ in range(3):
            shown.update()
    assert "stitchcuda: compiling g" in term.getvalue() and "kernel" in term.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr("sys.stderr", quiet)
    with progress.bar(3, "compiling g", "kernel", enabled=False) as shown:
        shown.update()
    with progress.bar(0, "nothing", "kernel") as shown:
        shown.update()
    assert quiet.getvalue() == ""
    monkeypatch.setattr(progress, "DELAY_S", 60.0)     # a short step shows nothing
    with progress.bar(3, "compiling g", "kernel") as shown:
        shown.update(3)
    assert quiet.getvalue() == ""


def test_not_on_a_pipe(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.bar(2, "verifying g", "region") as shown:
        shown.update(2)
    assert pipe.getvalue() == ""


def test_first_call_verification_counts_its_regions(monkeypatch):
    from stitch_backend.backend import StitchBackend

    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "cache": False})
    compiled = torch.compile(lambda x: (torch.softmax(x * 2.0, -1), torch.relu(x).sum(0)),
                             backend=backend)
    with torch.no_grad():
        compiled(torch.randn(8, 16))
    text = term.getvalue()
    assert "stitchcuda: verifying graph_" in text and "region" in text, text
    assert "0/2 " in text, text     # two regions to judge (refreshes are throttled)
    term.truncate(0)
    off = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                 "cache": False, "progress": False})
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda x: torch.softmax(x * 3.0, -1), backend=off)(torch.randn(8, 16))
    assert "stitchcuda: verifying" not in term.getvalue()
