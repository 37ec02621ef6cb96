"""Build locks: several processes asking for the same key build it once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stitch_backend.cache import CacheLockTimeout, FileLock, Store

WORKER = r"""
import json, os, sys, time
from pathlib import Path
from stitch_backend.cache import Store

root, key, counter, ready_dir, me, n = sys.argv[1:7]
Path(ready_dir, me).touch()
deadline = time.monotonic() + 30
while len(os.listdir(ready_dir)) < int(n):  # start together, so the builds would overlap
    assert time.monotonic() < deadline, "other workers never started"
    time.sleep(0.01)

def build():
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough that unserialised builds would surely overlap
    return {"plan": {"built_by": os.getpid()}}, {"k.cubin": os.urandom(256)}

entry = Store(Path(root)).get_or_build(key, build)
print(json.dumps({"path": str(entry.path), "built_by": entry.manifest["plan"]["built_by"],
                  "cubin": entry.read("k.cubin").hex()}))
"""


def test_four_processes_build_once_and_share_the_entry(tmp_path: Path, make_key):
    root, counter, ready = tmp_path / "cache", tmp_path / "builds.txt", tmp_path / "ready"
    ready.mkdir()
    key, n = make_key().hex, 4
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), key, str(counter),
                               str(ready), str(i), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))

    builders = counter.read_text().split()
    assert len(builders) == 1, f"built {len(builders)} times"
    assert {r["built_by"] for r in results} == {int(builders[0])}
    assert len({r["cubin"] for r in results}) == 1  # the same random bytes everywhere
    assert len({r["path"] for r in results}) == 1
    entry = Store(root).get(key)
    assert entry is not None and entry.read("k.cubin").hex() == results[0]["cubin"]


def test_lock_excludes_other_holders_and_times_out(store, make_key):
    with store.lock(make_key()):
        # flock locks belong to open file descriptions: a second open conflicts even in-process.
        start = time.monotonic()
        with pytest.raises(CacheLockTimeout, match="still held"):
            with store.lock(make_key(), timeout=0.2):
                pass
        assert time.monotonic() - start >= 0.2
        with store.lock(make_key(1), timeout=0.2):  # other keys are independent
            pass
    with store.lock(make_key(), timeout=0.2):  # released on exit
        pass


def test_lock_waits_for_holder(tmp_path: Path):
    path = tmp_path / "x.lock"
    order = []
    held = threading.Event()

    def holder():
        with FileLock(path):
            held.set()
            time.sleep(0.3)
            order.append("holder done")

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    with FileLock(path):
        order.append("waiter in")
    t.join()
    assert order == ["holder done", "waiter in"]


def test_build_failure_releases_lock_and_publishes_nothing(store, make_key, artifacts):
    def broken_build():
        raise RuntimeError("nvcc failed")

    with pytest.raises(RuntimeError, match="nvcc failed"):
        store.get_or_build(make_key(), broken_build)
    assert store.get(make_key()) is None
    entry = store.get_or_build(make_key(), lambda: ({"ok": True}, artifacts()))
    assert entry.manifest["ok"] is True


def test_get_or_build_hit_does_not_build(store, make_key, artifacts):
    store.put(make_key(), {}, artifacts())

    def must_not_build():
        raise AssertionError("built on a hit")

    assert Store(store.root).get_or_build(make_key(), must_not_build).key == make_key().hex
