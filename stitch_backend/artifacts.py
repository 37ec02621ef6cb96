"""Compiled Programs in the artifact cache: what is stored, and the warm start.

A cache entry for one graph holds its plan (with every region's verdict and reason),
the cubin and CUDA source of every accepted kernel, its launches as verified (output
layouts, grid, block: ``stitch_backend.recorded``) and stage structure, and a report. On
a GPU hit the stored cubins load and launch from the stored layouts: no Coder, no nvcc,
no verification (the entry was verified end to end before it was stored, and the key
covers the code-generating sources). Entries without stored launches, and the CPU
interpreter, have the Coder regenerate each kernel's source, which must hash to what was
stored. Weights are graph inputs: nothing of the user's data is stored.

Concurrency: a process that misses holds the entry's lock from compile until its first
call has verified and stored the Program, so N processes compiling one graph build it
once. A lock wait that times out, or a graph this process is already building, builds
without the cache rather than waiting forever.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from . import recorded as recorded_mod
from .ir import Plan, Region, RegionKind

log = logging.getLogger("stitch_backend.artifacts")

_building: set[str] = set()
_building_guard = threading.Lock()


def sha256(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


@dataclass
class CacheSlot:
    """This process's claim on one key while it builds the entry."""

    store: Any
    key: str
    lock: Any = None
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        with _building_guard:
            _building.discard(self.key)
        if self.lock is not None:
            try:
                self.lock.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - releasing must never fail the user
                pass


@dataclass
class WarmStart:
    """What a cache hit gives the backend."""

    runners: dict[int, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)


def open_store(cache_dir: str, trusted_shared: bool = False):
    from stitch_backend.cache import Store

    return Store(cache_dir or None, trusted_shared=trusted_shared)


def claim(store, key: str, timeout: float = 600.0) -> tuple[Any, CacheSlot | None]:
    """Look ``key`` up; on a miss, take the build lock and look again.

    Returns (entry, None) on a hit, (None, slot) when this process should build and
    store, and (None, None) when the cache cannot be used (reason logged)."""
    from stitch_backend.cache import CacheError

    try:
        entry = store.get(key)
        if entry is not None:
            return entry, None
        with _building_guard:
            if key in _building:
                log.info("graph %s is already being built in this process; not caching this copy",
                         key[:12])
                return None, None
            _building.add(key)
        slot = CacheSlot(store=store, key=key)
        slot.lock = store.lock(key, timeout=timeout)
        slot.lock.__enter__()
        entry = store.get(key)
        if entry is not None:
            slot.release()
            return entry, None
        return None, slot
    except CacheError as err:
        with _building_guard:
            _building.discard(key)
        log.warning("stitchcuda cache unavailable (%s); compiling without it", err)
        return None, None


def manifest_of(program, record, candidates: dict[int, Any]) -> tuple[dict, dict[str, bytes]]:
    """The manifest and artifacts that describe ``program`` (accepted kernels only)."""
    plan: Plan = program.plan
    blobs: dict[str, bytes] = {}
    kernels = []
    for region in plan.regions:
        if region.backend != "kernel":
            continue
        # the winner: the template's candidate or one of its (trusted) alternatives
        cand = getattr(program.step_of(region.id).fn, "candidate", None) or candidates[region.id]
        stem = f"r{region.id}_{cand.name}"
        if cand.cubin is not None:  # None: the cpu_interpret testing aid compiles nothing
            blobs[f"{stem}.cubin"] = cand.cubin
        blobs[f"{stem}.cu"] = cand.source.encode()
        kernels.append({"region": region.id, "name": cand.name,
                        "entries": [k.entry for k in cand.kernels],
                        "source_sha256": sha256(cand.source),
                        "cubin": f"{stem}.cubin" if cand.cubin is not None else None,
                        "source": f"{stem}.cu", "speedup": region.speedup,
                        **_launch_records(cand)})
    manifest = {
        "graph": plan.graph_name,
        "stage": record.stage,
        "plan": plan.to_json(),
        "kernels": kernels,
        "timings": {"compile_ms": round(record.compile_ms, 3)},
        "report": {"regions": [{"id": r.id, "kind": r.kind.value, "ops": r.ops,
                                "reason": r.reason, "kernel": r.kernel, "speedup": r.speedup}
                               for r in plan.regions]},
    }
    return manifest, blobs


def warm_start(entry, gm, plan: Plan, *, task_graph: str, sm_count: int,
               base: Any = None, split_stats: bool = True, clusters: bool = False,
               notes: list[str] | None = None) -> WarmStart | None:
    """Rebuild the kernels of a cached entry for ``plan``; None when the entry does not fit
    this graph, so the caller compiles afresh. Why it did not fit, or why the stored
    launches were not used, is logged as a warning and appended to ``notes``.
    ``split_stats`` and ``clusters`` are the Coder's settings when the entry was written
    (its kernels are regenerated by such a Coder for shapes the entry has no launch for)."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.kernels import runner_for

    notes = notes if notes is not None else []

    def say(msg: str) -> None:
        log.warning("%s", msg)
        notes.append(msg)

    manifest = entry.manifest
    try:
        stored = Plan.from_json(manifest["plan"])
    except (KeyError, ValueError, TypeError) as err:
        say(f"cache entry {entry.key[:12]} has no readable plan ({err}); rebuilding")
        return None
    shape = [(r.kind, r.ops, r.nodes) for r in plan.regions]
    if shape != [(r.kind, r.ops, r.nodes) for r in stored.regions]:
        say(f"cache entry {entry.key[:12]} was planned differently; rebuilding")
        return None
    coder = TemplateCoder(sm_count=sm_count, split_stats=split_stats, clusters=clusters)
    interpreted = getattr(base, "__name__", "") == "InterpretedRunner"
    if not interpreted and manifest.get("kernels") and all(
            k.get("format") == recorded_mod.FORMAT for k in manifest["kernels"]):
        try:
            runners = {k["region"]: runner_for(_recorded_candidate(entry, gm, plan, k, coder,
                                                                   task_graph), base=base)
                       for k in manifest["kernels"]}
        except Exception as err:  # noqa: BLE001 - a record that does not fit: regenerate
            say(f"cache entry {entry.key[:12]}: stored launches unusable "
                   f"({type(err).__name__}: {err}); regenerating its kernels")
        else:
            _restore_verdicts(plan, stored)
            return WarmStart(runners=runners, manifest=manifest)
    runners: dict[int, Any] = {}
    for k in manifest.get("kernels", []):
        region = plan.regions[k["region"]]
        try:
            cand = _regenerated(coder, gm, region, task_graph, k["source_sha256"])
        except Exception as err:  # noqa: BLE001
            say(f"cache entry {entry.key[:12]}: cannot regenerate {k['name']} ({err}); "
                   "rebuilding")
            return None
        if cand is None:
            say(f"cache entry {entry.key[:12]}: kernel {k['name']} source changed; "
                   "rebuilding")
            return None
        if k.get("cubin"):
            cand.cubin = entry.read(k["cubin"])
        elif not interpreted and cand.kernels:   # a library-only candidate has none
            say(f"cache entry {entry.key[:12]} has no cubin for {k['name']}; rebuilding")
            return None
        runners[region.id] = runner_for(cand, base=base)
    _restore_verdicts(plan, stored)
    return WarmStart(runners=runners, manifest=manifest)


def _restore_verdicts(plan: Plan, stored: Plan) -> None:
    for r, s in zip(plan.regions, stored.regions):
        r.backend, r.kernel, r.speedup, r.time_ms, r.aten_ms, r.reason = (
            s.backend, s.kernel, s.speedup, s.time_ms, s.aten_ms, s.reason)


def _launch_records(cand) -> dict:
    """The stored launches and stage structure of a candidate (``stitch_backend.recorded``);
    empty when some kernel has no launch recorded (then warm start regenerates)."""
    records = [recorded_mod.kernel_record(k) for k in cand.kernels]
    if not records or any(not r["layouts"] for r in records):
        return {}
    stages = None
    if cand.stages is not None:
        entries = [r["entry"] for r in records]
        stages = [{"id": st.region.id, "nodes": list(st.region.nodes),
                   "inputs": list(st.region.inputs), "outputs": list(st.region.outputs),
                   "kernel": entries.index(st.kernel.entry) if st.kernel is not None else None}
                  for st in cand.stages]
    return {"format": recorded_mod.FORMAT, "records": records, "stages": stages,
            "region_inputs": list(cand.region_inputs or []),
            "region_outputs": list(cand.region_outputs or [])}


def _regenerated(coder, gm, region: Region, task_graph: str, sha: str):
    """The Coder's candidate for ``region`` (or one of its alternatives) whose source
    hashes to ``sha``: what was stored, written again; None when the Coder writes
    something else now."""
    from stitch_backend.agents.state import subtask_for

    cand = coder.propose(subtask_for(gm, region, f"{task_graph}_{region.name}"))
    return next((c for c in [cand, *cand.alternatives] if sha256(c.source) == sha), None)


def _recorded_candidate(entry, gm, plan: Plan, k: dict, coder, task_graph: str):
    """The stored candidate of manifest record ``k``, launching from its stored layouts."""
    from stitch_backend.agents.state import Candidate, Stage
    from stitch_backend.regions import region_module

    region = plan.regions[k["region"]]
    source = entry.read(k["source"]).decode()
    if sha256(source) != k["source_sha256"]:
        raise ValueError(f"stored source of {k['name']} does not match its hash")
    cubin = entry.read(k["cubin"]) if k.get("cubin") else None
    if cubin is None:
        raise ValueError(f"no cubin for {k['name']}")
    regenerated: dict[str, Any] = {}

    def regenerate(kernel_entry: str):
        if not regenerated:
            cand = _regenerated(coder, gm, region, task_graph, k["source_sha256"])
            if cand is None:
                raise ValueError(f"{k['name']}: the Coder no longer writes the stored source")
            regenerated.update({kk.entry: kk for kk in cand.kernels})
        return regenerated[kernel_entry]

    kernels = [recorded_mod.RecordedKernel(r, lambda e=r["entry"]: regenerate(e))
               for r in k["records"]]
    cand = Candidate(region_id=region.id, origin="template", name=k["name"], source=source,
                     signature=kernels[0].signature, kernel=kernels[0], cubin=cubin)
    if k["stages"] is not None:
        cand.stages = []
        for st in k["stages"]:
            sub = Region(id=st["id"], kind=RegionKind.FUSED, nodes=st["nodes"], ops=[],
                         inputs=st["inputs"], outputs=st["outputs"])
            cand.stages.append(Stage(sub, kernel=kernels[st["kernel"]]) if st["kernel"] is not None
                               else Stage(sub, module=region_module(gm, sub)))
        cand.region_inputs, cand.region_outputs = k["region_inputs"], k["region_outputs"]
    return cand


def store_program(slot: CacheSlot, program, record, candidates: dict[int, Any]) -> None:
    """Publish the verified Program under the slot's key and release the lock."""
    from stitch_backend.cache import CacheError

    try:
        manifest, blobs = manifest_of(program, record, candidates)
        slot.store.put(slot.key, manifest, blobs)
        record.notes.append(f"stored in the cache as {slot.key[:12]}")
    except (CacheError, OSError, ValueError) as err:
        log.warning("could not store graph %s in the cache: %s", slot.key[:12], err)
    finally:
        slot.release()


def generated_regions(plan: Plan) -> int:
    return sum(1 for r in plan.regions if r.kind is not RegionKind.FALLBACK and r.backend != "aten")
