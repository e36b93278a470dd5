"""`make dev-cluster`: the test ground in the foreground for trying things by hand.

Starts the control plane, the node agent and (when tests/ground/s3.py is present) the S3 server, prints how
to reach them, and tears everything down on Ctrl-C or SIGTERM. hsx's images run from this checkout
(tests/ground/images.py: the server image is the CPU reference server); with S3 it also prepares a tiny model,
a dataset, a bucket and an ExtractionJob, and prints the commands that install the chart and run it
(docs/guide.md, "Try it on the dev cluster").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.ground.images import register_hsx_images
from tests.ground.kube import start_kube_cluster
from tests.ground.node_agent import start_node_agent
from tests.ground.tools import tool_path

REPO = Path(__file__).resolve().parents[2]
TRY_NAMESPACE = "hsx-try"
TRY_BUCKET = "hsx-try"


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
        help="images whose containers run their command as written (repeatable; default: every image but hsx's)",
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


def prepare_try(try_dir: Path, s3: Any, pod_endpoint: str) -> Path:
    """A tiny model, the bundled dataset beside it, a bucket and the manifest of one run; the manifest's path."""
    from hsx_extractor.tools.tinymodel import build_tiny_model, example_dataset_path

    build_tiny_model(try_dir / "tiny")
    shutil.copy(example_dataset_path(), try_dir / "chat.jsonl")
    for path in [try_dir, *try_dir.rglob("*")]:  # the extractor runs as uid 65532
        path.chmod(0o755 if path.is_dir() else 0o644)
    s3.create_bucket(TRY_BUCKET)
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TRY_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hsx-s3-credentials", "namespace": TRY_NAMESPACE},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
        },
        {
            "apiVersion": "hsx.dev/v1alpha1",
            "kind": "ExtractionJob",
            "metadata": {"name": "tiny", "namespace": TRY_NAMESPACE},
            "spec": {
                "runId": "r1",
                "model": {"path": "/models/tiny", "source": {"hostPath": {"path": str(try_dir)}}},
                "server": {"gpus": 1},
                "dataset": {"uri": "/models/chat.jsonl"},
                "output": {
                    "uri": f"s3://{TRY_BUCKET}/tiny",
                    "endpoint": pod_endpoint,
                    "region": s3.region,
                    "pathStyle": True,
                    "credentialsSecret": "hsx-s3-credentials",
                    "shardTargetBytes": 1 << 20,
                },
            },
        },
    ]
    manifest = try_dir / "extractionjob.yaml"
    manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return manifest


def try_commands(kubeconfig: Path, try_dir: Path, manifest: Path) -> list[str]:
    """The guide's steps with this cluster's paths filled in, one shell command each."""
    tools = [str(tool_path("helm").parent), str(tool_path("kubectl").parent)]
    return [
        f"export KUBECONFIG={kubeconfig} PATH={':'.join(dict.fromkeys(tools))}:$PATH",
        f"cd {shlex.quote(str(REPO))}",
        "helm install hsx charts/hsx -n hsx-system --create-namespace"
        f" --set 'policy.allowedHostPaths={{{try_dir}}}' --wait",
        f"kubectl apply -f {manifest}",
        f"kubectl wait -n {TRY_NAMESPACE} xj/tiny --for=jsonpath='{{.status.phase}}'=Succeeded --timeout=600s",
        f"kubectl get xj -n {TRY_NAMESPACE}",
    ]


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
            workdir.chmod(0o755)  # mkdtemp's 0700 would lock the pods' non-root users out
        else:
            workdir = args.workdir.resolve()
        print(f"[dev-cluster] starting in {workdir} ...", flush=True)
        cluster = stack.enter_context(start_kube_cluster(workdir / "kube"))
        agent = stack.enter_context(start_node_agent(cluster, workdir / "node"))
        for pattern in args.images or ["*"]:
            agent.register_image(pattern)
        register_hsx_images(agent)
        s3 = None if args.no_s3 else stack.enter_context(_s3_context(workdir / "s3"))
        steps: list[str] = []
        if s3 is not None:
            pod_endpoint = f"http://{agent.forward_host_port(int(s3.endpoint.rsplit(':', 1)[1]))}"
            try_dir = workdir / "try"
            manifest = prepare_try(try_dir, s3, pod_endpoint)
            steps = try_commands(cluster.kubeconfig, try_dir, manifest)
        print(f"[dev-cluster] ready in {time.monotonic() - started:.1f}s", flush=True)
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  API server:  {cluster.server}  (admin: user hsx-admin, group system:masters)")
        print(
            f"  node:        {agent.node_name}  (8 nvidia.com/gpu; pods get 10.244.{agent.net.slot}.0/24 addresses)"
        )
        print(f"  images run as written: {', '.join(args.images or ['*'])}; hsx's from this checkout")
        if s3 is not None:
            port = int(s3.endpoint.rsplit(":", 1)[1])
            print(f"  S3 endpoint: {s3.endpoint}  (from pods: http://{agent.forward_host_port(port)})")
            print(f"  S3 access key: {s3.access_key}  secret key: {s3.secret_key}  region: {s3.region}")
        print(f"  logs:        {workdir / 'kube' / 'logs'}  and  {agent.workdir / 'logs'}")
        if steps:
            print("  try an extraction (docs/guide.md, 'Try it on the dev cluster'), in another shell:")
            for step in steps:
                print(f"    $ {step}")
        print("[dev-cluster] Ctrl-C stops everything.", flush=True)
        while not stop.wait(1.0):
            cluster.check_alive()
        print("[dev-cluster] stopping ...", flush=True)
    print("[dev-cluster] stopped; nothing left running.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
