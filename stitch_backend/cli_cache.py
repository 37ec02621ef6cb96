"""`stitchcuda cache ...`: inspect and manage the artifact store from the shell.

``add_parser(subparsers)`` registers the ``cache`` subcommand; ``run(args)`` executes it
and returns the exit code: 0 success, 1 something was found broken or refused, 2 a
key prefix named no single entry (or the command was refused as given).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from pathlib import Path
from typing import Any

from stitch_backend.cache import (RESERVED_FIELDS, CacheError, CacheSecurityError,
                                  CorruptEntryError, EntryInfo, KeyLookupError, Store)

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2

_REGION_COLUMNS = ("id", "kind", "ops", "reason", "kernel", "speedup")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cache`` and its sub-subcommands on ``subparsers``; returns its parser."""
    p = subparsers.add_parser("cache", help="inspect and manage the compiled-artifact cache",
                              description="Inspect and manage the compiled-artifact cache.")
    p.add_argument("--dir", dest="cache_dir", type=Path, default=None,
                   help="cache root (default: $STITCHCUDA_CACHE_DIR or ~/.cache/stitchcuda)")
    p.add_argument("--trusted-shared", action="store_true",
                   help="accept entries owned by other users or writable by a group: only "
                        "for a shared cache whose every writer you trust")
    sub = p.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)

    ls = sub.add_parser("ls", help="list entries, most recently used first")
    ls.add_argument("--json", action="store_true", help="print JSON")

    show = sub.add_parser("show", help="show one entry's report")
    show.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
    show.add_argument("--json", action="store_true", help="print the manifest as JSON")
    show.add_argument("--html", metavar="FILE", type=Path, help="also write an HTML page")

    rm = sub.add_parser("rm", help="remove one entry")
    rm.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")

    clear = sub.add_parser("clear", help="remove every entry")
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    verify = sub.add_parser("verify", help="check every entry's checksums (exit 1 if broken)")
    verify.add_argument("--json", action="store_true", help="print JSON")

    export = sub.add_parser("export", help="write entries to a .tar.gz")
    export.add_argument("file", metavar="FILE", type=Path)
    export.add_argument("keys", metavar="KEY", nargs="*", help="keys or prefixes (default: all)")

    imp = sub.add_parser("import", help="import entries from a .tar.gz made by export")
    imp.add_argument("file", metavar="FILE", type=Path)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``cache`` command; returns the process exit code."""
    store = Store(args.cache_dir, trusted_shared=args.trusted_shared)
    problem = store.check_root()
    if problem:
        return _fail(f"refusing cache root {store.root}: {problem} (pass --trusted-shared "
                     f"only if every writer of this cache is trusted)", EXIT_BROKEN)
    handler = _COMMANDS[args.cache_command]
    try:
        return handler(store, args)
    except KeyLookupError as exc:
        return _fail(exc.reason, EXIT_USAGE)
    except (CacheError, OSError) as exc:
        return _fail(str(exc), EXIT_BROKEN)


def _fail(message: str, code: int) -> int:
    print(f"stitchcuda cache: error: {message}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------- commands


def _ls(store: Store, args: argparse.Namespace) -> int:
    infos = store.ls()
    if args.json:
        print(json.dumps([i.to_json() for i in infos], indent=1, sort_keys=True))
        return EXIT_OK
    if not infos:
        print(f"no entries in {store.root}")
    else:
        print(f"{'KEY':16}  {'SIZE':>9}  {'LAST USED':19}  {'ARCH':8}  SUMMARY")
        for i in infos:
            summary = "BROKEN: " + i.problem if i.problem else _inline(i.summary)
            print(f"{i.key[:16]}  {_size(i.size):>9}  {_when(i.last_used):19}  "
                  f"{i.arch or '-':8}  {summary}")
        print(f"{len(infos)} entries, {_size(sum(i.size for i in infos))} in {store.root}")
    notes = {kind: n for kind, n in store.note_counts().items() if n}
    if notes:
        print("notes (facts measured on this machine; `cache clear` removes them too): "
              + ", ".join(f"{n} {kind}" for kind, n in notes.items()))
    return EXIT_OK


def _show(store: Store, args: argparse.Namespace) -> int:
    h = store.resolve(args.key)
    try:
        entry = store.load(h)
    except (CorruptEntryError, CacheSecurityError) as exc:
        return _fail(f"{exc} (run `stitchcuda cache rm {h[:16]}` or let it be rebuilt)",
                     EXIT_BROKEN)
    info = store.info(h)
    if entry is None or info is None:
        return _fail(f"entry {h[:16]} vanished", EXIT_BROKEN)
    if args.json:
        print(json.dumps({**info.to_json(), "manifest": entry.manifest}, indent=1,
                         sort_keys=True))
    else:
        print(_markdown(info, entry.manifest), end="")
    if args.html:
        args.html.write_text(_html(info, entry.manifest), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    return EXIT_OK


def _rm(store: Store, args: argparse.Namespace) -> int:
    h = store.resolve(args.key)
    store.rm(h)
    print(f"removed {h}")
    return EXIT_OK


def _clear(store: Store, args: argparse.Namespace) -> int:
    count = len(store.keys())
    if not args.yes:
        if not sys.stdin.isatty():
            return _fail(f"refusing to remove {count} entries from {store.root} without "
                         f"--yes", EXIT_USAGE)
        answer = input(f"remove all {count} entries from {store.root}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_OK
    removed = store.clear()
    print(f"removed {removed} entries from {store.root}")
    return EXIT_OK


def _verify(store: Store, args: argparse.Namespace) -> int:
    checked = len(store.keys())
    problems = store.verify()
    if args.json:
        print(json.dumps({"root": str(store.root), "checked": checked,
                          "problems": [p.to_json() for p in problems]}, indent=1))
    else:
        for p in problems:
            print(f"BROKEN {p.key[:16] or p.path}: {p.reason}")
        print(f"{checked} entries checked, {len(problems)} broken")
        if problems:
            print("broken entries are rebuilt on next use; `stitchcuda cache rm KEY` "
                  "removes one now")
    return EXIT_BROKEN if problems else EXIT_OK


def _export(store: Store, args: argparse.Namespace) -> int:
    keys = [store.resolve(k) for k in args.keys] if args.keys else None
    report = store.export(keys, args.file)
    for r in report.skipped:
        print(f"skipped {r.name[:16]}: {r.reason}", file=sys.stderr)
    print(f"exported {len(report.exported)} entries to {args.file}")
    return EXIT_BROKEN if report.skipped else EXIT_OK


def _import(store: Store, args: argparse.Namespace) -> int:
    report = store.import_(args.file)
    for r in report.refused:
        print(f"refused {r.name}: {r.reason}", file=sys.stderr)
    print(f"imported {len(report.imported)} entries, {len(report.present)} already present, "
          f"{len(report.refused)} refused")
    return EXIT_OK if report.ok else EXIT_BROKEN


_COMMANDS = {"ls": _ls, "show": _show, "rm": _rm, "clear": _clear, "verify": _verify,
             "export": _export, "import": _import}


# ---------------------------------------------------------------------- report rendering


def _facts(info: EntryInfo, manifest: dict[str, Any]) -> list[tuple[str, str]]:
    fields = manifest.get("key_fields") or {}
    versions = fields.get("versions") if isinstance(fields, dict) else None
    facts = [("key", info.key), ("path", str(info.path)), ("size", _size(info.size)),
             ("created", _when(info.created)), ("last used", _when(info.last_used)),
             ("arch", info.arch or "-")]
    if isinstance(versions, dict):
        facts.append(("versions", ", ".join(f"{k}={v}" for k, v in sorted(versions.items()))))
    return facts


def _regions(manifest: dict[str, Any]) -> list[dict[str, str]] | None:
    report = manifest.get("report")
    if not isinstance(report, dict) or not isinstance(report.get("regions"), list):
        return None
    return [{col: _cell(col, r.get(col) if isinstance(r, dict) else None)
             for col in _REGION_COLUMNS} for r in report["regions"]]


def _other_fields(manifest: dict[str, Any], with_report: bool) -> list[tuple[str, str]]:
    """Top-level manifest fields worth showing (store bookkeeping left out)."""
    skip = set(RESERVED_FIELDS) | ({"report"} if with_report else set())
    rows = []
    if with_report:
        rows += [(f"report.{k}", _short(v)) for k, v in sorted(manifest["report"].items())
                 if k != "regions"]
    rows += [(k, _short(v)) for k, v in sorted(manifest.items()) if k not in skip]
    return rows


def _markdown(info: EntryInfo, manifest: dict[str, Any]) -> str:
    regions = _regions(manifest)
    lines = [f"# stitchcuda cache entry `{info.key[:16]}`", "", "| field | value |",
             "|---|---|"]
    lines += [f"| {k} | {_md(v)} |" for k, v in _facts(info, manifest)]
    if regions is not None:
        lines += ["", f"## Regions ({len(regions)})", "",
                  "| " + " | ".join(_REGION_COLUMNS) + " |",
                  "|" + "---|" * len(_REGION_COLUMNS)]
        lines += ["| " + " | ".join(_md(r[c]) for c in _REGION_COLUMNS) + " |" for r in regions]
    other = _other_fields(manifest, regions is not None)
    if other:
        lines += ["", "## Manifest" if regions is None else "## Other fields", ""]
        lines += [f"- **{k}**: {_md(v)}" for k, v in other]
    lines += ["", "## Artifacts", "", "| name | sha256 |", "|---|---|"]
    lines += [f"| {_md(n)} | `{d[:16]}` |" for n, d in sorted(manifest["checksums"].items())]
    return "\n".join(lines) + "\n"


def _html(info: EntryInfo, manifest: dict[str, Any]) -> str:
    e = html.escape

    def table(head: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
        out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
        out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
        return "\n".join(out + ["</table>"])

    regions = _regions(manifest)
    parts = [f"<h1>stitchcuda cache entry <code>{e(info.key[:16])}</code></h1>",
             table(["field", "value"], [list(f) for f in _facts(info, manifest)])]
    if regions is not None:
        parts += [f"<h2>Regions ({len(regions)})</h2>",
                  table(_REGION_COLUMNS, [[r[c] for c in _REGION_COLUMNS] for r in regions])]
    other = _other_fields(manifest, regions is not None)
    if other:
        parts += ["<h2>Manifest</h2>" if regions is None else "<h2>Other fields</h2>",
                  table(["field", "value"], [list(o) for o in other])]
    parts += ["<h2>Artifacts</h2>",
              table(["name", "sha256"], [[n, d] for n, d in sorted(manifest["checksums"].items())])]
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
             "margin:1em 0}td,th{border:1px solid #bbb;padding:.3em .6em;text-align:left}"
             "th{background:#eee}code{font-family:monospace}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>stitchcuda cache entry {e(info.key[:16])}</title><style>{style}</style>"
            "</head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


# ---------------------------------------------------------------------- formatting


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "speedup" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.2f}x"
    if column == "ops" and isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _inline(summary: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v, 40)}" for k, v in sorted(summary.items())) or "-"


def _md(text: str) -> str:
    # A bare '|' would split a table cell; newlines would end the row.
    return text.replace("|", "\\|").replace("\n", " ")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


__all__ = ["add_parser", "run"]
