"""The host-overhead benchmark runs and prints both rows (its numbers are measured, not
asserted: performance is reported by commands, never by timed tests)."""

from stitch_backend import aot_direct
from stitch_backend import program as program_mod
from stitch_backend.bench import overhead


def test_overhead_tool_prints_its_rows(capsys):
    assert overhead.main(["--device", "cpu", "--blocks", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("inference", "train"))]
    assert [r[0] for r in rows] == ["inference", "train"]
    assert all(len(r) == 5 + (r[0] == "train") and all(float(v) > 0 for v in r[-4:])
               for r in rows)
    assert program_mod.STRAIGHT_LINE is True     # put back after the comparison
    # the one-op line: eager, Dynamo's eager backend, stitchcuda direct and wrapped
    (line,) = [line for line in out.splitlines() if line.startswith("one op")]
    words = line.split(":")[1].split()
    assert words[::2] == ["eager", "dynamo", "direct", "wrapped"]
    assert all(float(v) > 0 for v in words[1::2])
    assert aot_direct.why_not.__name__ == "why_not"   # put back after the comparison


def test_overhead_tool_prints_the_rows_asked_for(capsys):
    import pytest

    assert overhead.main(["--device", "cpu", "--blocks", "2", "--rows", "one-op"]) == 0
    out = capsys.readouterr().out
    assert "inference" not in out and "train" not in out and "one op" in out
    assert overhead.main(["--device", "cpu", "--blocks", "2", "--rows", "inference"]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines() if ln.startswith(("inference", "train"))] \
        == ["inference"] and "one op" not in out
    with pytest.raises(SystemExit):
        overhead.main(["--rows", "inference,warp"])
    assert "unknown warp" in capsys.readouterr().err
