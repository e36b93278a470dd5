"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

Every run makes its own CA, serving certs, service-account keys and client identities, binds only 127.0.0.1
ports, and authorizes with Node,RBAC, so permission tests are real. Pytest plugin: session fixture
`kube_cluster`, function fixture `namespace`, and (from node_agent.py) session fixture `node_agent`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.request import urlopen

import pytest
import yaml

from tests.ground.pki import CertificateAuthority, KeyPair, new_private_key, private_key_pem, public_key_pem
from tests.ground.podnet import all_gateways
from tests.ground.procs import ManagedProcess, free_port, tail

SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# A dead node's pods are evicted after this many seconds (the real default is 300): keeps node-loss tests short.
NODE_LOSS_TOLERATION_S = 20
NODE_MONITOR_GRACE = "8s"
STARTUP_TIMEOUT_S = 120.0


def tool_path(name: str) -> Path:
    # Imported late: conftest registers tests.ground.tools as a plugin after this module.
    from tests.ground.tools import tool_path as resolve

    return resolve(name)


def kubeconfig_document(server: str, ca_pem: bytes, pair: KeyPair, user: str) -> dict:
    """A kubeconfig with inline credentials for one client-certificate identity."""
    import base64

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "hsx-test", "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(pair.cert_pem), "client-key-data": b64(pair.key_pem)},
            }
        ],
        "contexts": [{"name": "hsx-test", "context": {"cluster": "hsx-test", "user": user}}],
        "current-context": "hsx-test",
    }


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; str() includes what it printed."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


@dataclass
class KubeCluster:
    """A running control plane. Attributes are stable for the whole session."""

    workdir: Path
    server: str
    """https://127.0.0.1:<port> of kube-apiserver."""
    kubeconfig: Path
    """Admin kubeconfig (user `hsx-admin`, group `system:masters`)."""
    ca: CertificateAuthority
    ca_path: Path
    """The cluster CA certificate (PEM) that signed every serving and client cert."""
    components: list[ManagedProcess] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.server.rsplit(":", 1)[1])

    def user_kubeconfig(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig authenticating as `user` in `groups` by client certificate (no rights unless granted)."""
        pair = self.ca.issue(user, groups)
        path = self.workdir / "users" / f"{user.replace(':', '_')}-{uuid.uuid4().hex[:6]}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(kubeconfig_document(self.server, self.ca.cert_pem, pair, user)))
        return path

    def api_client(self, kubeconfig: Path | None = None):
        """A kubernetes.client.ApiClient for the admin (or the given kubeconfig's identity)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def wait_crd_established(self, name: str, timeout: float = 60.0) -> None:
        """Until the CRD is Established. ``kubectl wait`` fails at once (accessor error) while the
        new CRD has no conditions yet, which a loaded control plane shows for a moment."""
        deadline = time.monotonic() + timeout
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        while True:
            got = self.kubectl("get", f"crd/{name}", "-o", f"jsonpath={jsonpath}", check=False)
            if got.returncode == 0 and got.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {timeout:.0f}s: {got.stdout} {got.stderr}")
            time.sleep(0.2)

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl as the admin (or `kubeconfig`'s identity)."""
        argv = [str(tool_path("kubectl")), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every component's log, for failure reports."""
        parts = [f"--- {c.name} ({c.log_path}) ---\n{tail(c.log_path, lines)}" for c in self.components]
        return "\n".join(parts)

    def check_alive(self) -> None:
        """Raise with the log tail if a component has exited."""
        for component in self.components:
            if component.exit_code is not None:
                raise RuntimeError(component.describe_failure(f"exited with {component.exit_code}"))


def _https_ok(url: str, context: ssl.SSLContext) -> bool:
    with urlopen(url, context=context, timeout=5) as response:
        return bool(response.status == 200)


def _client_context(ca_path: Path, cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_path))
    context.load_cert_chain(str(cert), str(key))
    return context


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def _write_pair(directory: Path, stem: str, pair: KeyPair) -> tuple[Path, Path]:
    return _write(directory / f"{stem}.crt", pair.cert_pem), _write(directory / f"{stem}.key", pair.key_pem)


@contextlib.contextmanager
def start_kube_cluster(workdir: Path | None = None) -> Iterator[KubeCluster]:
    """Start etcd, kube-apiserver, kube-controller-manager and kube-scheduler; stop and clean up on exit."""
    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="hsx-kube-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    pki_dir, logs = root / "pki", root / "logs"
    ca = CertificateAuthority()
    ca_path = _write(pki_dir / "ca.crt", ca.cert_pem)
    sa_key = new_private_key()
    sa_key_path = _write(pki_dir / "sa.key", private_key_pem(sa_key))
    sa_pub_path = _write(pki_dir / "sa.pub", public_key_pem(sa_key))
    api_port, etcd_port, peer_port = free_port(), free_port(), free_port()
    server = f"https://127.0.0.1:{api_port}"

    serving = ca.issue(
        "kube-apiserver",
        dns_names=[
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ],
        ip_addresses=["127.0.0.1", SERVICE_IP, *all_gateways()],
        server=True,
    )
    serving_crt, serving_key = _write_pair(pki_dir, "apiserver", serving)
    # Components read the front-proxy CA from the API server; without one they log errors all session.
    front_proxy_ca_path = _write(
        pki_dir / "front-proxy-ca.crt", CertificateAuthority("hsx-front-proxy-ca").cert_pem
    )
    admin = ca.issue("hsx-admin", ["system:masters"])
    admin_crt, admin_key = _write_pair(pki_dir, "admin", admin)
    # How the API server reaches the node agent's kubelet API (`kubectl logs`), by its InternalIP.
    kubelet_client_crt, kubelet_client_key = _write_pair(
        pki_dir, "apiserver-kubelet-client", ca.issue("kube-apiserver-kubelet-client", ["system:masters"])
    )
    admin_kubeconfig = root / "admin.kubeconfig"
    admin_kubeconfig.write_text(yaml.safe_dump(kubeconfig_document(server, ca.cert_pem, admin, "hsx-admin")))

    def component_kubeconfig(user: str) -> Path:
        path = root / f"{user.split(':')[-1]}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig_document(server, ca.cert_pem, ca.issue(user), user)))
        return path

    cluster = KubeCluster(root, server, admin_kubeconfig, ca, ca_path)
    etcd = ManagedProcess(
        "etcd",
        [
            str(tool_path("etcd")),
            "--name=default",
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",  # throwaway data: durability buys nothing here
        ],
        logs / "etcd.log",
    )
    apiserver = ManagedProcess(
        "kube-apiserver",
        [
            str(tool_path("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--cert-dir={root / 'apiserver-certs'}",
            f"--tls-cert-file={serving_crt}",
            f"--tls-private-key-file={serving_key}",
            f"--client-ca-file={ca_path}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={sa_pub_path}",
            f"--service-account-signing-key-file={sa_key_path}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            # The `kubernetes` Endpoints cannot hold a loopback address; nothing here needs them.
            "--endpoint-reconciler-type=none",
            f"--default-not-ready-toleration-seconds={NODE_LOSS_TOLERATION_S}",
            f"--default-unreachable-toleration-seconds={NODE_LOSS_TOLERATION_S}",
            "--profiling=false",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={kubelet_client_crt}",
            f"--kubelet-client-key={kubelet_client_key}",
            f"--requestheader-client-ca-file={front_proxy_ca_path}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        ],
        logs / "kube-apiserver.log",
    )
    components = [etcd, apiserver]
    cluster.components = components
    try:
        etcd.start()
        etcd.wait_until(
            lambda: (
                json.load(urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=5)).get("health") == "true"
            ),
            STARTUP_TIMEOUT_S,
            "healthy",
        )
        apiserver.start()
        admin_context = _client_context(ca_path, admin_crt, admin_key)
        apiserver.wait_until(lambda: _https_ok(f"{server}/readyz", admin_context), STARTUP_TIMEOUT_S, "ready")

        kcm_port, scheduler_port = free_port(), free_port()
        kcm_kubeconfig = component_kubeconfig("system:kube-controller-manager")
        kcm_crt, kcm_key = _write_pair(
            pki_dir,
            "kcm-serving",
            ca.issue("kube-controller-manager", ip_addresses=["127.0.0.1"], server=True),
        )
        controller_manager = ManagedProcess(
            "kube-controller-manager",
            [
                str(tool_path("kube-controller-manager")),
                f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--tls-cert-file={kcm_crt}",
                f"--tls-private-key-file={kcm_key}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_key_path}",
                f"--root-ca-file={ca_path}",
                f"--cluster-signing-cert-file={ca_path}",
                f"--cluster-signing-key-file={_write(pki_dir / 'ca.key', ca.key_pem)}",
                f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
                "--node-monitor-period=1s",
                "--controllers=*",
            ],
            logs / "kube-controller-manager.log",
        )
        scheduler_kubeconfig = component_kubeconfig("system:kube-scheduler")
        scheduler_crt, scheduler_key = _write_pair(
            pki_dir, "scheduler-serving", ca.issue("kube-scheduler", ip_addresses=["127.0.0.1"], server=True)
        )
        scheduler = ManagedProcess(
            "kube-scheduler",
            [
                str(tool_path("kube-scheduler")),
                f"--kubeconfig={scheduler_kubeconfig}",
                f"--authentication-kubeconfig={scheduler_kubeconfig}",
                f"--authorization-kubeconfig={scheduler_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                f"--tls-cert-file={scheduler_crt}",
                f"--tls-private-key-file={scheduler_key}",
                "--leader-elect=false",
            ],
            logs / "kube-scheduler.log",
        )
        components += [controller_manager, scheduler]
        controller_manager.start()
        scheduler.start()
        component_context = ssl.create_default_context(cafile=str(ca_path))
        controller_manager.wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{kcm_port}/healthz", component_context),
            STARTUP_TIMEOUT_S,
            "healthy",
        )
        scheduler.wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{scheduler_port}/healthz", component_context),
            STARTUP_TIMEOUT_S,
            "healthy",
        )
        # Pods need the namespace's `default` ServiceAccount, which the controller manager creates.
        controller_manager.wait_until(
            lambda: (
                cluster.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode
                == 0
            ),
            STARTUP_TIMEOUT_S,
            "creating the default ServiceAccount",
        )
        yield cluster
    finally:
        for component in reversed(components):
            component.stop()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


def wait_for_default_service_account(cluster: KubeCluster, namespace: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.check_alive()
        if cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0:
            return
        time.sleep(0.3)
    raise RuntimeError(
        f"namespace {namespace}: no default ServiceAccount after {timeout_s:.0f}s\n{cluster.log_tails()}"
    )


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """The session's control plane (started once; logs under its workdir/logs)."""
    workdir = tmp_path_factory.mktemp("kube")
    try:
        with start_kube_cluster(workdir) as cluster:
            yield cluster
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount ready); deleted after the test."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube_cluster.kubectl("create", "namespace", name)
    wait_for_default_service_account(kube_cluster, name)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Attach the control plane's and the node's log tails to a failed test that used them."""
    report = yield
    used = getattr(item, "funcargs", {})
    cluster, agent = used.get("kube_cluster"), used.get("node_agent")
    if report.failed and isinstance(cluster, KubeCluster):
        report.sections.append(("control plane logs", cluster.log_tails()))
    agent_tails = getattr(agent, "log_tails", None)
    if report.failed and callable(agent_tails):
        report.sections.append(("node agent container logs", agent_tails()))
    return report


from tests.ground.node_agent import node_agent as node_agent  # noqa: E402  (registers the fixture)
