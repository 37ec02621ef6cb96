"""Backend names with options (one backend under two settings in one run), the
profiler's refusal without a GPU and its tables on one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import stitch_backend
from stitch_backend.bench import backends
from stitch_backend.bench.profile import main as profile_main


def test_backend_options_parse_and_validate():
    assert backends.split_options("stitchcuda") == ("stitchcuda", {})
    # stitchcuda's values stay strings: its Config parses each by the option's type
    assert backends.split_options("stitchcuda:split_stats=1+verify=off+cache_dir=1") == (
        "stitchcuda", {"split_stats": "1", "verify": "off", "cache_dir": "1"})
    from stitch_backend.config import Config
    cfg = Config().with_options(backends.split_options("stitchcuda:split_stats=1+cache_dir=1")[1])
    assert cfg.split_stats is True and cfg.cache_dir == "1"
    # another backend's values are guessed: 1 -> True, 4 -> 4
    assert backends.split_options("inductor:x=1+y=4+z=0.5+w=abc")[1] == {
        "x": True, "y": 4, "z": 0.5, "w": "abc"}
    assert backends.validate_backends(["stitchcuda:split_stats=1", "stitchcuda"]) == [
        "eager", "stitchcuda:split_stats=1", "stitchcuda"]
    with pytest.raises(backends.UnknownBackendError, match="KEY=VALUE"):
        backends.split_options("stitchcuda:split_stats")
    with pytest.raises(backends.UnknownBackendError, match="eager takes no options"):
        backends.validate_backends(["eager:x=1"])
    with pytest.raises(backends.UnknownBackendError, match="unknown backend"):
        backends.validate_backends(["nope:x=1"])
    with pytest.raises(backends.UnknownBackendError, match="Did you mean 'split_stats'"):
        backends.validate_backends(["stitchcuda:split_stat=1"])
    with pytest.raises(backends.UnknownBackendError, match="expected a boolean"):
        backends.validate_backends(["stitchcuda:split_stats=maybe"])


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


def test_profile_splits_a_call_into_host_and_wall_time():
    import time

    from stitch_backend.bench.profile import host_and_wall_ms

    host, wall, cold = host_and_wall_ms(lambda: time.sleep(0.002), device="cpu")
    assert 2.0 <= host <= wall and cold >= 2.0


@pytest.mark.gpu
def test_profile_tables_a_call_warm_and_from_a_cold_l2():
    from stitch_backend.bench.problems import load_problem
    from stitch_backend.bench.profile import profile_backend
    from stitch_backend.bench.worker import TaskConfig

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine with -m gpu)")
    spec = str(Path(stitch_backend.__file__).parent / "examples" / "conv_bn_relu.py")
    problem = load_problem(spec)
    cfg = TaskConfig(spec=spec, name=problem.name, backends=[], device="cuda", mode="train")
    text = profile_backend("eager", problem, cfg, top=5)
    assert "| kernel | calls | ms | ms, cold L2 | share |" in text
    head = text.splitlines()[0]
    warm, cold = (float(v) for v in re.findall(r"([0-9.]+) (?:ms of kernels|from a cold)", head))
    assert warm > 0 and cold > 0
    rows = [line for line in text.splitlines() if line.startswith("| ") and "kernel |" not in line]
    assert rows and all(float(r.split("|")[3]) >= 0 and float(r.split("|")[4]) >= 0 for r in rows)
