"""The host-overhead benchmark runs and prints both rows (its numbers are measured, not
asserted: performance is reported by commands, never by timed tests)."""

from stitch_backend import program as program_mod
from stitch_backend.bench import overhead


def test_overhead_tool_prints_inference_and_training_rows(capsys):
    assert overhead.main(["--device", "cpu", "--blocks", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("inference", "train"))]
    assert [r[0] for r in rows] == ["inference", "train"]
    assert all(len(r) == 5 + (r[0] == "train") and all(float(v) > 0 for v in r[-4:])
               for r in rows)
    assert program_mod.STRAIGHT_LINE is True     # put back after the comparison
