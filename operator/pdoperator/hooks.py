"""``python -m pdoperator.hooks``: the chart's Helm hooks (templates/hooks.yaml), run as Jobs from the operator image.

    python -m pdoperator.hooks apply-crd FILE
        pre-install, pre-upgrade: server-side apply the chart's CRD. Helm installs ``crds/`` once and never
        upgrades it, so without this a new chart version would run against the old schema.
    python -m pdoperator.hooks delete-pddeployments -n NS -l SELECTOR [--timeout S]
        pre-delete: delete the release's own PDDeployments (the example) while the operator still runs, and
        wait until they are gone. ``helm uninstall`` otherwise deletes the operator and its RBAC in the same
        pass, and a PDDeployment that still carries the operator's finalizer stays Terminating.

Credentials as the operator resolves them (in-cluster service account, else kubeconfig). Exit 0 on success; 1
with one line saying what is left and what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Mapping

import yaml

from .shell.kube import ApiError, Credentials, Kube, path

CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
CRD_MANAGER = "pdstack-chart"  # field manager of the hook's apply (Helm's own create was "helm")
POLL_S = 1.0


async def apply_crd(kube: Kube, crd: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply ``crd`` (force: the chart owns its schema; conflicts with Helm's first create are taken)."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"kind={crd.get('kind')!r}; accepted: a CustomResourceDefinition")
    return await kube.request("PATCH", f"{CRD_API}/{crd['metadata']['name']}", body=dict(crd),
                              query={"fieldManager": CRD_MANAGER, "force": "true"},
                              content_type="application/apply-patch+yaml")


async def delete_pddeployments(kube: Kube, namespaces: list[str], selector: str, timeout_s: float) -> list[str]:
    """Delete every PDDeployment matching ``selector`` in ``namespaces``; wait until none is left. Returns what is
    still there at the deadline (``ns/name (finalizers)``), empty on success."""
    for ns in namespaces:
        for pdd in await kube.list(path("pdstack.io/v1alpha1", "PDDeployment", ns), label_selector=selector):
            await kube.delete(path("pdstack.io/v1alpha1", "PDDeployment", ns, pdd["metadata"]["name"]))
            print(f"deleted PDDeployment {ns}/{pdd['metadata']['name']}", flush=True)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [f"{ns}/{p['metadata']['name']} (finalizers {p['metadata'].get('finalizers') or []})"
                for ns in namespaces
                for p in await kube.list(path("pdstack.io/v1alpha1", "PDDeployment", ns), label_selector=selector)]
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(POLL_S)


async def _main(args: argparse.Namespace) -> int:
    kube = Kube(await Credentials.load())
    try:
        if args.command == "apply-crd":
            with open(args.file) as fh:  # noqa: ASYNC230 - one small file before the first request
                crd = yaml.safe_load(fh)
            out = await apply_crd(kube, crd)
            versions = [v["name"] for v in out.get("spec", {}).get("versions", [])] if out else []
            print(f"applied CustomResourceDefinition {crd['metadata']['name']} (versions {versions})", flush=True)
            return 0
        left = await delete_pddeployments(kube, args.namespace, args.selector, args.timeout)
        if left:
            print(f"still there after {args.timeout:g}s: {', '.join(left)}; is the operator running? (its finalizer "
                  "is released by the operator; `kubectl pd` / docs/install.md, 'Uninstalling')", file=sys.stderr)
            return 1
        print("no PDDeployment of the release is left", flush=True)
        return 0
    except ApiError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    finally:
        await kube.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdoperator.hooks", description="pdstack chart hooks")
    sub = parser.add_subparsers(dest="command", required=True)
    crd = sub.add_parser("apply-crd", help="server-side apply a CRD file (pre-install, pre-upgrade)")
    crd.add_argument("file")
    rm = sub.add_parser("delete-pddeployments", help="delete the release's PDDeployments and wait (pre-delete)")
    rm.add_argument("-n", "--namespace", action="append", required=True, help="repeatable")
    rm.add_argument("-l", "--selector", required=True, help="label selector of the release's PDDeployments")
    rm.add_argument("--timeout", type=float, default=300.0, help="seconds to wait until they are gone")
    return parser


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
