"""``python -m pdoperator``: run the operator (the same as ``kopf run -m pdoperator.handlers``).

    python -m pdoperator                      # all namespaces
    python -m pdoperator -n serving -n batch  # only these namespaces
"""

from __future__ import annotations

import argparse
import logging

import kopf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdoperator", description="pdstack PDDeployment operator")
    parser.add_argument("-n", "--namespace", action="append", default=[], help="watch only these namespaces")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.run(clusterwide=not args.namespace, namespaces=args.namespace, standalone=args.standalone,
             liveness_endpoint=args.liveness or None)


if __name__ == "__main__":
    main()
