"""The store: publish, load, integrity, permissions, eviction, listing, removal."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stitch_backend.cache.store as store_module
from stitch_backend.cache import (CACHE_VERSION, MANIFEST, CacheSecurityError, CorruptEntryError,
                                  KeyLookupError, Store)

LOGGER = "stitch_backend.cache"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _age(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records
                     if r.name == LOGGER and r.levelno == logging.WARNING)


# ---------------------------------------------------------------------------- put / get


def test_put_then_get_round_trip(store, make_key, artifacts):
    key = make_key()
    arts = artifacts()
    put = store.put(key, {"plan": {"regions": 2}, "timings": {"compile_s": 0.7}}, arts)
    got = store.get(key)
    assert got is not None and got.key == key.hex == put.key
    assert got.path == store.root / "entries" / key.hex[:2] / key.hex
    assert {n: got.read(n) for n in arts} == arts
    m = got.manifest
    assert m["plan"] == {"regions": 2} and m["timings"] == {"compile_s": 0.7}
    assert m["cache_version"] == CACHE_VERSION and m["key"] == key.hex
    assert m["key_fields"] == key.fields()
    assert m["size"] == sum(len(b) for b in arts.values())
    assert set(m["checksums"]) == set(arts) and all(len(d) == 64 for d in m["checksums"].values())
    assert abs(m["created"] - time.time()) < 60
    assert sorted(os.listdir(got.path)) == sorted([*arts, MANIFEST])
    assert got.artifact_path("region0.cu").read_bytes() == arts["region0.cu"]
    with pytest.raises(KeyError, match="no artifact"):
        got.artifact_path("missing.cubin")


def test_put_accepts_hex_string_keys(store):
    entry = store.put("ab" * 32, {}, {"k.cubin": b"\x00\x01"})
    assert entry.manifest["key_fields"] is None
    assert store.get("ab" * 32).read("k.cubin") == b"\x00\x01"


def test_get_missing_is_none_and_creates_nothing(store, make_key):
    assert store.get(make_key()) is None
    assert not store.root.exists()


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
def test_files_private_whatever_the_umask(root, make_key, artifacts, umask):
    old = os.umask(umask)
    try:
        store = Store(root)
        entry = store.put(make_key(), {}, artifacts())
        with store.lock(make_key()):
            pass
    finally:
        os.umask(old)
    for folder in (root, root / "entries", root / "locks", root / "tmp", entry.path.parent,
                   entry.path):
        assert _mode(folder) == 0o700, folder
    for name in os.listdir(entry.path):
        assert _mode(entry.path / name) == 0o600, name
    assert _mode(root / "locks" / f"{make_key().hex}.lock") == 0o600


def test_put_keeps_the_existing_entry(store, make_key):
    first = store.put(make_key(), {"who": "first"}, {"a.cubin": b"1"})
    second = store.put(make_key(), {"who": "second"}, {"a.cubin": b"2"})
    assert second.manifest["who"] == "first" and second.read("a.cubin") == b"1"
    assert store.get(make_key()).manifest["created"] == first.manifest["created"]


@pytest.mark.parametrize("name", ["../x.so", "a/b.cubin", ".hidden", MANIFEST, "", "x" * 300,
                                  "sp ace.cu"])
def test_put_rejects_unsafe_artifact_names(store, make_key, name):
    with pytest.raises(ValueError, match="artifact name"):
        store.put(make_key(), {}, {name: b"x"})
    assert store.get(make_key()) is None


def test_put_rejects_reserved_and_non_json_manifests(store, make_key):
    with pytest.raises(ValueError, match="checksums"):
        store.put(make_key(), {"checksums": {}}, {})
    with pytest.raises(TypeError, match="plain JSON"):
        store.put(make_key(), {"plan": object()}, {})
    assert store.get(make_key()) is None and store.ls() == []


def test_get_updates_last_used(store, make_key, artifacts):
    entry = store.put(make_key(), {}, artifacts())
    _age(entry.path, 1000)
    before = os.lstat(entry.path).st_mtime
    assert store.get(make_key()) is not None
    assert os.lstat(entry.path).st_mtime > before + 900


# ---------------------------------------------------------------------------- atomic publish


def test_failure_mid_write_leaves_nothing_visible(store, make_key, artifacts, monkeypatch):
    real_write = store_module._write_file
    written = []

    def failing_write(path, data):
        if written:
            raise OSError(28, "No space left on device (simulated)")
        real_write(path, data)
        written.append(path)

    monkeypatch.setattr(store_module, "_write_file", failing_write)
    with pytest.raises(OSError, match="simulated"):
        store.put(make_key(), {}, artifacts())
    assert len(written) == 1  # one file really was written before the failure
    assert store.get(make_key()) is None
    assert store.ls() == [] and store.keys() == [] and store.verify() == []
    assert not store.entry_dir(make_key()).exists()
    assert os.listdir(store.root / "tmp") == []  # the half-written folder was removed

    monkeypatch.setattr(store_module, "_write_file", real_write)
    assert store.put(make_key(), {}, artifacts()).read("region0.cu") == artifacts()["region0.cu"]


def test_process_killed_mid_write_leaves_nothing_visible(store, make_key, artifacts):
    script = (
        "import os, sys\n"
        "import stitch_backend.cache.store as m\n"
        "real, calls = m._write_file, []\n"
        "def dying_write(path, data):\n"
        "    real(path, data); calls.append(path)\n"
        "    if len(calls) == 2: os._exit(7)\n"
        "m._write_file = dying_write\n"
        "m.Store(sys.argv[1]).put(sys.argv[2], {},\n"
        "                         {'a.bin': b'1' * 9, 'b.bin': b'2', 'c.bin': b'3'})\n"
    )
    key = make_key().hex
    proc = subprocess.run([sys.executable, "-c", script, str(store.root), key], timeout=60)
    assert proc.returncode == 7
    leftovers = os.listdir(store.root / "tmp")
    assert len(leftovers) == 1 and len(os.listdir(store.root / "tmp" / leftovers[0])) == 2
    assert store.get(key) is None and store.ls() == [] and store.verify() == []

    assert store.put(key, {}, artifacts()).read("region0.cu") == artifacts()["region0.cu"]
    store.evict(10**9)  # the dead writer's folder is young: kept
    assert os.listdir(store.root / "tmp") == leftovers
    _age(store.root / "tmp" / leftovers[0], 2 * store_module.STALE_TMP_SECONDS)
    store.evict(10**9)
    assert os.listdir(store.root / "tmp") == []
    assert store.get(key) is not None


# ---------------------------------------------------------------------------- corruption


def _flip(entry: Path) -> None:
    p = entry / "region0.cubin"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _edit_manifest(entry: Path, **changes) -> None:
    p = entry / MANIFEST
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


CORRUPTIONS = {
    "flipped byte": (_flip, "checksum mismatch for artifact 'region0.cubin'"),
    "truncated artifact": (
        lambda e: (e / "region0.cubin").write_bytes((e / "region0.cubin").read_bytes()[:10]),
        "checksum mismatch"),
    "empty artifact": (lambda e: (e / "region0.cu").write_bytes(b""), "checksum mismatch"),
    "missing artifact": (lambda e: (e / "region0.cubin").unlink(), "'region0.cubin' is missing"),
    "extra file": (lambda e: (e / "evil.so").write_bytes(b"\x7fELF"), "unexpected file"),
    "artifact is a folder": (
        lambda e: ((e / "region0.cu").unlink(), (e / "region0.cu").mkdir(mode=0o700)),
        "not a regular file"),
    "bad json manifest": (lambda e: (e / MANIFEST).write_text("{not json"), "not valid JSON"),
    "truncated manifest": (
        lambda e: (e / MANIFEST).write_bytes((e / MANIFEST).read_bytes()[:20]), "not valid JSON"),
    "manifest not an object": (lambda e: (e / MANIFEST).write_text("[1, 2]"), "not a JSON object"),
    "missing manifest": (lambda e: (e / MANIFEST).unlink(), "manifest.json is missing"),
    "manifest of another key": (lambda e: _edit_manifest(e, key="cd" * 32), "names key"),
    "manifest of another version": (lambda e: _edit_manifest(e, cache_version=999),
                                    "cache version"),
    "tampered checksum": (
        lambda e: _edit_manifest(e, checksums={"region0.cubin": "0" * 64, "region0.cu": "0" * 64}),
        "checksum mismatch"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_entry_is_a_miss_with_warning_then_rebuilt(store, make_key, artifacts, caplog,
                                                           corruption):
    damage, reason = CORRUPTIONS[corruption]
    entry = store.put(make_key(), {}, artifacts())
    damage(entry.path)
    problems = store.verify()  # verify reports without repairing
    assert [p.key for p in problems] == [make_key().hex] and reason in problems[0].reason
    assert entry.path.exists()

    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.get(make_key()) is None
    assert str(entry.path) in _warnings(caplog) and reason in _warnings(caplog)
    assert not entry.path.exists()  # moved aside so a rebuild can publish

    builds = []
    rebuilt = store.get_or_build(make_key(), lambda: (builds.append(1) or {}, artifacts()))
    assert builds == [1] and rebuilt.read("region0.cubin") == artifacts()["region0.cubin"]
    assert store.verify() == []


def test_corrupt_entry_is_replaced_by_put(store, make_key, artifacts):
    entry = store.put(make_key(), {"v": 1}, artifacts())
    _flip(entry.path)
    again = store.put(make_key(), {"v": 2}, artifacts())
    assert again.manifest["v"] == 2 and store.get(make_key()).manifest["v"] == 2


def test_read_rechecks_checksum(store, make_key, artifacts):
    entry = store.get(store.put(make_key(), {}, artifacts()).key)
    _flip(entry.path)
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        entry.read("region0.cubin")
    (entry.path / "region0.cu").unlink()
    with pytest.raises(CorruptEntryError, match="vanished"):
        entry.read("region0.cu")


def test_load_raises_and_changes_nothing(store, make_key, artifacts):
    entry = store.put(make_key(), {}, artifacts())
    _flip(entry.path)
    with pytest.raises(CorruptEntryError):
        store.load(make_key())
    assert entry.path.exists()


# ---------------------------------------------------------------------------- permissions


def test_group_writable_entry_refused_unless_trusted(store, make_key, artifacts, caplog):
    entry = store.put(make_key(), {}, artifacts())
    os.chmod(entry.path, 0o770)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.get(make_key()) is None
    text = _warnings(caplog)
    assert str(entry.path) in text and "writable by group or others" in text
    assert entry.path.exists()  # refused, not deleted: it may not be ours to delete
    caplog.clear()
    assert store.ls() == [] and str(entry.path) in _warnings(caplog)
    assert "writable by group" in store.verify()[0].reason

    trusted = Store(store.root, trusted_shared=True)
    assert trusted.get(make_key()).read("region0.cu") == artifacts()["region0.cu"]
    assert [i.key for i in trusted.ls()] == [make_key().hex]


def test_group_writable_artifact_refused(store, make_key, artifacts, caplog):
    entry = store.put(make_key(), {}, artifacts())
    os.chmod(entry.path / "region0.cubin", 0o620)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.get(make_key()) is None
    assert str(entry.path / "region0.cubin") in _warnings(caplog)
    assert Store(store.root, trusted_shared=True).get(make_key()) is not None


def test_world_writable_root_refused_for_read_and_write(store, make_key, artifacts, caplog):
    store.put(make_key(), {}, artifacts())
    os.chmod(store.root, 0o777)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.check_root() is not None
    assert store.get(make_key()) is None and str(store.root) in _warnings(caplog)
    assert store.ls() == []
    with pytest.raises(CacheSecurityError, match="writable by group or others"):
        store.put(make_key(1), {}, artifacts(1))
    with pytest.raises(CacheSecurityError):
        store.lock(make_key())
    assert Store(store.root, trusted_shared=True).get(make_key()) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_entry_owned_by_another_user_refused(store, make_key, artifacts, caplog):
    entry = store.put(make_key(), {}, artifacts())
    os.chown(entry.path, 4242, 4242)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.get(make_key()) is None
    assert "owned by uid 4242" in _warnings(caplog) and str(entry.path) in _warnings(caplog)
    assert Store(store.root, trusted_shared=True).get(make_key()) is not None


def test_symlinked_artifact_refused_even_when_trusted(store, make_key, artifacts, tmp_path):
    entry = store.put(make_key(), {}, artifacts())
    outside = tmp_path / "outside.cubin"
    outside.write_bytes(artifacts()["region0.cubin"])  # same bytes: only the link is wrong
    (entry.path / "region0.cubin").unlink()
    (entry.path / "region0.cubin").symlink_to(outside)
    assert store.get(make_key()) is None
    assert Store(store.root, trusted_shared=True).get(make_key()) is None
    assert "symbolic link" in store.verify()[0].reason


# ---------------------------------------------------------------------------- eviction


def test_evict_is_least_recently_used_first(store, make_key, artifacts):
    keys = [make_key(i) for i in range(3)]
    for i, (age, key) in enumerate(zip((300, 200, 100), keys)):
        _age(store.put(key, {}, artifacts(i)).path, age)
    assert store.get(keys[0]) is not None  # the oldest becomes the most recent
    sizes = {k.hex: store.info(k).size for k in keys}
    total = store.total_bytes()
    assert total == sum(sizes.values())

    assert store.evict(total - 1) == [keys[1].hex]  # least recently used goes first
    assert store.evict(sizes[keys[0].hex]) == [keys[2].hex]
    assert store.keys() == [keys[0].hex]
    assert store.evict(0, keep=[keys[0].hex]) == []
    assert store.evict(0) == [keys[0].hex] and store.keys() == []


def test_max_bytes_applied_after_put_keeping_the_new_entry(root, make_key, artifacts):
    probe = Store(root / "probe").put(make_key(0), {}, artifacts(0, size=1000))
    one = sum(os.lstat(probe.path / n).st_size for n in os.listdir(probe.path))
    store = Store(root, max_bytes=int(2.5 * one))
    for i in range(3):
        _age(store.put(make_key(i), {}, artifacts(i, size=1000)).path, 100 - i)
    assert set(store.keys()) == {make_key(1).hex, make_key(2).hex}
    assert store.total_bytes() <= store.max_bytes

    tiny = Store(root / "tiny", max_bytes=10)
    entry = tiny.put(make_key(), {}, artifacts(size=1000))
    assert tiny.keys() == [make_key().hex] and entry.read("region0.cubin")


# ---------------------------------------------------------------------------- ls / info / rm


def test_ls_reports_size_times_summary_and_problems(store, make_key, artifacts):
    a = store.put(make_key(0), {"summary": {"model": "mlp", "regions": 3}}, artifacts(0))
    b = store.put(make_key(1), {}, artifacts(1))
    _age(a.path, 50)
    (b.path / MANIFEST).write_text("{broken")
    infos = store.ls()
    assert [i.key for i in infos] == [b.key, a.key]  # most recently used first
    ia = infos[1]
    assert ia.summary == {"model": "mlp", "regions": 3} and ia.arch == "sm_90a"
    assert ia.size == sum(os.lstat(a.path / n).st_size for n in os.listdir(a.path))
    assert ia.created == a.manifest["created"] and ia.problem is None
    assert abs(ia.last_used - (time.time() - 50)) < 5
    assert "not valid JSON" in infos[0].problem
    assert json.loads(json.dumps(ia.to_json()))["key"] == a.key


def test_verify_reports_stray_names(store, make_key, artifacts):
    store.put(make_key(), {}, artifacts())
    (store.root / "entries" / "zz").mkdir()
    (store.root / "entries" / make_key().hex[:2] / "notakey").write_text("")
    reasons = {p.key: p.reason for p in store.verify()}
    assert set(reasons) == {"zz", "notakey"}
    assert all("unexpected name" in r for r in reasons.values())


def test_rm_and_clear(store, make_key, artifacts):
    for i in range(3):
        store.put(make_key(i), {}, artifacts(i))
    assert store.rm(make_key(1)) is True and store.rm(make_key(1)) is False
    assert store.get(make_key(1)) is None and len(store.keys()) == 2
    assert store.clear() == 2
    assert store.keys() == [] and store.ls() == [] and os.listdir(store.root / "tmp") == []


def test_resolve_prefix(store):
    a, b = "ab" + "0" * 62, "ab" + "1" * 62
    store.put(a, {}, {})
    store.put(b, {}, {})
    assert store.resolve("ab0") == a and store.resolve(b) == b and store.resolve("AB1") == b
    with pytest.raises(KeyLookupError, match="ambiguous") as exc:
        store.resolve("ab")
    assert sorted(exc.value.matches) == [a, b]
    with pytest.raises(KeyLookupError, match="no cache entry"):
        store.resolve("ff")
    with pytest.raises(KeyLookupError, match="not a hex key prefix"):
        store.resolve("../")


def test_root_that_is_a_file_is_a_miss_not_a_crash(tmp_path, make_key, artifacts, caplog):
    root = tmp_path / "not-a-folder"
    root.write_text("x")
    store = Store(root)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.get(make_key()) is None and store.ls() == [] and store.keys() == []
    assert store.check_root() == "not a directory" and str(root) in _warnings(caplog)
    with pytest.raises(CacheSecurityError, match="not a directory"):
        store.put(make_key(), {}, artifacts())


def test_entry_that_is_a_file_is_discarded_and_rebuilt(store, make_key, artifacts):
    store.put(make_key(1), {}, artifacts(1))  # creates the layout
    path = store.entry_dir(make_key())
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text("junk")
    assert "not a directory" in store.verify()[0].reason
    assert store.get(make_key()) is None and not path.exists()
    assert store.get_or_build(make_key(), lambda: ({}, artifacts())).path.is_dir()


# ---------------------------------------------------------------------------- notes


def test_notes_round_trip_replace_and_belong_to_their_key(store):
    key = {"conv": "((8, 3, 224, 224), ...)", "gpu": "NVIDIA H200", "flags": [True, False]}
    assert store.read_note("layout-precision", key) is None
    store.write_note("layout-precision", key, {"why": None})
    assert store.read_note("layout-precision", key) == {"why": None}
    store.write_note("layout-precision", key, {"why": "less accurate"})
    assert store.read_note("layout-precision", key) == {"why": "less accurate"}
    assert store.read_note("layout-precision", dict(key, gpu="other")) is None
    assert store.read_note("other-kind", key) is None
    (path,) = (store.root / "notes" / "layout-precision").iterdir()
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert not list((store.root / "tmp").iterdir())       # the temp file was renamed
    assert store.keys() == [] and store.verify() == []    # notes are not entries


def test_a_note_others_could_write_or_a_damaged_one_is_ignored(store):
    key = {"conv": "x"}
    store.write_note("layout-precision", key, {"why": None})
    (path,) = (store.root / "notes" / "layout-precision").iterdir()
    os.chmod(path, 0o666)
    assert store.read_note("layout-precision", key) is None
    os.chmod(path, 0o600)
    path.write_text("{not json")
    assert store.read_note("layout-precision", key) is None


def test_clear_removes_notes_and_kinds_are_checked(store):
    store.write_note("layout-precision", {"k": 1}, 1)
    store.clear()
    assert not (store.root / "notes").exists()
    assert store.read_note("layout-precision", {"k": 1}) is None
    with pytest.raises(ValueError):
        store.write_note("../escape", {"k": 1}, 1)
