"""``kubectl-pd``: offline tools for PDDeployment manifests.

    kubectl-pd render FILE      print the children the operator would create, as YAML (for review and CI)
    kubectl-pd validate FILE    check the spec; exit 1 with one line per problem
    kubectl-pd diff OLD NEW     field-level diff of the effective worker config of two manifests

Cluster commands (credentials as kubectl: $KUBECONFIG / --kubeconfig, exec plugins, in-cluster), through
the operator's own client (``pdoperator.kube``, kubernetes_asyncio):

    kubectl-pd status NAME [-n NS]       phase, conditions and pairs of a PDDeployment
    kubectl-pd revisions NAME [-n NS]    its recorded revisions (ControllerRevisions), oldest first

Offline rendering cannot know the PDDeployment's uid, the generated KV token, or pod IPs:
owner references carry a placeholder uid, the Secret a placeholder token, and the topology
uses the stable per-pod DNS names with every pair not ready.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence, TextIO

import yaml

from .render import Owner, render
from .revisions import diff_configs, effective_config, revision_hash
from .spec import KIND, SpecError, parse_spec

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
PLACEHOLDER_TOKEN = "generated-once-by-the-operator"


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


def _diff(old_path: str, new_path: str, out: TextIO) -> int:
    """Exit 0 when both manifests give the same revision, 1 when they differ (like diff(1))."""
    old_doc, new_doc = _load(old_path)[0], _load(new_path)[0]
    try:
        old = parse_spec(old_doc.get("spec"), name=(old_doc.get("metadata") or {}).get("name"))
        new = parse_spec(new_doc.get("spec"), name=(new_doc.get("metadata") or {}).get("name"))
    except SpecError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 2
    out.write(f"revision {revision_hash(old)} -> {revision_hash(new)}\n")
    changes = diff_configs(effective_config(old), effective_config(new))
    for path, a, b in changes:
        out.write(f"  {path}: {a!r} -> {b!r}\n")
    return 1 if changes else 0


async def _cluster(args: argparse.Namespace, out: TextIO) -> int:
    from .kube import ApiError, Credentials, CredentialsError, Kube, path
    from .render import LABEL_DEPLOYMENT
    from .spec import GROUP, VERSION

    try:
        creds = await Credentials.load(args.kubeconfig, args.context)
    except CredentialsError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 1
    kube = Kube(creds)
    try:
        ns = args.namespace or creds.namespace()
        if args.cmd == "status":
            obj = await kube.get(path(f"{GROUP}/{VERSION}", KIND, ns, args.name))
            if obj is None:
                print(f"kubectl-pd: {KIND} {ns}/{args.name} not found", file=sys.stderr)
                return 1
            st = obj.get("status") or {}
            out.write(f"{KIND} {ns}/{args.name}: phase {st.get('phase', '-')}, ready pairs {st.get('readyPairs', 0)}"
                      f"/{(obj.get('spec') or {}).get('pairs', 1)}, revision {st.get('currentRevision')} -> "
                      f"{st.get('updateRevision')}, topology version {st.get('topologyVersion', '-')}\n")
            for c in st.get("conditions", []) or []:
                out.write(f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}\n")
            for p in st.get("pairs", []) or []:
                out.write(f"  pair {p['index']}: {p['phase']} revision {p.get('revision')} "
                          f"restarts {p.get('restarts', 0)}\n")
            return 0
        revs = await kube.list(path("apps/v1", "ControllerRevision", ns), label_selector=f"{LABEL_DEPLOYMENT}={args.name}")
        for r in sorted(revs, key=lambda r: int(r.get("revision", 0))):
            data = r.get("data") or {}
            out.write(f"{r.get('revision')}\t{data.get('revision')}\t{data.get('recordedAt', '')}\n")
        return 0
    except ApiError as e:
        print(f"kubectl-pd: {e}", file=sys.stderr)
        return 1
    finally:
        await kube.close()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl-pd", description="pdstack PDDeployment tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("render", help="print the children the operator would create, as YAML")
    p.add_argument("file", help="manifest file with PDDeployment documents ('-' = stdin)")
    v = sub.add_parser("validate", help="validate PDDeployment specs")
    v.add_argument("file")
    d = sub.add_parser("diff", help="field-level diff of the effective worker config of two manifests")
    d.add_argument("old")
    d.add_argument("new")
    for cmd, text in (("status", "phase, conditions and pairs of a PDDeployment in the cluster"),
                      ("revisions", "recorded revisions of a PDDeployment in the cluster")):
        c = sub.add_parser(cmd, help=text)
        c.add_argument("name")
        c.add_argument("-n", "--namespace", default=None, help="namespace (default: the context's, as kubectl)")
        c.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
        c.add_argument("--context", default=None)
    args = parser.parse_args(argv)
    out = out or sys.stdout
    if args.cmd == "render":
        return _render(args.file, out)
    if args.cmd == "diff":
        return _diff(args.old, args.new, out)
    if args.cmd in ("status", "revisions"):
        import asyncio
        return asyncio.run(_cluster(args, out))
    return _validate(args.file, out)


if __name__ == "__main__":
    raise SystemExit(main())
