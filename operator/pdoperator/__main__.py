"""``python -m pdoperator``: run the operator.

    python -m pdoperator                          # the namespace it runs in ($POD_NAMESPACE, else "default")
    python -m pdoperator -n serving -n batch      # only these namespaces (a Role in each)
    python -m pdoperator --all-namespaces         # cluster-wide (a ClusterRole)
    python -m pdoperator --priority 100           # HA: replicas peer; the highest priority acts

High availability uses kopf peering: every replica writes a heartbeat to the peering object; a
replica pauses while a live peer has a higher priority. Give each replica a distinct priority
(the chart gives each replica its own); a dead active replica's heartbeat goes stale after
``PDSTACK_OPERATOR_PEERING_LIFETIME_S`` (default 15 s) and the next one resumes (docs/operator.md).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os

import kopf


def _priority(value: str) -> int:
    """``--priority``: an integer, or ``auto`` = a stable 31-bit number from ``$POD_NAME`` (distinct per pod)."""
    if value != "auto":
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer; accepted: an integer or 'auto'") from None
    pod = os.environ.get("POD_NAME")
    if not pod:
        raise argparse.ArgumentTypeError("'auto' needs $POD_NAME (the downward API's metadata.name); "
                                         "accepted: an integer, or 'auto' with POD_NAME set")
    return int.from_bytes(hashlib.sha256(pod.encode()).digest()[:4], "big") >> 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdoperator", description="pdstack PDDeployment operator")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch this namespace (repeatable); default: $POD_NAMESPACE, else 'default'")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (ClusterRole)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    parser.add_argument("--peering", default="pdstack-operator", help="peering object name (HA)")
    parser.add_argument("--priority", type=_priority, default=0,
                        help="peering priority; give HA replicas distinct values (the highest acts); 'auto': derived "
                             "from $POD_NAME (what the chart passes to each replica of a Deployment)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.all_namespaces and args.namespace:
        parser.error("--all-namespaces and --namespace exclude each other")
    namespaces = args.namespace or ([] if args.all_namespaces else [os.environ.get("POD_NAMESPACE") or "default"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from .shell import handlers  # noqa: F401  (registers the handlers)

    peering = {} if args.standalone else {"peering_name": args.peering, "priority": args.priority}
    kopf.run(clusterwide=args.all_namespaces, namespaces=namespaces, standalone=args.standalone,
             liveness_endpoint=args.liveness or None, **peering)


if __name__ == "__main__":
    main()
