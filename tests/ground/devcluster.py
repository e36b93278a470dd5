"""`make dev-cluster`: the test ground in the foreground for trying things by hand.

Starts the control plane, the node agent and (when tests/ground/s3.py is present) the S3 server, prints how
to reach them, and tears everything down on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.ground.kube import start_kube_cluster
from tests.ground.node_agent import start_node_agent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.ground.devcluster", description=__doc__)
    parser.add_argument(
        "--workdir", type=Path, help="keep state here (default: a temporary folder, removed on exit)"
    )
    parser.add_argument(
        "--image",
        action="append",
        dest="images",
        metavar="GLOB",
        help="images whose containers run their command as written (repeatable; default: every image)",
    )
    parser.add_argument("--no-s3", action="store_true", help="do not start the S3 server")
    return parser.parse_args(argv)


def _s3_context(workdir: Path):
    try:
        from tests.ground.s3 import start_s3_server
    except ImportError as exc:
        print(f"[dev-cluster] no S3 server: {exc}", file=sys.stderr)
        return contextlib.nullcontext(None)
    return start_s3_server(workdir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("dev-cluster needs root (the node agent makes network and mount namespaces)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hsx-dev-")))
        else:
            workdir = args.workdir.resolve()
        print(f"[dev-cluster] starting in {workdir} ...", flush=True)
        cluster = stack.enter_context(start_kube_cluster(workdir / "kube"))
        agent = stack.enter_context(start_node_agent(cluster, workdir / "node"))
        for pattern in args.images or ["*"]:
            agent.register_image(pattern)
        s3 = None if args.no_s3 else stack.enter_context(_s3_context(workdir / "s3"))
        print(f"[dev-cluster] ready in {time.monotonic() - started:.1f}s", flush=True)
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  API server:  {cluster.server}  (admin: user hsx-admin, group system:masters)")
        print(
            f"  node:        {agent.node_name}  (8 nvidia.com/gpu; pods get 10.244.{agent.net.slot}.0/24 addresses)"
        )
        print(f"  images run as written: {', '.join(args.images or ['*'])}")
        if s3 is not None:
            port = int(s3.endpoint.rsplit(":", 1)[1])
            print(f"  S3 endpoint: {s3.endpoint}  (from pods: http://{agent.forward_host_port(port)})")
            print(f"  S3 access key: {s3.access_key}  secret key: {s3.secret_key}  region: {s3.region}")
        print(f"  logs:        {workdir / 'kube' / 'logs'}  and  {agent.workdir / 'logs'}")
        print("[dev-cluster] Ctrl-C stops everything.", flush=True)
        while not stop.wait(1.0):
            cluster.check_alive()
        print("[dev-cluster] stopping ...", flush=True)
    print("[dev-cluster] stopped; nothing left running.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
