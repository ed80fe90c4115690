"""``python -m pdoperator``: run the operator.

    python -m pdoperator                          # the namespace it runs in ($POD_NAMESPACE, else "default")
    python -m pdoperator -n serving -n batch      # only these namespaces (a Role in each)
    python -m pdoperator --all-namespaces         # cluster-wide (a ClusterRole)
    python -m pdoperator --priority 100           # HA: replicas peer; the highest priority acts

One replica runs standalone (no peering) unless ``--priority`` or ``--peering`` is given. High
availability uses kopf peering: every replica writes a heartbeat to the peering object, which must
exist (the chart creates it for ``operator.replicas > 1``: kopf pauses until it can read it); a
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

PEERING_NAME = "pdstack-operator"  # the chart's KopfPeering / ClusterKopfPeering (templates/peering.yaml)
log = logging.getLogger("pdoperator")


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
    parser.add_argument("--standalone", action="store_true",
                        help="no peering: the default unless --priority or --peering is given")
    parser.add_argument("--peering", default=None,
                        help=f"HA: peer through this kopf peering object (default {PEERING_NAME!r} once --priority is "
                             "given); it must exist: the operator pauses until it can read it")
    parser.add_argument("--priority", type=_priority, default=None,
                        help="HA: peering priority; give replicas distinct values (the highest acts); 'auto': derived "
                             "from $POD_NAME (what the chart passes to each replica of a Deployment)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.all_namespaces and args.namespace:
        parser.error("--all-namespaces and --namespace exclude each other")
    peered = args.peering is not None or args.priority is not None
    if args.standalone and peered:
        parser.error("--standalone excludes --peering and --priority (those turn HA peering on)")
    namespaces = args.namespace or ([] if args.all_namespaces else [os.environ.get("POD_NAMESPACE") or "default"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from .shell import handlers  # noqa: F401  (registers the handlers)

    # Standalone unless asked for HA: kopf's named peering is mandatory, and without its object kopf pauses
    # every handler, silently, until the object appears (the chart creates it only for replicas > 1).
    peering = {"peering_name": args.peering or PEERING_NAME, "priority": args.priority or 0} if peered else {}
    if peered:
        kind = "ClusterKopfPeering" if args.all_namespaces else "KopfPeering"
        where = "" if args.all_namespaces else f" in {', '.join(namespaces)}"
        log.info("HA peering through %s %s%s, priority %d: paused until that object exists (the chart creates it "
                 "for operator.replicas > 1)", kind, peering["peering_name"], where, peering["priority"])
    else:
        log.info("standalone: one replica, no peering (--priority N turns HA peering on)")
    kopf.run(clusterwide=args.all_namespaces, namespaces=namespaces, standalone=not peered,
             liveness_endpoint=args.liveness or None, **peering)


if __name__ == "__main__":
    main()
