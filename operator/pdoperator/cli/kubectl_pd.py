"""``kubectl-pd``: offline tools for PDDeployment manifests.

    kubectl-pd render FILE      print the children the operator would create, as YAML (for review and CI)
    kubectl-pd validate FILE    check the spec; exit 1 with one line per problem
    kubectl-pd diff --from-file A.yaml --to-file B.yaml   field-level diff of the effective config
                                of two manifests (``kubectl-pd diff A.yaml B.yaml`` also works)

Cluster commands (credentials as kubectl: $KUBECONFIG / --kubeconfig, exec plugins, in-cluster), through
the operator's own client (``pdoperator.shell.kube``, kubernetes_asyncio):

    kubectl-pd status NAME [-n NS]       groups with their pods, revisions, conditions, drift and stalls
    kubectl-pd requests NAME [-n NS]     live requests across router and workers, oldest first, and the
                                         router's verdict (through the API server's pods/proxy)
    kubectl-pd history NAME [-n NS]      its revisions (ControllerRevisions) and when each became current
    kubectl-pd diff NAME --since 12:00|2h|RFC3339   what changed since then (against the current revision)
    kubectl-pd diff NAME --from REV [--to REV]      two recorded revisions (hash or number; --to: current)
    kubectl-pd drift NAME [-n NS]        drift lines by source (children, image, process); exit 1 when any
    kubectl-pd rollback NAME --to REV | --last-known-good [--dry-run]
                                         patch the spec's revision fields back to a recorded revision (like
                                         ``kubectl rollout undo``; pairs, rollout, ... stay); prints the diff it
                                         applies; exit 0 applied (or already there), 2 error

Diffs are field-level over the effective config per role, defaults included
(``decode.env.PDRT_DECODE_TARGET_CTAS: <unset> -> 512``), with the revision and time of each side; a
table by default, ``-o json|yaml`` for data. Exit codes follow diff(1): 0 same, 1 differs, 2 error.

Offline rendering cannot know the PDDeployment's uid, the generated KV token, or pod IPs:
owner references carry a placeholder uid, the Secret a placeholder token, and the topology
uses the stable per-pod DNS names with every pair not ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence, TextIO

import yaml

from ..core.render import Owner, render
from ..core.revisions import (HistoryEntry, diff_report, effective_view, format_diff, format_time, history,
                              last_known_good, merge_patch, parse_since, recorded_spec, restore_spec, revision_at,
                              revision_hash, revision_view)
from ..core.spec import KIND, SpecError, parse_spec

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
PLACEHOLDER_TOKEN = "generated-once-by-the-operator"
ROLLBACK_ATTEMPTS = 4  # a rollback's patch is recomputed from a fresh read after a 409 (status writes race it)


def _load(path: str) -> list[dict[str, Any]]:
    with (sys.stdin if path == "-" else open(path, encoding="utf-8")) as fh:
        docs = [d for d in yaml.safe_load_all(fh) if isinstance(d, dict) and d.get("kind") == KIND]
    if not docs:
        raise SystemExit(f"kubectl-pd: {path}: no {KIND} document found")
    return docs


def render_manifest(doc: dict[str, Any]) -> list[dict[str, Any]]:
    meta = doc.get("metadata", {}) or {}
    name = meta.get("name", "")
    spec = parse_spec(doc.get("spec"), name=name)
    owner = Owner(name, meta.get("namespace") or "default", PLACEHOLDER_UID)
    return render(spec, owner, revision_hash(spec), kv_token=PLACEHOLDER_TOKEN,
                  admin_token=PLACEHOLDER_TOKEN, suffix="0")


def _render(path: str, out: TextIO) -> int:
    for doc in _load(path):
        try:
            children = render_manifest(doc)
        except SpecError as e:
            return _report(doc, e)
        out.write(yaml.safe_dump_all(children, sort_keys=False, explicit_start=True))
    return 0


def _report(doc: dict[str, Any], e: SpecError) -> int:
    name = (doc.get("metadata") or {}).get("name", "?")
    for problem in e.problems:
        print(f"{KIND}/{name}: {problem}", file=sys.stderr)
    return 1


def _validate(path: str, out: TextIO) -> int:
    rc = 0
    for doc in _load(path):
        try:
            spec = parse_spec(doc.get("spec"), name=(doc.get("metadata") or {}).get("name"))
            out.write(f"{KIND}/{doc['metadata']['name']}: valid, revision {revision_hash(spec)}\n")
        except SpecError as e:
            rc = _report(doc, e)
    return rc


class CliError(Exception):
    """A usage or lookup error: printed as ``kubectl-pd: ...``, exit 2."""


def _emit(report: dict[str, Any], fmt: str, out: TextIO) -> int:
    if fmt == "json":
        out.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
    elif fmt == "yaml":
        out.write(yaml.safe_dump(report, sort_keys=False))
    else:
        out.write(format_diff(report))
    return 1 if report["changes"] else 0


def _spec_of_file(path_: str) -> Any:
    try:
        doc = _load(path_)[0]
    except OSError as e:
        raise CliError(f"{path_}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise CliError(f"{path_}: not YAML: {e}") from None
    except SystemExit as e:
        raise CliError(str(e.code).removeprefix("kubectl-pd: ")) from None
    try:
        return parse_spec(doc.get("spec"), name=(doc.get("metadata") or {}).get("name"))
    except SpecError as e:
        raise CliError(f"{path_}: {e}") from None


def _diff_files(old_path: str, new_path: str, fmt: str, out: TextIO) -> int:
    """Exit 0 when both manifests give the same effective config, 1 when they differ (like diff(1))."""
    old, new = _spec_of_file(old_path), _spec_of_file(new_path)
    report = diff_report(effective_view(old), effective_view(new),
                         from_side={"revision": revision_hash(old), "source": old_path},
                         to_side={"revision": revision_hash(new), "source": new_path})
    return _emit(report, fmt, out)


def _pick(entries: list[HistoryEntry], ref: str) -> HistoryEntry:
    """A revision by hash (or a unique prefix of one), by number (``3`` or ``#3``), or ``current``."""
    if not entries:
        raise CliError("no revisions recorded")
    if ref == "current":
        return max(entries, key=lambda e: e.number)
    r = ref.lstrip("#")
    if r.isdigit():
        for e in entries:
            if e.number == int(r):
                return e
    hits = [e for e in entries if e.revision == ref] or [e for e in entries if e.revision.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(f"#{e.number} {e.revision}" for e in sorted(entries, key=lambda e: e.number))
    what = "ambiguous" if hits else "not found"
    raise CliError(f"revision {ref!r} {what}; recorded: {known} (or 'current')")


def _side(e: HistoryEntry) -> dict[str, Any]:
    return {"revision": e.revision, "number": e.number, "since": format_time(e.since)}


async def _cluster(args: argparse.Namespace, out: TextIO) -> int:
    from .view import ViewError, show_drift, show_requests, show_status
    from ..shell.kube import ApiError, Credentials, CredentialsError, Kube, path
    from ..core.render import LABEL_DEPLOYMENT
    from ..core.spec import GROUP, VERSION

    try:
        creds = await Credentials.load(args.kubeconfig, args.context)
    except CredentialsError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 2
    kube = Kube(creds)
    try:
        ns = args.namespace or creds.namespace()
        if args.cmd == "status":
            return await show_status(kube, ns, args.name, args.output, out)
        if args.cmd == "requests":
            return await show_requests(kube, ns, args.name, args.output, out)
        if args.cmd == "drift":
            return await show_drift(kube, ns, args.name, args.output, out)
        revs = await kube.list(path("apps/v1", "ControllerRevision", ns),
                               label_selector=f"{LABEL_DEPLOYMENT}={args.name}")
        entries = history(revs)
        if args.cmd == "rollback":
            obj = await kube.get(path(f"{GROUP}/{VERSION}", KIND, ns, args.name))
            if obj is None:
                raise CliError(f"{KIND} {ns}/{args.name} not found")
            return await _rollback(kube, obj, revs, entries, args, out)
        if args.cmd in ("history", "revisions"):
            if not entries and await kube.get(path(f"{GROUP}/{VERSION}", KIND, ns, args.name)) is None:
                raise CliError(f"{KIND} {ns}/{args.name} not found")
            current = max(entries, key=lambda e: e.number, default=None)
            rows = [dict(_side(e), current=e is current) for e in entries]
            if args.output == "json":
                out.write(json.dumps(rows, indent=2) + "\n")
            elif args.output == "yaml":
                out.write(yaml.safe_dump(rows, sort_keys=False))
            else:
                out.write(f"{'NUMBER':<8}{'REVISION':<14}{'CURRENT SINCE':<26}CURRENT\n")
                for r in rows:
                    out.write(f"{r['number']:<8}{r['revision']:<14}{r['since']:<26}{'*' if r['current'] else ''}\n")
            return 0
        # diff NAME --since T | --from REV [--to REV]
        if not entries:
            raise CliError(f"no revisions recorded for {KIND} {ns}/{args.name} (does it exist?)")
        by_name = {(r.get("metadata") or {}).get("name"): r for r in revs}
        if args.since is not None:
            try:
                t = parse_since(args.since, time.time())
            except ValueError as e:
                raise CliError(str(e)) from None
            a = revision_at(entries, t)
            if a is None:
                first = entries[0]
                raise CliError(f"no revision was current at {format_time(t)}: the first (#{first.number} "
                               f"{first.revision}) became current at {format_time(first.since)}")
        else:
            a = _pick(entries, args.from_rev)
        b = _pick(entries, args.to_rev or "current")
        report = diff_report(revision_view(by_name[a.name]), revision_view(by_name[b.name]),
                             from_side=_side(a), to_side=_side(b))
        if args.since is not None:
            report["since"] = format_time(t)
        return _emit(report, args.output, out)
    except (CliError, ViewError) as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 2
    except ApiError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 2
    finally:
        await kube.close()


def rollback_plan(obj: dict[str, Any], cr: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the spec after the rollback, the merge patch of ``spec``, the revision it hashes to) — pure."""
    raw = recorded_spec(cr)
    name = (cr.get("metadata") or {}).get("name", "?")
    if raw is None:
        raise CliError(f"ControllerRevision {name} was recorded without its spec (by an older operator); "
                       "it cannot be restored. Accepted: a revision recorded since rollback support")
    current = dict(obj.get("spec") or {})
    restored = restore_spec(current, raw)
    try:
        spec = parse_spec(restored, name=(obj.get("metadata") or {}).get("name"))
    except SpecError as e:
        raise CliError(f"the restored spec is not valid: {e}") from None
    return restored, merge_patch(current, restored), revision_hash(spec)


async def _rollback(kube: Any, obj: dict[str, Any], revs: list[dict[str, Any]], entries: list[HistoryEntry],
                    args: argparse.Namespace, out: TextIO) -> int:
    """``rollback NAME --to REV | --last-known-good [--dry-run]``: 0 applied or already there, 2 error."""
    from ..shell.kube import ApiError, path
    from ..core.spec import GROUP, VERSION

    meta = obj["metadata"]
    if args.last_known_good:
        good = last_known_good((obj.get("status") or {}).get("lastKnownGoodRevision"), revs)
        if good is None:
            raise CliError(f"{KIND} {meta['namespace']}/{meta['name']} has no known-good revision yet (a revision "
                           "becomes known-good after rollout.soakSeconds of serving with no stall); "
                           "accepted: --to REV (see kubectl-pd history)")
        target = next((e for e in entries if e.revision == good), None)
        if target is None:
            raise CliError(f"the last known-good revision {good} is no longer recorded (pruned); "
                           "accepted: --to REV (see kubectl-pd history)")
    else:
        target = _pick(entries, args.to_rev)
    cr = next(r for r in revs if (r.get("metadata") or {}).get("name") == target.name)
    url = path(f"{GROUP}/{VERSION}", KIND, meta["namespace"], meta["name"])
    planned: dict[str, Any] = {}

    def make(cur: Any) -> dict[str, Any] | None:
        planned["obj"] = cur
        planned["restored"], patch, planned["rev"] = rollback_plan(cur, cr)
        planned["changes"] = bool(patch)
        return {"spec": patch} if patch else None
    if args.dry_run:
        make(obj)
    else:
        try:  # 409: written in between (a status update, an edit): recomputed from a fresh read
            if await kube.merge_patch(url, obj, make, field_manager="kubectl-pd", attempts=ROLLBACK_ATTEMPTS) is None:
                raise CliError(f"{KIND} {meta['namespace']}/{meta['name']} not found")
        except ApiError as e:
            if e.status == 409:
                raise CliError(f"{KIND} {meta['namespace']}/{meta['name']} kept changing while rolling back; "
                               "run again") from None
            raise
    obj, restored, rev = planned["obj"], planned["restored"], planned["rev"]
    if not planned["changes"]:
        out.write(f"{KIND} {meta['namespace']}/{meta['name']}: already at revision {rev}; nothing to roll back\n")
        return 0
    try:
        before = effective_view(parse_spec(obj.get("spec"), name=meta["name"]))
        before_rev = revision_hash(parse_spec(obj.get("spec"), name=meta["name"]))
    except SpecError:
        before, before_rev = {}, "<invalid spec>"
    after = effective_view(parse_spec(restored, name=meta["name"]))
    report = diff_report(before, after, from_side={"revision": before_rev, "source": "spec before"},
                         to_side=dict(_side(target), revision=rev))
    if args.output == "json":
        out.write(json.dumps(report, indent=2) + "\n")
    elif args.output == "yaml":
        out.write(yaml.safe_dump(report, sort_keys=False))
    else:
        out.write(format_diff(report))
    if rev != target.revision:
        out.write(f"note: the restored spec hashes to {rev}, recorded as {target.revision} "
                  "(an operator version with a different effective config)\n")
    if args.dry_run:
        out.write(f"dry run: {KIND} {meta['namespace']}/{meta['name']} not changed\n")
    else:
        out.write(f"rolled back {KIND} {meta['namespace']}/{meta['name']} to revision {rev} (#{target.number})\n")
    return 0


def _cluster_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("-n", "--namespace", default=None, help="namespace (default: the context's, as kubectl)")
    c.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    c.add_argument("--context", default=None)


def build_parser() -> argparse.ArgumentParser:
    """kubectl-pd's arguments: every subcommand and flag (docs/operator.md, docs/operations.md)."""
    parser = argparse.ArgumentParser(prog="kubectl-pd", description="pdstack PDDeployment tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("render", help="print the children the operator would create, as YAML")
    p.add_argument("file", help="manifest file with PDDeployment documents ('-' = stdin)")
    v = sub.add_parser("validate", help="validate PDDeployment specs")
    v.add_argument("file")
    d = sub.add_parser("diff", help="field-level diff of the effective config: two manifests, two recorded "
                                    "revisions, or what changed since a time")
    d.add_argument("targets", nargs="*", metavar="NAME | OLD.yaml NEW.yaml")
    d.add_argument("--from-file", dest="from_file")
    d.add_argument("--to-file", dest="to_file")
    d.add_argument("--since", help="12:00 (UTC, today), a duration like 2h, or an RFC 3339 time")
    d.add_argument("--from", dest="from_rev", help="revision hash or number")
    d.add_argument("--to", dest="to_rev", help="revision hash or number (default: current)")
    d.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    _cluster_args(d)
    for cmd, text in (("status", "groups, pods, revisions, conditions, drift and stalls of a PDDeployment"),
                      ("requests", "live requests across the router and workers, oldest first (pods/proxy)"),
                      ("history", "revisions of a PDDeployment and when each became current"),
                      ("revisions", "alias of history"),
                      ("drift", "what runs differently from the declared config (exit 1 when anything does)")):
        c = sub.add_parser(cmd, help=text)
        c.add_argument("name")
        c.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
        _cluster_args(c)
    rb = sub.add_parser("rollback", help="patch the spec back to a recorded revision's worker config")
    rb.add_argument("name")
    which = rb.add_mutually_exclusive_group(required=True)
    which.add_argument("--to", dest="to_rev", help="revision hash (or unique prefix) or number (see history)")
    which.add_argument("--last-known-good", action="store_true",
                       help="the last revision that served rollout.soakSeconds with no stall")
    rb.add_argument("--dry-run", action="store_true", help="print the diff only")
    rb.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    _cluster_args(rb)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0  # argparse printed the usage error
    out = out or sys.stdout
    if args.cmd == "render":
        return _render(args.file, out)
    if args.cmd == "requests":
        import asyncio
        return asyncio.run(_cluster(args, out))
    if args.cmd == "diff":
        return _diff(args, out)
    if args.cmd in ("status", "history", "revisions", "drift", "rollback"):
        import asyncio
        return asyncio.run(_cluster(args, out))
    return _validate(args.file, out)


def _diff(args: argparse.Namespace, out: TextIO) -> int:
    try:
        files = [args.from_file, args.to_file]
        if any(files) or len(args.targets) == 2:
            if any(files) and args.targets or not (all(files) or len(args.targets) == 2):
                raise CliError("offline diff takes --from-file A.yaml --to-file B.yaml (or two files)")
            if args.since or args.from_rev or args.to_rev:
                raise CliError("--since/--from/--to read a cluster's history; not with files")
            a, b = files if all(files) else args.targets
            return _diff_files(a, b, args.output, out)
        if len(args.targets) != 1:
            raise CliError("usage: diff NAME --since T | diff NAME --from REV [--to REV] | "
                           "diff --from-file A.yaml --to-file B.yaml")
        if (args.since is None) == (args.from_rev is None):
            raise CliError("diff NAME needs exactly one of --since T or --from REV")
        if args.since is not None and args.to_rev:
            raise CliError("--since compares against the current revision; --to goes with --from")
    except CliError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 2
    args.name = args.targets[0]
    import asyncio
    return asyncio.run(_cluster(args, out))


if __name__ == "__main__":
    raise SystemExit(main())
