"""Export/import: round trip, and refusal of everything unsafe or inconsistent."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from stitch_backend.cache import MANIFEST, CacheImportError, Store


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}


def _write_tar(path: Path, files: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


@pytest.fixture
def exported(store, make_key, artifacts, tmp_path):
    """An archive of two good entries, and their keys."""
    keys = [make_key(i) for i in range(2)]
    for i, key in enumerate(keys):
        store.put(key, {"plan": {"n": i}}, artifacts(i))
    file = tmp_path / "export.tar.gz"
    report = store.export(None, file)
    assert sorted(report.exported) == sorted(k.hex for k in keys) and report.skipped == []
    return file, [k.hex for k in keys]


def test_round_trip(store, exported, tmp_path, artifacts):
    file, keys = exported
    assert stat.S_IMODE(os.stat(file).st_mode) == 0o600
    other = Store(tmp_path / "other")
    report = other.import_(file)
    assert sorted(report.imported) == sorted(keys) and report.refused == [] and report.ok
    for i, h in enumerate(keys):
        mine, theirs = store.get(h), other.get(h)
        assert theirs.manifest == mine.manifest
        assert {n: theirs.read(n) for n in theirs.checksums} == artifacts(i)
        assert stat.S_IMODE(os.lstat(theirs.path).st_mode) == 0o700
        assert all(stat.S_IMODE(os.lstat(theirs.path / n).st_mode) == 0o600
                   for n in os.listdir(theirs.path))
    assert other.verify() == []
    again = other.import_(file)
    assert again.imported == [] and sorted(again.present) == sorted(keys)


def test_export_selected_keys_and_skip_corrupt(store, exported, tmp_path):
    _, keys = exported
    only = store.export([keys[1]], tmp_path / "one.tar.gz")
    assert only.exported == [keys[1]]
    assert {n.split("/")[0] for n in _members(tmp_path / "one.tar.gz")} == {keys[1]}

    cubin = next(p for p in store.entry_dir(keys[0]).iterdir() if p.suffix == ".cubin")
    cubin.write_bytes(b"garbage")
    report = store.export(None, tmp_path / "rest.tar.gz")
    assert report.exported == [keys[1]]
    assert [r.name for r in report.skipped] == [keys[0]] and "checksum" in report.skipped[0].reason
    missing = store.export(["ef" * 32], tmp_path / "none.tar.gz")
    assert missing.exported == [] and missing.skipped[0].reason == "no such entry"


def _refusals(report) -> dict[str, str]:
    return {r.name: r.reason for r in report.refused}


def test_refuses_parent_path_member(exported, tmp_path):
    file, keys = exported
    members = _members(file)
    bad = _write_tar(tmp_path / "bad.tar.gz", {**members, "../evil": b"pwned",
                                               "sub/../../evil2": b"pwned"})
    target = Store(tmp_path / "target" / "cache")
    report = target.import_(bad)
    refused = _refusals(report)
    assert "'..'" in refused["../evil"] and "'..'" in refused["sub/../../evil2"]
    assert sorted(report.imported) == sorted(keys)  # the good entries still come in
    assert not any(p.name.startswith("evil") for p in tmp_path.rglob("*"))


def test_refuses_absolute_member(exported, tmp_path):
    file, keys = exported
    victim = tmp_path / "victim.txt"
    bad = _write_tar(tmp_path / "bad.tar.gz", {**_members(file), str(victim): b"pwned"})
    report = Store(tmp_path / "target").import_(bad)
    assert _refusals(report)[str(victim)] == "absolute path"
    assert not victim.exists() and len(report.imported) == 2


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "device"])
def test_refuses_link_and_device_members_and_their_entry(exported, tmp_path, kind):
    file, keys = exported
    info = tarfile.TarInfo(f"{keys[0]}/x.so")
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        info.type, info.linkname = tarfile.LNKTYPE, f"{keys[0]}/{MANIFEST}"
    elif kind == "fifo":
        info.type = tarfile.FIFOTYPE
    else:
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    bad = _write_tar(tmp_path / "bad.tar.gz", _members(file), extra=[info])
    target = Store(tmp_path / "target")
    report = target.import_(bad)
    refused = _refusals(report)
    expected = {"symlink": "symbolic link", "hardlink": "hard link", "fifo": "device or fifo",
                "device": "device or fifo"}[kind]
    assert expected in refused[f"{keys[0]}/x.so"]
    assert expected in refused[keys[0]]  # the whole entry is refused with it
    assert report.imported == [keys[1]] and target.get(keys[0]) is None
    assert not (target.entry_dir(keys[0])).exists()


def test_refuses_tampered_artifact(exported, tmp_path):
    file, keys = exported
    members = _members(file)
    name = next(n for n in members if n.startswith(keys[0]) and n.endswith(".cubin"))
    members[name] = members[name][:-1] + bytes([members[name][-1] ^ 1])
    report = Store(tmp_path / "target").import_(_write_tar(tmp_path / "bad.tar.gz", members))
    assert "checksum mismatch" in _refusals(report)[keys[0]]
    assert report.imported == [keys[1]]


def _with_manifest(members: dict[str, bytes], entry: str, changes: dict) -> dict[str, bytes]:
    name = f"{entry}/{MANIFEST}"
    manifest = {**json.loads(members[name]), **changes}
    return {**members, name: json.dumps(manifest).encode()}


@pytest.mark.parametrize("change,reason", [
    ({"cache_version": 999}, "cache version 999"),
    ({"checksums": {}}, "file(s) not in the manifest"),
    ({"key": "0" * 64}, "names key"),
    ({"key_fields": {"graph": "other", "cache_version": 1, "input_metas": [], "options": {},
                     "arch": "sm_90a", "versions": {}}}, "do not hash to the entry's key"),
    ({"key_fields": ["not", "a", "dict"]}, "do not hash"),
])
def test_refuses_inconsistent_manifest(exported, tmp_path, change, reason):
    file, keys = exported
    members = _with_manifest(_members(file), keys[0], change)
    target = Store(tmp_path / "target")
    report = target.import_(_write_tar(tmp_path / "bad.tar.gz", members))
    assert reason in _refusals(report)[keys[0]]
    assert report.imported == [keys[1]] and target.get(keys[0]) is None


def test_refuses_missing_artifact_and_bad_names(exported, tmp_path):
    file, keys = exported
    members = _members(file)
    name = next(n for n in members if n.startswith(keys[0]) and n.endswith(".cu"))
    del members[name]
    members[f"{keys[1]}/.hidden"] = b"x"
    members["README"] = b"x"
    report = Store(tmp_path / "target").import_(_write_tar(tmp_path / "bad.tar.gz", members))
    refused = _refusals(report)
    assert "missing from the archive" in refused[keys[0]]
    assert "not of the form" in refused[f"{keys[1]}/.hidden"] and keys[1] in refused
    assert "not of the form" in refused["README"]
    assert report.imported == []


def test_unreadable_archive_raises(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not gzip")
    target = Store(tmp_path / "target")
    with pytest.raises(CacheImportError, match="not a readable"):
        target.import_(junk)
    with pytest.raises(CacheImportError):
        target.import_(tmp_path / "absent.tar.gz")
    assert target.keys() == []


def test_import_from_stream_and_export_to_stream(store, make_key, artifacts, tmp_path):
    store.put(make_key(), {}, artifacts())
    buf = io.BytesIO()
    assert store.export(None, buf).exported == [make_key().hex]
    buf.seek(0)
    other = Store(tmp_path / "other")
    assert other.import_(buf).imported == [make_key().hex]
    assert other.get(make_key()).read("region0.cu") == artifacts()["region0.cu"]
