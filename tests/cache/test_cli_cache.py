"""`stitchcuda cache ...`: every subcommand's output and exit code."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import pytest

from stitch_backend.cache import MANIFEST, Store
from stitch_backend.cli_cache import add_parser, run

REPORT = {
    "total_speedup": 1.41,
    "regions": [
        {"id": "r0", "kind": "gemm", "ops": ["aten.addmm", "aten.relu"],
         "reason": "cuBLASLt RELU_BIAS",
         "kernel": "gemm_r0", "speedup": 1.734},
        {"id": "r1", "kind": "fallback", "ops": ["aten.sort"], "reason": "no template | <sort>",
         "kernel": None, "speedup": None},
    ],
}


def _cli(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="stitchcuda")
    sub = p.add_subparsers(dest="command")
    add_parser(sub)
    return run(p.parse_args(["cache", *argv]))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def populated(make_key, artifacts):
    """Entries in the default cache ($STITCHCUDA_CACHE_DIR, set per test by tests/conftest.py)."""
    store = Store()
    a = store.put(make_key(0), {"report": REPORT, "summary": {"model": "mlp", "regions": 2}},
                  artifacts(0))
    b = store.put(make_key(1), {"plan": {"regions": ["r0"]}}, artifacts(1))
    return store, a, b


def test_ls(populated, capsys):
    store, a, b = populated
    assert _cli("ls") == 0
    out = capsys.readouterr().out
    assert a.key[:16] in out and b.key[:16] in out
    assert "model=mlp regions=2" in out and "2 entries" in out and "sm_90a" in out

    assert _cli("ls", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["key"] for r in rows} == {a.key, b.key}
    assert next(r for r in rows if r["key"] == a.key)["summary"]["model"] == "mlp"


def test_ls_empty(capsys):
    assert _cli("ls") == 0
    out = capsys.readouterr().out
    assert "no entries" in out and "notes (facts" not in out
    assert _cli("ls", "--json") == 0
    assert json.loads(capsys.readouterr().out) == []


def test_ls_counts_notes_by_kind(populated, capsys):
    """The small facts a machine measured once (a layout race's verdict, cuBLASLt's
    algorithm choices) are counted by kind; `clear` removes them with the entries."""
    store, _, _ = populated
    store.write_note("layout-race-1", {"graph": "a"}, {"channels_last": True, "timing": "t"})
    store.write_note("lt-algo-1", {"problem": "x"}, 1)
    store.write_note("lt-algo-1", {"problem": "y"}, 2)
    assert store.note_counts() == {"layout-race-1": 1, "lt-algo-1": 2}
    assert _cli("ls") == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "notes (facts measured on this machine" in out
    assert "1 layout-race-1, 2 lt-algo-1" in out, out
    assert _cli("clear", "--yes") == 0
    capsys.readouterr()
    assert store.note_counts() == {}
    assert _cli("ls") == 0
    assert "notes (facts" not in capsys.readouterr().out


def test_show_report_as_markdown(populated, capsys):
    _, a, _ = populated
    assert _cli("show", a.key[:8]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# stitchcuda cache entry `{a.key[:16]}`")
    assert "## Regions (2)" in out and "| id | kind | ops | reason | kernel | speedup |" in out
    assert "| r0 | gemm | aten.addmm, aten.relu | cuBLASLt RELU_BIAS | gemm_r0 | 1.73x |" in out
    assert "| r1 | fallback | aten.sort | no template \\| <sort> | - | - |" in out
    assert "report.total_speedup**: 1.41" in out
    assert "region0.cubin" in out and "sm_90a" in out


def test_show_without_report_prints_manifest_summary(populated, capsys):
    _, _, b = populated
    assert _cli("show", b.key) == 0
    out = capsys.readouterr().out
    assert "## Manifest" in out and '- **plan**: {"regions": ["r0"]}' in out
    assert "## Regions" not in out


def test_show_json_and_html(populated, capsys, tmp_path):
    _, a, _ = populated
    assert _cli("show", a.key[:10], "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["key"] == a.key and shown["manifest"]["report"] == REPORT

    page = tmp_path / "report.html"
    assert _cli("show", a.key[:10], "--html", str(page)) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<style>" in text and "<script" not in text
    assert "<td>gemm_r0</td>" in text and "<td>1.73x</td>" in text
    assert "no template | &lt;sort&gt;" in text  # escaped, not markup


def test_key_prefix_errors(populated, capsys):
    store, a, b = populated
    absent = next(c * 64 for c in "0123456789" if not {a.key[0], b.key[0]} & {c})
    assert _cli("show", absent) == 2
    assert "no cache entry matches" in capsys.readouterr().err
    assert _cli("rm", "not-hex") == 2
    assert "not a hex key prefix" in capsys.readouterr().err
    store.put("ab" + "0" * 62, {}, {})
    store.put("ab" + "1" * 62, {}, {})
    assert _cli("show", "ab") == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "2 entries" in err
    assert len(store.keys()) == 4


def test_show_corrupt_entry_exits_1(populated, capsys):
    _, a, _ = populated
    (a.path / MANIFEST).write_text("{")
    assert _cli("show", a.key) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert a.path.exists()  # show is read-only


def test_rm(populated, capsys):
    store, a, b = populated
    assert _cli("rm", a.key[:12]) == 0
    assert f"removed {a.key}" in capsys.readouterr().out
    assert store.keys() == [b.key]
    assert _cli("rm", a.key[:12]) == 2


def test_clear_needs_yes_or_a_confirmation(populated, capsys, monkeypatch):
    store, _, _ = populated
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal
    assert _cli("clear") == 2
    assert "without --yes" in capsys.readouterr().err and len(store.keys()) == 2

    monkeypatch.setattr(sys, "stdin", _Tty("n\n"))
    assert _cli("clear") == 0
    assert "nothing removed" in capsys.readouterr().out and len(store.keys()) == 2

    monkeypatch.setattr(sys, "stdin", _Tty("y\n"))
    assert _cli("clear") == 0
    assert "removed 2 entries" in capsys.readouterr().out and store.keys() == []


def test_clear_yes(populated, capsys):
    store, _, _ = populated
    assert _cli("clear", "--yes") == 0
    assert "removed 2 entries" in capsys.readouterr().out and store.keys() == []


def test_verify(populated, capsys):
    _, a, _ = populated
    assert _cli("verify") == 0
    assert "2 entries checked, 0 broken" in capsys.readouterr().out

    (a.path / "region0.cubin").write_bytes(b"flipped")
    assert _cli("verify") == 1
    out = capsys.readouterr().out
    assert f"BROKEN {a.key[:16]}: checksum mismatch" in out and "1 broken" in out
    assert _cli("verify", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 2 and [p["key"] for p in report["problems"]] == [a.key]


def test_export_and_import(populated, capsys, tmp_path):
    _, a, b = populated
    everything, one = tmp_path / "all.tar.gz", tmp_path / "one.tar.gz"
    assert _cli("export", str(everything)) == 0
    assert "exported 2 entries" in capsys.readouterr().out
    assert _cli("export", str(one), a.key[:12]) == 0
    assert "exported 1 entries" in capsys.readouterr().out

    other = tmp_path / "other"
    assert _cli("--dir", str(other), "import", str(one)) == 0
    assert "imported 1 entries, 0 already present, 0 refused" in capsys.readouterr().out
    assert _cli("--dir", str(other), "import", str(everything)) == 0
    assert "imported 1 entries, 1 already present" in capsys.readouterr().out
    assert sorted(Store(other).keys()) == sorted([a.key, b.key])


def test_import_refusals_and_junk_exit_1(populated, capsys, tmp_path):
    import tarfile

    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    assert _cli("--dir", str(tmp_path / "o"), "import", str(bad)) == 1
    captured = capsys.readouterr()
    assert "refused ../evil" in captured.err and "1 refused" in captured.out

    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"junk")
    assert _cli("import", str(junk)) == 1
    assert "not a readable .tar.gz" in capsys.readouterr().err


def test_unsafe_root_refused_unless_trusted_shared(populated, capsys):
    store, _, _ = populated
    os.chmod(store.root, 0o777)
    assert _cli("ls") == 1
    err = capsys.readouterr().err
    assert str(store.root) in err and "writable by group or others" in err
    assert "--trusted-shared" in err
    assert _cli("--trusted-shared", "ls") == 0
    assert "2 entries" in capsys.readouterr().out


def test_subcommand_required():
    with pytest.raises(SystemExit):
        _cli()


def test_dir_option_overrides_env(populated, capsys, tmp_path: Path):
    assert _cli("--dir", str(tmp_path / "elsewhere"), "ls") == 0
    assert "no entries" in capsys.readouterr().out
