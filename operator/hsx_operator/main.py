"""``hsx-operator``: run the ExtractionJob operator (kopf) against the current kubeconfig or in-cluster."""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import socket
import sys
from typing import Any, cast

import kopf
from prometheus_client import start_http_server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument("--metrics-port", type=int, default=9090, help="port of /metrics (0: off)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address /metrics binds to")
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="use kopf peering NAME (needs crds/kopf-peering.yaml) so only one replica is active; default: standalone",
    )
    parser.add_argument(
        "--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz"
    )
    parser.add_argument(
        "--allow-host-path",
        metavar="PREFIX",
        action="append",
        default=[],
        help="let ExtractionJobs mount host paths at or under PREFIX (repeatable; none by default)",
    )
    parser.add_argument(
        "--allow-priority-class",
        metavar="NAME",
        action="append",
        default=[],
        help="let ExtractionJobs use the system-* priority class NAME (repeatable; none by default)",
    )
    parser.add_argument(
        "--allow-image-prefix",
        metavar="PREFIX",
        action="append",
        default=[],
        help="run only images under PREFIX (registry/repository, repeatable; default: any image)",
    )
    parser.add_argument(
        "--cluster-defaults",
        metavar="JSON",
        default="{}",
        help="what every ExtractionJob gets where its spec is silent (the chart's clusterDefaults; cluster_defaults.py)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # log_prefix: every line about an object starts with its [namespace/name] (kopf's default omits it).
    kopf.configure(verbose=args.verbose, log_prefix=True)
    if not args.verbose:
        # One line per timer tick is noise; handler failures are logged as warnings and errors.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from hsx_operator import handlers  # registers the handlers
    from hsx_operator.cluster_defaults import ClusterDefaults
    from hsx_operator.policy import NodeAccessPolicy

    try:
        handlers.POLICY = NodeAccessPolicy.of(args.allow_host_path, args.allow_priority_class, args.allow_image_prefix)
        handlers.CLUSTER_DEFAULTS = ClusterDefaults.from_json(args.cluster_defaults)
    except ValueError as exc:
        build_parser().error(str(exc))

    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host)
    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering,
        # Replicas need distinct priorities: kopf pauses the lower ones and lets the highest work.
        priority=random.randint(1, 1_000_000) if args.peering else None,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        identity=cast(Any, peering_identity()),  # kopf's Identity is a NewType of str, not exported
    )
    return 0


def peering_identity() -> str:
    """This replica's name among its peers: the pod's name (POD_ID, as the chart sets it), else host and
    process. kopf's own fallback asks the passwd database for the user, and a pod's runAsUser (65532
    in the chart) need not be in the image's: the operator crashed at start."""
    pod = os.environ.get("POD_ID")
    return pod or f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


if __name__ == "__main__":
    sys.exit(main())
