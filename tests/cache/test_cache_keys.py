"""Cache keys: deterministic, sensitive to every field, and only plain values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stitch_backend.cache import CACHE_VERSION, CacheKey, Store, cache_root, key_hex
from stitch_backend.cache import keys as keys_module

BASE = dict(
    graph="graph():\n  %x = placeholder[target=x]\n  %y = aten.relu(%x)\n  return (y,)",
    input_metas=[{"shape": [2, 3], "stride": [3, 1], "dtype": "float32"}],
    options={"mode": "default", "allow_tf32": False},
    arch="sm_90a",
    versions={"torch": "2.11.0", "cuda": "12.8", "nvcc": "13.0", "stitchcuda": "0.1.0"},
)


def test_key_is_hex_sha256_and_deterministic():
    a, b = CacheKey(**BASE), CacheKey(**BASE)
    assert a.hex == b.hex and a == b and hash(a) == hash(b)
    assert len(a.hex) == 64 and int(a.hex, 16) >= 0
    assert key_hex(a) == a.hex and key_hex(a.hex) == a.hex


def test_key_ignores_dict_order_and_tuple_vs_list():
    shuffled = dict(BASE)
    shuffled["options"] = {"allow_tf32": False, "mode": "default"}
    shuffled["versions"] = dict(reversed(list(BASE["versions"].items())))
    shuffled["input_metas"] = ({"dtype": "float32", "stride": (3, 1), "shape": (2, 3)},)
    assert CacheKey(**shuffled).hex == CacheKey(**BASE).hex


PINNED_HEX = "0301c5669d1a7771914b531a19de20a7bc00c52362f3900a455d203427065170"


def test_key_pinned_value():
    # If this fails the key derivation changed: bump CACHE_VERSION so old entries miss.
    assert CACHE_VERSION == 1
    assert CacheKey(**BASE).hex == PINNED_HEX


def test_key_same_in_another_process_with_other_hash_seed(tmp_path: Path):
    script = (
        "import json, sys\nfrom stitch_backend.cache import CacheKey\n"
        "print(CacheKey(**json.loads(sys.argv[1])).hex)\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(BASE)], env=env,
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == CacheKey(**BASE).hex


@pytest.mark.parametrize("field,value", [
    ("graph", BASE["graph"].replace("relu", "gelu")),
    ("graph", BASE["graph"] + " "),
    ("input_metas", [{"shape": [2, 4], "stride": [4, 1], "dtype": "float32"}]),
    ("input_metas", [{"shape": [2, 3], "stride": [1, 2], "dtype": "float32"}]),
    ("input_metas", [{"shape": [2, 3], "stride": [3, 1], "dtype": "float16"}]),
    ("options", {"mode": "max-autotune", "allow_tf32": False}),
    ("options", {"mode": "default", "allow_tf32": True}),
    ("options", {"mode": "default", "allow_tf32": False, "extra": 1}),
    ("arch", "sm_80"),
    ("versions", {**BASE["versions"], "torch": "2.13.0"}),
    ("versions", {**BASE["versions"], "cuda": "13.0"}),
    ("versions", {**BASE["versions"], "nvcc": "12.9"}),
    ("versions", {**BASE["versions"], "stitchcuda": "0.2.0"}),
])
def test_key_changes_with_every_field(field, value):
    changed = dict(BASE, **{field: value})
    assert CacheKey(**changed).hex != CacheKey(**BASE).hex


def test_key_changes_with_cache_version(monkeypatch):
    before = CacheKey(**BASE).hex
    monkeypatch.setattr(keys_module, "CACHE_VERSION", CACHE_VERSION + 1)
    assert CacheKey(**BASE).hex != before


def test_fields_record_everything_and_round_trip():
    key = CacheKey(**BASE)
    fields = key.fields()
    assert fields["cache_version"] == CACHE_VERSION
    assert {k: fields[k] for k in BASE} == json.loads(json.dumps(BASE))
    assert CacheKey.from_fields(json.loads(json.dumps(fields))) == key
    fields["graph"] = "mutated"  # a copy: the key is unaffected
    assert key.graph == BASE["graph"]
    with pytest.raises(ValueError, match="cache version"):
        CacheKey.from_fields({**key.fields(), "cache_version": 999})


def test_key_copies_caller_objects():
    options = {"mode": "default"}
    key = CacheKey(**dict(BASE, options=options))
    before = key.hex
    options["mode"] = "changed"
    assert key.options == {"mode": "default"}
    assert CacheKey(**dict(BASE, options={"mode": "default"})).hex == before


@pytest.mark.parametrize("field,value", [
    ("input_metas", [object()]),
    ("input_metas", [float("nan")]),
    ("options", {"fn": print}),
    ("graph", 123),
    ("arch", None),
    ("versions", ["torch"]),
])
def test_key_rejects_non_plain_values(field, value):
    with pytest.raises(TypeError):
        CacheKey(**dict(BASE, **{field: value}))


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61, 5])
def test_key_hex_rejects_non_keys(bad):
    with pytest.raises(ValueError):
        key_hex(bad)


def test_root_read_from_env_at_call_time(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(tmp_path / "one"))
    assert cache_root() == tmp_path / "one"
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(tmp_path / "two"))
    assert cache_root() == tmp_path / "two"
    assert Store().root == tmp_path / "two"
    monkeypatch.delenv("STITCHCUDA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "stitchcuda"


def test_nothing_created_on_import_or_construction_or_read(monkeypatch, tmp_path: Path):
    root = tmp_path / "never"
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(root))
    script = "import stitch_backend.cache as c; s = c.Store(); print(s.get('a' * 64), s.ls())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "None []"
    store = Store()
    assert store.get(CacheKey(**BASE)) is None and store.ls() == [] and store.verify() == []
    assert not root.exists()
