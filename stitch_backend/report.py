"""Readable reports of what the backend did: text for terminals, JSON for tools."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .ir import Region, RegionKind


def render_text(records: Iterable[Any], *, dynamo_graphs: int | None = None,
                max_ops: int = 6) -> str:
    """One block per compiled graph: its regions, kinds, ops and fallback reasons."""
    records = list(records)
    lines: list[str] = []
    header = f"stitchcuda: {len(records)} ATen graph(s) compiled"
    if dynamo_graphs is not None:
        header += f" from {dynamo_graphs} Dynamo graph(s)"
    lines.append(header)
    for rec in records:
        counts = rec.plan.counts()
        kinds = ", ".join(f"{counts[k.value]} {k.value}" for k in RegionKind if counts[k.value])
        dyn = ", dynamic shapes" if rec.dynamic else ""
        lines.append(f"\n{rec.name}: {len(rec.plan.regions)} regions ({kinds}); "
                     f"{counts['generated']} generated; device {rec.device}{dyn}; "
                     f"key {rec.key.short}; planned in {rec.compile_ms:.1f} ms"
                     + (f"; verified in {rec.program.verify_s:.2f} s"
                        if rec.program is not None and rec.program.verify_s else ""))
        if rec.runs_as_traced:
            lines.append("  runs as traced by Dynamo (eager, undecomposed): faster than "
                         "its stitched Program, which is set aside (see the notes)")
        for note in rec.notes:
            lines.append(f"  note: {note}")
        memory = rec.memory()
        if memory is not None:
            lines.append(f"  {memory.line()}")
        spent = hotspots_line(rec.plan.regions)
        if spent:
            lines.append(f"  {spent}")
        total = sum(r.aten_ms for r in rec.plan.regions if r.aten_ms is not None)
        for region in rec.plan.regions:
            ops = [o.removeprefix("aten.").removesuffix(".default") for o in region.ops]
            shown = ", ".join(ops[:max_ops]) + (f", ... (+{len(ops) - max_ops})"
                                                 if len(ops) > max_ops else "")
            runs = region.kernel if region.backend != "aten" and region.kernel else region.backend
            line = f"  [{region.id:3d}] {region.kind.value:9s} {runs:10s} {shown}"
            facts = []
            if region.speedup is not None:
                facts.append(f"{region.speedup:.2f}x eager")
            if region.aten_ms is not None and total > 0:
                facts.append(f"{region.aten_ms / total:.0%} of ATen time")
            if facts:
                line += f"  ({'; '.join(facts)})"
            lines.append(line)
            if region.kind is RegionKind.FALLBACK and region.reason:
                lines.append(f"        fallback: {region.reason}")
            elif region.backend == "aten" and region.reason and not any(
                    region.reason in note for note in rec.notes):
                lines.append(f"        on ATen: {region.reason}")
    return "\n".join(lines)


def hotspots_line(regions: Sequence[Region], top: int = 5) -> str | None:
    """Where the graph's time goes: its regions' ATen times measured at the first call
    (``agents.hotspots``), slowest first; None when they were not measured."""
    timed = [r for r in regions if r.aten_ms is not None]
    total = sum(r.aten_ms for r in timed)
    if not timed or total <= 0:
        return None
    slowest = sorted(timed, key=lambda r: -r.aten_ms)[:top]
    shown = ", ".join(f"[{r.id}] {r.aten_ms / total:.0%}" for r in slowest)
    return f"hotspots: {total:.3f} ms on ATen at the first call; slowest regions {shown}"


def render_json(records: Iterable[Any]) -> dict[str, Any]:
    """A JSON object: ``graphs`` (each with ``regions``) and a flat ``regions`` list."""
    graphs = [rec.to_dict() for rec in records]
    regions = [dict(r, graph=g["index"]) for g in graphs for r in g["regions"]]
    return {"graphs": graphs, "regions": regions}
