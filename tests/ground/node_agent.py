"""A test-only kubelet: one Node whose pods run as local processes, each pod in its own netns + mount namespaces.

It registers the Node (8 `nvidia.com/gpu`), keeps its Lease fresh, watches the pods bound to it and runs their
containers: init containers in order, native sidecars (init containers with restartPolicy Always) gated on
their startup probe, then the main containers; probes, restarts with back-off, graceful deletion. Images map
to local commands through `register_image`; an unregistered image waits in ErrImagePull/ImagePullBackOff.
Servers bind only inside pod network namespaces; the API server is reached from pods through a forwarder on
the pod bridge's host address.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.ground import podnet
from tests.ground.kubelet_api import KubeletLogServer
from tests.ground.pod_worker import Container, PodWorker, run_quiet
from tests.ground.podspec import (
    PodSpecError,
    ProbeSpec,
    configmap_data,
    decoded_secret_data,
    now_rfc3339,
    pod_status,
    resolve_port,
)
from tests.ground.procs import tail
from tests.ground.rest import MERGE_PATCH, ApiError, KubeRest

if TYPE_CHECKING:
    from tests.ground.kube import KubeCluster

log = logging.getLogger("hsx.node_agent")

NODE_NAME = "hsx-test-node"
# What a pod's command is for an image: argv, or None to run the container's command+args as written.
Rewrite = Callable[[dict, dict], list[str] | None]
STATE_MARK = "hsx-node-agent"  # in every path the agent mounts on the host: leftovers are found by it
# An 8-GPU node as clouds sell them (the pods' requests are bookkeeping here: processes share this machine).
_NODE_CAPACITY = {
    "cpu": "96",
    "memory": "1Ti",
    "pods": "110",
    "ephemeral-storage": "100Gi",
    "nvidia.com/gpu": "8",
}


def unmount_leftovers(slot: int) -> None:
    """Unmount every host mount an agent of this slot left (deepest first)."""
    mark = f"/{STATE_MARK}-{slot}-"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if mark in line.split()[1]]
    for point in sorted(points, key=len, reverse=True):
        run_quiet(["umount", "-l", point])


class TcpForwarder:
    """Relays TCP from an address on the pod bridge to a port on the host's 127.0.0.1."""

    def __init__(self, address: str, preferred_port: int, target_port: int):
        self._target = ("127.0.0.1", target_port)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((address, preferred_port))
        except OSError:
            self._sock.bind((address, 0))
        self.port = int(self._sock.getsockname()[1])
        self._sock.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, name=f"forward-{target_port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

        other = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        other.start()
        pump(client, upstream)
        other.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class HostDirs:
    """Mount points the agent had to create on the host; removed (if empty) when the agent closes."""

    def __init__(self) -> None:
        self._created: list[Path] = []
        self._lock = threading.Lock()

    def ensure(self, path: Path, is_file: bool) -> None:
        with self._lock:
            missing = [p for p in [path, *path.parents] if not p.exists()]
            for directory in reversed(missing[1:] if is_file else missing):
                directory.mkdir()
                self._created.append(directory)
            if is_file and not path.exists():
                path.touch()
                self._created.append(path)

    def remove_all(self) -> None:
        with self._lock:
            for path in reversed(self._created):
                with contextlib.suppress(OSError):
                    path.unlink() if path.is_file() else path.rmdir()
            self._created.clear()


class NodeAgent:
    """The test node. `start()` registers it and runs pods; `stop()` is node death; `close()` cleans up."""

    def __init__(
        self,
        cluster: KubeCluster,
        workdir: Path,
        node_name: str = NODE_NAME,
        *,
        retry_s: float = 1.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 10.0,
    ):
        self.cluster = cluster
        self.node_name = node_name
        self.slot = podnet.SlotClaim()
        self.net = self.slot.network
        unmount_leftovers(self.net.slot)
        self.net.remove_leftovers()
        self.workdir = workdir / f"{STATE_MARK}-{self.net.slot}-{uuid.uuid4().hex[:6]}"
        self.workdir.mkdir(parents=True)
        self.retry_s = retry_s
        self._backoff = (backoff_base_s, backoff_max_s)
        pair = cluster.ca.issue(f"system:node:{node_name}", ["system:nodes"])
        cert, key = self.workdir / "node.crt", self.workdir / "node.key"
        cert.write_bytes(pair.cert_pem)
        key.write_bytes(pair.key_pem)
        key.chmod(0o600)
        self.api = KubeRest(cluster.server, cluster.ca_path, cert, key)
        self._images: list[tuple[str, Rewrite]] = []
        self._lock = threading.RLock()
        self._workers: dict[str, PodWorker] = {}
        self._lost: dict[str, dict[str, int]] = {}  # uid -> restart counts, for pods alive at node death
        self._ips: dict[str, str] = {}
        self.host_dirs = HostDirs()
        self.probe_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self.closing = False
        self._running = False
        self._threads: list[threading.Thread] = []
        self._forwarder: TcpForwarder | None = None
        self._host_forwards: dict[int, TcpForwarder] = {}
        self._kubelet_api: KubeletLogServer | None = None

    # ---- public API for tests ----------------------------------------------------------------------------
    def register_image(self, pattern: str, rewrite: Rewrite | None = None) -> None:
        """Containers whose image matches the fnmatch `pattern` run `rewrite(container, pod)` (None: as written)."""
        with self._lock:
            self._images.insert(0, (pattern, rewrite or (lambda container, pod: None)))

    def unregister_image(self, pattern: str) -> None:
        with self._lock:
            self._images = [(p, r) for p, r in self._images if p != pattern]

    def logs(self, namespace: str, pod: str, container: str) -> str:
        """Everything the container wrote to stdout/stderr (all its runs), '' when it never ran."""
        path = self.workdir / "logs" / namespace / pod / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _log_source(self, namespace: str, pod: str, container: str) -> tuple[Path, Callable[[], bool]] | None:
        path = self.workdir / "logs" / namespace / pod / f"{container}.log"
        try:
            worker = self._worker_for(namespace, pod)
        except KeyError:  # a finished pod's log stays readable, as on a kubelet
            return (path, lambda: False) if path.exists() else None
        found = next((c for c in worker.containers() if c.name == container), None)
        if found is None:
            return None
        return path, lambda: found.running and not worker.finished.is_set()

    def kill_container(self, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the container's processes (a crash or OOM kill from the pod's point of view)."""
        self._worker_for(namespace, pod).kill(container, sig)

    def pod_ip(self, namespace: str, pod: str) -> str | None:
        return self._worker_for(namespace, pod).pod_ip

    @property
    def running(self) -> bool:
        return self._running

    def forward_host_port(self, port: int) -> str:
        """`host:port` at which pods reach a server listening on the host's 127.0.0.1:`port` (e.g. S3)."""
        with self._lock:
            if port not in self._host_forwards:
                self.net.ensure_bridge()
                self._host_forwards[port] = TcpForwarder(self.net.gateway, port, port)
            return f"{self.net.gateway}:{self._host_forwards[port].port}"

    def start(self) -> None:
        """Register the node (Ready), renew its Lease, run the pods bound to it."""
        if self._running:
            return
        self.net.ensure_bridge()
        if self._forwarder is None:
            self._forwarder = TcpForwarder(self.net.gateway, 443, self.cluster.port)
        if self._kubelet_api is None:  # `kubectl logs`, through the API server as with a kubelet
            serving = self.cluster.ca.issue(
                f"system:node:{self.node_name}", ["system:nodes"], ip_addresses=[self.net.gateway], server=True
            )
            crt, key = self.workdir / "kubelet.crt", self.workdir / "kubelet.key"
            crt.write_bytes(serving.cert_pem)
            key.write_bytes(serving.key_pem)
            key.chmod(0o600)
            self._kubelet_api = KubeletLogServer(self.net.gateway, crt, key, self.cluster.ca_path, self._log_source)
        self._register_node()
        self._running = True
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="node-heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="node-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Node death: heartbeats stop, every container is killed, nothing more is reported."""
        if not self._running:
            return
        self._running = False
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.node_died = True
            worker.wake.set()
        for worker in workers:
            worker.finished.wait(30)
            if worker.terminal_phase is None:
                self._lost[worker.uid] = {c.name: c.status.restart_count for c in worker.containers()}
        for thread in self._threads:
            thread.join(timeout=30)

    def close(self) -> None:
        """Stop and remove everything the agent made on the host."""
        self.stop()
        self.closing = True
        self.probe_pool.shutdown(wait=False, cancel_futures=True)
        for forwarder in [self._forwarder, *self._host_forwards.values()]:
            if forwarder is not None:
                forwarder.close()
        if self._kubelet_api is not None:
            self._kubelet_api.close()
        if not self.slot.others_alive():  # another agent's pods may use the same mount points
            self.host_dirs.remove_all()
        unmount_leftovers(self.net.slot)
        self.net.remove_leftovers()
        self.slot.close()

    # ---- used by pod workers -----------------------------------------------------------------------------
    def image_rewrite(self, image: str) -> Rewrite | None:
        with self._lock:
            for pattern, rewrite in self._images:
                if fnmatch.fnmatchcase(image, pattern):
                    return rewrite
        return None

    def backoff_s(self, restarts: int) -> float:
        base, most = self._backoff
        return float(min(most, base * 2**restarts))

    def base_env(self, pod_name: str) -> dict[str, str]:
        assert self._forwarder is not None
        port = str(self._forwarder.port)
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": "/root",
            "HOSTNAME": pod_name,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "KUBERNETES_SERVICE_HOST": self.net.gateway,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{self.net.gateway}:{port}",
        }

    def allocate_ip(self, uid: str) -> str:
        with self._lock:
            if uid in self._ips:
                return self._ips[uid]
            used = set(self._ips.values())
            for address in self.net.pod_addresses():
                if address not in used:
                    self._ips[uid] = address
                    return address
        raise PodSpecError("ContainerCreating", "pod network exhausted")

    def release_ip(self, uid: str) -> None:
        with self._lock:
            self._ips.pop(uid, None)

    def _get_authorized(self, path: str) -> dict | None:
        """GET with a short retry on 403: the Node authorizer learns a new pod's references asynchronously."""
        deadline = time.monotonic() + 5.0
        while True:
            try:
                return self.api.get(path)
            except ApiError as exc:
                if exc.status == 404:
                    return None
                if exc.status != 403 or time.monotonic() > deadline:
                    raise PodSpecError("ContainerCreating", str(exc)) from exc
            time.sleep(0.2)

    def configmap(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get_authorized(f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        return None if obj is None else configmap_data(obj)

    def claimed_dir(self, namespace: str, claim: str) -> Path:
        """The node directory of the PersistentVolume bound to ``claim`` (hostPath or local PVs: the ground
        has no provisioner, an admin's static PVs are what it serves)."""
        pvc = self._get_authorized(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        if pvc is None:
            raise PodSpecError("ContainerCreating", f"persistentvolumeclaim {claim!r} not found")
        volume = (pvc.get("spec") or {}).get("volumeName")
        if not volume or (pvc.get("status") or {}).get("phase") != "Bound":
            raise PodSpecError("ContainerCreating", f"persistentvolumeclaim {claim!r} is not bound")
        pv = self._get_authorized(f"/api/v1/persistentvolumes/{volume}") or {}
        source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
        if not source:
            raise PodSpecError("ContainerCreating", f"persistentvolume {volume!r}: only hostPath and local are served")
        return Path(source["path"])

    def secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get_authorized(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        return None if obj is None else decoded_secret_data(obj)

    def service_account_token(self, pod: dict, audience: str | None, expiration_s: int | None) -> str:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": int(expiration_s or 3607),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        deadline = time.monotonic() + 5.0
        while True:
            try:
                return str(self.api.request("POST", path, body)["status"]["token"])
            except ApiError as exc:
                if exc.status != 403 or time.monotonic() > deadline:
                    raise PodSpecError("ContainerCreating", f"service account token: {exc}") from exc
            time.sleep(0.2)

    def patch_pod_status(self, namespace: str, name: str, status: dict) -> None:
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/status"
        self.api.request("PATCH", path, {"status": status}, content_type=MERGE_PATCH)

    def finalize_pod(self, namespace: str, name: str, uid: str) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        with contextlib.suppress(ApiError):
            self.api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)

    def run_probe(self, c: Container, spec: ProbeSpec, pod_ip: str) -> bool:
        action = spec.action
        if "httpGet" in action:
            get = action["httpGet"]
            import http.client

            host = get.get("host") or pod_ip
            port = resolve_port(get.get("port", 80), c.spec)
            conn_type = (
                http.client.HTTPSConnection if get.get("scheme") == "HTTPS" else http.client.HTTPConnection
            )
            kwargs: dict = {"timeout": spec.timeout_s}
            if conn_type is http.client.HTTPSConnection:
                import ssl

                kwargs["context"] = (
                    ssl._create_unverified_context()
                )  # kubelet does not verify probe certs either
            conn = conn_type(host, port, **kwargs)
            try:
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
                conn.request("GET", get.get("path", "/"), headers=headers)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if "tcpSocket" in action:
            port = resolve_port(action["tcpSocket"]["port"], c.spec)
            with socket.create_connection(
                (action["tcpSocket"].get("host") or pod_ip, port), timeout=spec.timeout_s
            ):
                return True
        if "exec" in action:
            if c.proc is None:
                return False
            as_user = c.identity.setpriv_argv() if c.identity is not None else []
            argv = ["nsenter", "-t", str(c.proc.pid), "-m", "-n", "-u", "--", *as_user, *action["exec"]["command"]]
            result = subprocess.run(argv, env=c.env, capture_output=True, timeout=spec.timeout_s)
            return result.returncode == 0
        raise PodSpecError(
            "CreateContainerConfigError", f"probe {sorted(action)} not supported by the test node"
        )

    # ---- node registration and heartbeats ----------------------------------------------------------------
    def _node_conditions(self) -> list[dict]:
        now = now_rfc3339()

        def condition(kind: str, status: str, reason: str, message: str) -> dict:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        return [
            condition("Ready", "True", "KubeletReady", "hsx test node agent is posting ready status"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "enough memory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "enough PIDs"),
        ]

    def _node_status(self) -> dict:
        return {
            "capacity": _NODE_CAPACITY,
            "allocatable": _NODE_CAPACITY,
            "conditions": self._node_conditions(),
            "addresses": [
                {"type": "InternalIP", "address": self.net.gateway},
                {"type": "Hostname", "address": self.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self._kubelet_api.port if self._kubelet_api else 10250}},
            "nodeInfo": {
                "machineID": "hsx-test",
                "systemUUID": "hsx-test",
                "bootID": uuid.uuid4().hex,
                "kernelVersion": os.uname().release,
                "osImage": "hsx test node",
                "containerRuntimeVersion": "hsx-test://1",
                "kubeletVersion": "v1.37.2",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "nvidia.com/gpu.present": "true",
                },
            },
            "spec": {"podCIDR": self.net.cidr, "podCIDRs": [self.net.cidr]},
        }
        with contextlib.suppress(ApiError):
            self.api.request("POST", "/api/v1/nodes", node)
        self._post_node_status()
        self._renew_lease()

    def _post_node_status(self) -> None:
        path = f"/api/v1/nodes/{self.node_name}/status"
        self.api.request("PATCH", path, {"status": self._node_status()}, content_type=MERGE_PATCH)

    def _renew_lease(self) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": 40, "renewTime": now}
        try:
            self.api.request("PATCH", path, {"spec": spec}, content_type=MERGE_PATCH)
        except ApiError as exc:
            if exc.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node_name},
            }
            self.api.request(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {**lease, "spec": spec},
            )

    def _heartbeat_loop(self) -> None:
        beats = 0
        while self._running:
            try:
                self._renew_lease()
                if beats % 5 == 0:
                    self._post_node_status()
            except Exception as exc:
                log.warning("node heartbeat: %s", exc)
            beats += 1
            time.sleep(1.0)

    # ---- pods --------------------------------------------------------------------------------------------
    def _worker_for(self, namespace: str, pod: str) -> PodWorker:
        with self._lock:
            for worker in self._workers.values():
                if worker.namespace == namespace and worker.pod_name == pod:
                    return worker
        raise KeyError(f"no pod {namespace}/{pod} is running on {self.node_name}")

    def _watch_loop(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        while self._running:
            try:
                listing = self.api.get("/api/v1/pods", fieldSelector=selector)
                self._sync(listing["items"])
                version = listing["metadata"]["resourceVersion"]
                while self._running:
                    for event in self.api.watch("/api/v1/pods", version, timeout_s=5, fieldSelector=selector):
                        if not self._running:
                            return
                        if event["type"] == "ERROR":
                            raise ApiError(int(event["object"].get("code", 500)), "WATCH", "pods", str(event))
                        if event["type"] == "BOOKMARK":
                            continue
                        pod = event["object"]
                        version = pod["metadata"]["resourceVersion"]
                        self._on_pod(pod, deleted=event["type"] == "DELETED")
            except Exception as exc:
                if self._running:
                    log.info("pod watch restarting: %s", exc)
                    time.sleep(0.5)

    def _sync(self, pods: list[dict]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            gone = [w for uid, w in self._workers.items() if uid not in present]
        for worker in gone:
            self._on_pod(worker.pod, deleted=True)
        for pod in pods:
            self._on_pod(pod, deleted=False)

    def _on_pod(self, pod: dict, deleted: bool) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self._workers.get(uid)
            if deleted:
                self._workers.pop(uid, None)
                self._lost.pop(uid, None)
                if worker is not None:
                    worker.vanished = True
                    worker.wake.set()
                return
            if worker is not None:
                worker.update(pod)
                return
            meta, phase = pod["metadata"], pod.get("status", {}).get("phase")
            if uid in self._lost and pod["spec"].get("restartPolicy", "Always") == "Never":
                self._lost.pop(uid)
                self._report_lost(pod)
                if meta.get("deletionTimestamp"):
                    self.finalize_pod(meta["namespace"], meta["name"], uid)
                return
            if phase in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):
                    self.finalize_pod(meta["namespace"], meta["name"], uid)
                return
            if meta.get("deletionTimestamp") and uid in self._lost:
                self._lost.pop(uid)
                self.finalize_pod(meta["namespace"], meta["name"], uid)
                return
            worker = PodWorker(self, pod, self._lost.pop(uid, None))
            self._workers[uid] = worker
        worker.update(pod)
        worker.start()

    def _report_lost(self, pod: dict) -> None:
        """A restartPolicy Never pod whose processes died with the node: Failed, as after a node reboot."""
        worker = PodWorker(self, pod)
        for c in worker.containers():
            c.status.state, c.status.exit_code = "terminated", 137
            c.status.reason = "ContainerStatusUnknown"
            c.status.message = "The container could not be located when the pod was terminated"
            c.status.finished_at = now_rfc3339()
        worker.terminal_phase = "Failed"
        worker.initialized = True
        status = pod_status(worker.view(), [c.role == "sidecar" for c in worker.init])
        with contextlib.suppress(ApiError):
            self.patch_pod_status(worker.namespace, worker.pod_name, status)

    def log_tails(self, lines: int = 20) -> str:
        parts = []
        for path in sorted((self.workdir / "logs").rglob("*.log")):
            parts.append(f"--- {path.relative_to(self.workdir / 'logs')} ---\n{tail(path, lines)}")
        return "\n".join(parts)


@contextlib.contextmanager
def start_node_agent(
    cluster: KubeCluster, workdir: Path | None = None, **options: object
) -> Iterator[NodeAgent]:
    """A running node agent; on exit every process, netns, veth and mount it made is gone."""
    own_dir = workdir is None
    # Outside /tmp: a pod that mounts an emptyDir at /tmp must not hide its other volumes' sources.
    root = Path(tempfile.mkdtemp(prefix="hsx-node-", dir="/var/tmp")) if workdir is None else workdir
    agent = NodeAgent(cluster, root, **options)  # type: ignore[arg-type]
    try:
        agent.start()
        yield agent
    finally:
        agent.close()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def node_agent(kube_cluster: KubeCluster) -> Iterator[NodeAgent]:
    """The session's test node (`hsx-test-node`, 8 nvidia.com/gpu). Needs root (netns, mounts)."""
    if os.geteuid() != 0:
        pytest.skip("the node agent needs root (network and mount namespaces)")
    with start_node_agent(kube_cluster) as agent:
        yield agent
