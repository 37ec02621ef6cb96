"""Backend names with options (one backend under two settings in one run) and the
profiler's refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from stitch_backend.bench import backends
from stitch_backend.bench.profile import main as profile_main


def test_backend_options_parse_and_validate():
    assert backends.split_options("stitchcuda") == ("stitchcuda", {})
    assert backends.split_options("stitchcuda:split_stats=1+verify=off+compile_workers=4") == (
        "stitchcuda", {"split_stats": True, "verify": False, "compile_workers": 4})
    assert backends.validate_backends(["stitchcuda:split_stats=1", "stitchcuda"]) == [
        "eager", "stitchcuda:split_stats=1", "stitchcuda"]
    with pytest.raises(backends.UnknownBackendError, match="KEY=VALUE"):
        backends.split_options("stitchcuda:split_stats")
    with pytest.raises(backends.UnknownBackendError, match="eager takes no options"):
        backends.validate_backends(["eager:x=1"])
    with pytest.raises(backends.UnknownBackendError, match="unknown backend"):
        backends.validate_backends(["nope:x=1"])


def test_options_reach_the_backend():
    # an unknown option is refused by the backend itself, so it did get the options
    wrapped = backends.wrap("stitchcuda:split_stat=1", torch.nn.Linear(4, 4))
    with pytest.raises(Exception, match="split_stats"):
        with torch.no_grad():
            wrapped.fn(torch.randn(2, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_profile_needs_a_gpu(capsys):
    assert profile_main(["x.py"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
