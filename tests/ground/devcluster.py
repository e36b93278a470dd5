"""`make dev-cluster`: the test ground in the foreground for trying things by hand.

Starts the control plane, the node agent and (when tests/ground/s3.py is present) the S3 server, prints how
to reach them, and tears everything down on Ctrl-C or SIGTERM. hsx's images run from this checkout
(tests/ground/images.py: the server image is the CPU reference server); with S3 it also prepares what the
README's quick start needs (a namespace, a PVC holding a tiny model and a dataset, a bucket) and prints the
quick start's commands with this cluster's values (docs/guide.md, "Try it on the dev cluster").
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

from tests.ground.images import REGISTRY, register_hsx_images
from tests.ground.kube import start_kube_cluster
from tests.ground.node_agent import start_node_agent
from tests.ground.tools import tool_path

REPO = Path(__file__).resolve().parents[2]
TRY_NAMESPACE = "hsx-try"
TRY_BUCKET = "hsx-try"
# The README line before the quick start's commands.
QUICKSTART_MARKER = "<!-- quickstart: tests/ground/test_ground_devcluster.py runs the next block verbatim -->"
# Where the running dev cluster says how to reach it, for helpers in other shells (`make dev-bucket`).
CURRENT = Path(os.environ.get("HSX_CACHE", Path.home() / ".cache" / "hsx")) / "dev-cluster.env"


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


def prepare_try(try_dir: Path, cluster: Any, s3: Any) -> None:
    """What the README's quick start needs before its first line: a tiny model and the bundled dataset on a
    PersistentVolume bound to PVC ``models`` in namespace hsx-try, and a bucket."""
    from hsx_extractor.tools.tinymodel import build_tiny_model, example_dataset_path

    build_tiny_model(try_dir / "tiny")
    shutil.copy(example_dataset_path(), try_dir / "chat.jsonl")
    for path in [try_dir, *try_dir.rglob("*")]:  # the extractor runs as uid 65532
        path.chmod(0o755 if path.is_dir() else 0o644)
    s3.create_bucket(TRY_BUCKET)
    claim = {"accessModes": ["ReadOnlyMany"], "storageClassName": ""}
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TRY_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": "hsx-try-models"},
            "spec": {
                **claim,
                "capacity": {"storage": "1Gi"},
                "hostPath": {"path": str(try_dir), "type": "Directory"},
                "claimRef": {"namespace": TRY_NAMESPACE, "name": "models"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": TRY_NAMESPACE},
            "spec": {**claim, "volumeName": "hsx-try-models", "resources": {"requests": {"storage": "1Gi"}}},
        },
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs, sort_keys=False))


def quickstart_variables(s3: Any, pod_endpoint: str) -> dict[str, str]:
    """The README quick start's variables, as this cluster fills them in."""
    return {
        "NS": TRY_NAMESPACE,
        "REGISTRY": REGISTRY,
        "BUCKET": TRY_BUCKET,
        "S3_ENDPOINT": pod_endpoint,
        "S3_REGION": s3.region,
        "S3_PATH_STYLE": "true",
        "MODEL_DIR": "tiny",
        "DATASET": "chat.jsonl",
    }


def quickstart_commands(readme: Path = REPO / "README.md") -> list[str]:
    """The commands of the README's quick start: the fenced block after its ``<!-- quickstart -->`` marker."""
    lines = readme.read_text().splitlines()
    start = lines.index(QUICKSTART_MARKER) + 1
    if not lines[start].startswith("```"):
        raise ValueError(f"README.md: a fenced block must follow {QUICKSTART_MARKER}")
    end = lines.index("```", start + 1)
    return [line for line in lines[start + 1 : end] if line.strip() and not line.lstrip().startswith("#")]


def try_commands(kubeconfig: Path, s3: Any, pod_endpoint: str) -> list[str]:
    """This cluster's variables and tools, then the README's quick start, one shell command each."""
    tools = [str(tool_path("helm").parent), str(tool_path("kubectl").parent), str(Path(sys.executable).parent)]
    settings = {**quickstart_variables(s3, pod_endpoint), **host_s3_env(s3)}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
    return [
        f"export KUBECONFIG={kubeconfig} PATH={':'.join(dict.fromkeys(tools))}:$PATH",
        f"export {exports}",
        f"cd {shlex.quote(str(REPO))}",
        *quickstart_commands(),
    ]


def host_s3_env(s3: Any) -> dict[str, str]:
    """The AWS_* environment of this host's view of the S3 server (boto3, the aws CLI, `hsx verify`)."""
    return {
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": s3.region,
        "AWS_ENDPOINT_URL": s3.endpoint,
    }


def env_lines(kubeconfig: Path, s3: Any, pod_endpoint: str | None) -> list[str]:
    """The environment that reaches this cluster and its S3 server from the host (boto3, the aws CLI and
    `hsx verify` read AWS_ENDPOINT_URL); HSX_DEV_S3_POD_ENDPOINT is what manifests name."""
    lines = [f"export KUBECONFIG={shlex.quote(str(kubeconfig))}"]
    if s3 is not None:
        lines += [f"export {k}={shlex.quote(v)}" for k, v in host_s3_env(s3).items()]
        lines += [f"export HSX_DEV_S3_POD_ENDPOINT={shlex.quote(pod_endpoint or '')}"]
    return lines


def make_bucket(name: str, env_file: Path = CURRENT) -> int:
    """`make dev-bucket NAME=...`: a bucket on the running dev cluster's S3 server."""
    if not env_file.exists():
        print(f"no dev cluster is running ({env_file} is missing): start one with `make dev-cluster`", file=sys.stderr)
        return 2
    env = dict(
        line.removeprefix("export ").split("=", 1) for line in env_file.read_text().splitlines() if "=" in line
    )
    env = {k: shlex.split(v)[0] if v else "" for k, v in env.items()}
    if not env.get("AWS_ENDPOINT_URL"):
        print("the running dev cluster has no S3 server (started with --no-s3)", file=sys.stderr)
        return 2
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=name)
    print(f"bucket {name} made: s3://{name}/ (output.endpoint {env['HSX_DEV_S3_POD_ENDPOINT']} in a manifest)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bucket"]:
        if len(argv) != 2 or not argv[1]:
            print("usage: make dev-bucket NAME=<bucket>", file=sys.stderr)
            return 2
        return make_bucket(argv[1])
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
        pod_endpoint = None
        if s3 is not None:
            pod_endpoint = f"http://{agent.forward_host_port(int(s3.endpoint.rsplit(':', 1)[1]))}"
            prepare_try(workdir / "try", cluster, s3)
            steps = try_commands(cluster.kubeconfig, s3, pod_endpoint)
        env_file, pid_file = workdir / "dev-cluster.env", workdir / "dev-cluster.pid"
        env_file.write_text("\n".join(env_lines(cluster.kubeconfig, s3, pod_endpoint)) + "\n")
        pid_file.write_text(f"{os.getpid()}\n")
        CURRENT.parent.mkdir(parents=True, exist_ok=True)
        CURRENT.write_text(env_file.read_text())
        stack.callback(lambda: CURRENT.unlink(missing_ok=True))
        print(f"[dev-cluster] ready in {time.monotonic() - started:.1f}s", flush=True)
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  source {env_file}   # KUBECONFIG and, with S3, the AWS_* variables of this host's view")
        print(f"  API server:  {cluster.server}  (admin: user hsx-admin, group system:masters)")
        print(
            f"  node:        {agent.node_name}  (8 nvidia.com/gpu; pods get 10.244.{agent.net.slot}.0/24 addresses)"
        )
        print(f"  images run as written: {', '.join(args.images or ['*'])}; hsx's from this checkout")
        if s3 is not None:
            print(f"  S3 endpoint: {s3.endpoint}  (this host: aws CLI, boto3, hsx verify)")
            print(f"  S3 endpoint for manifests: {pod_endpoint}  (output.endpoint / dataset.endpoint: pods reach it)")
            print(f"  S3 access key: {s3.access_key}  secret key: {s3.secret_key}  region: {s3.region}")
            print(f"  buckets:     {TRY_BUCKET} exists; another: make dev-bucket NAME=<bucket>")
        print(f"  logs:        kubectl logs -n NAMESPACE POD -c CONTAINER; files in {workdir / 'kube' / 'logs'}"
              f" and {agent.workdir / 'logs'}")  # fmt: skip
        print(f"  stop:        Ctrl-C here, or kill -TERM $(cat {pid_file})  (this process, not make's)")
        if steps:
            print("  try an extraction: the README's quick start with this cluster's values, in another shell:")
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
