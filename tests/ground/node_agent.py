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
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.ground import podnet
from tests.ground.podspec import (
    ContainerStatus,
    PodSpecError,
    PodView,
    ProbeSpec,
    VolumeFile,
    configmap_data,
    container_argv,
    container_env,
    decoded_secret_data,
    downward_files,
    exit_code_of,
    is_sidecar,
    key_files,
    now_rfc3339,
    parse_quantity,
    pod_status,
    resolve_port,
    should_restart,
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
_NODE_CAPACITY = {
    "cpu": "16",
    "memory": "128Gi",
    "pods": "110",
    "ephemeral-storage": "100Gi",
    "nvidia.com/gpu": "8",
}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


def unmount_leftovers(slot: int) -> None:
    """Unmount every host mount an agent of this slot left (deepest first)."""
    mark = f"/{STATE_MARK}-{slot}-"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if mark in line.split()[1]]
    for point in sorted(points, key=len, reverse=True):
        _run(["umount", "-l", point])


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


@dataclass
class ProbeState:
    kind: str  # startup | liveness | readiness
    spec: ProbeSpec
    next_due: float
    successes: int = 0
    failures: int = 0
    pending: Future[bool] | None = None


@dataclass
class Container:
    """One container of a pod: its spec, status and (while running) its process."""

    spec: dict
    role: str  # init | sidecar | main
    status: ContainerStatus
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    not_before: float = 0.0  # restart back-off / retry of an unresolvable start
    kill_at: float | None = None  # SIGKILL deadline after a SIGTERM
    probes: list[ProbeState] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    pull_tries: int = 0
    restart_pending: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PodWorker(threading.Thread):
    """Runs one pod from sandbox to termination, reporting its status."""

    def __init__(self, agent: NodeAgent, pod: dict, restart_counts: Mapping[str, int] | None = None):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
        counts = restart_counts or {}
        logs = agent.workdir / "logs" / self.namespace / self.pod_name
        logs.mkdir(parents=True, exist_ok=True)

        def container(c: dict, role: str) -> Container:
            status = ContainerStatus(c["name"], c.get("image", ""), restart_count=counts.get(c["name"], 0))
            return Container(c, role, status, logs / f"{c['name']}.log")

        self.init = [
            container(c, "sidecar" if is_sidecar(c) else "init") for c in spec.get("initContainers", [])
        ]
        self.main = [container(c, "main") for c in spec["containers"]]
        self.pod_dir = agent.workdir / "pods" / self.uid
        self.volume_dirs: dict[str, Path] = {}
        self.memory_mounts: list[Path] = []
        self.netns, self.veth = agent.net.names_for(self.uid)
        self.pod_ip: str | None = None
        self.sandbox_ready = False
        self.init_index = 0
        self.initialized = False
        self.terminal_phase: str | None = None
        self.failure: tuple[str, str] | None = None
        self.start_time = now_rfc3339()
        self.wake = threading.Event()
        self.delete_grace_s: float | None = None
        self.vanished = False  # the pod object is gone: stop at once, report nothing
        self.node_died = False
        self.finished = threading.Event()
        self._last_status: dict | None = None

    # ---- signals from the agent -------------------------------------------------------------------------
    def update(self, pod: dict) -> None:
        self.pod = pod
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if pod["metadata"].get("deletionTimestamp"):
            self.delete_grace_s = float(grace if grace is not None else self.grace_s)
        self.wake.set()

    def _pod_with_ip(self) -> dict:
        """The pod as the downward API sees it: the watched object may predate our first status report."""
        return {
            **self.pod,
            "status": {**self.pod.get("status", {}), "podIP": self.pod_ip, "hostIP": self.agent.net.gateway},
        }

    def containers(self) -> list[Container]:
        return [*self.init, *self.main]

    def find(self, name: str) -> Container:
        for c in self.containers():
            if c.name == name:
                return c
        raise KeyError(f"pod {self.namespace}/{self.pod_name} has no container {name!r}")

    # ---- main loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod worker %s crashed", self.name)
            self._kill_all()
        finally:
            self._teardown_sandbox()
            self.finished.set()

    def _stopping(self) -> bool:
        return self.vanished or self.node_died or self.agent.closing

    def _run(self) -> None:
        while not self._stopping() and self.delete_grace_s is None:
            try:
                self._setup_sandbox()
                break
            except PodSpecError as exc:
                for c in self.containers():
                    c.status.reason, c.status.message = "ContainerCreating", str(exc)
                self._push_status()
                self.wake.wait(1.0)
                self.wake.clear()
        while not self._stopping():
            if self.delete_grace_s is not None:
                self._terminate(self.delete_grace_s)
                self._finalize()
                return
            self._reap()
            if self.terminal_phase is None:
                self._advance()
            self._probe_tick()
            self._push_status()
            self.wake.wait(0.1)
            self.wake.clear()
        self._kill_all()

    # ---- sandbox: network + volumes ----------------------------------------------------------------------
    def _setup_sandbox(self) -> None:
        if self.pod["spec"].get("hostNetwork"):
            raise PodSpecError(
                "CreateContainerConfigError", "hostNetwork pods are not supported by the test node"
            )
        if self.pod_ip is None:
            self.pod_ip = self.agent.allocate_ip(self.uid)
            self.agent.net.create_pod_network(self.netns, self.veth, self.pod_ip)
            self.sandbox_ready = True
        for volume in self.pod["spec"].get("volumes", []):
            if volume["name"] not in self.volume_dirs:
                self.volume_dirs[volume["name"]] = self._make_volume(volume)

    def _make_volume(self, volume: dict) -> Path:
        name = volume["name"]
        target = self.pod_dir / "volumes" / name
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not host.exists():
                host.parent.mkdir(parents=True, exist_ok=True)
                host.touch()
            elif kind in ("Directory", "File") and not host.exists():
                raise PodSpecError("ContainerCreating", f"hostPath {host} does not exist")
            return host
        target.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            source = volume["emptyDir"] or {}
            if source.get("medium") == "Memory":
                size = source.get("sizeLimit")
                options = f"size={int(parse_quantity(size))}" if size else "size=50%"
                result = _run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)])
                if result.returncode != 0:
                    raise PodSpecError("ContainerCreating", f"emptyDir {name}: {result.stderr.strip()}")
                self.memory_mounts.append(target)
            return target
        files = self._volume_files(volume)
        for item in files:
            path = target / item.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(item.content)
            path.chmod(item.mode)
        return target

    def _volume_files(self, volume: dict) -> list[VolumeFile]:
        api = self.agent
        if "configMap" in volume:
            src = volume["configMap"]
            return key_files(
                api.configmap(self.namespace, src["name"]),
                src.get("items"),
                int(src.get("defaultMode", 0o644)),
                what=f"configmap {src['name']!r}",
                optional=bool(src.get("optional")),
            )
        if "secret" in volume:
            src = volume["secret"]
            return key_files(
                api.secret(self.namespace, src["secretName"]),
                src.get("items"),
                int(src.get("defaultMode", 0o644)),
                what=f"secret {src['secretName']!r}",
                optional=bool(src.get("optional")),
            )
        if "downwardAPI" in volume:
            src = volume["downwardAPI"]
            return downward_files(
                self._pod_with_ip(), src.get("items", []), int(src.get("defaultMode", 0o644))
            )
        if "projected" in volume:
            return self._projected_files(volume["projected"])
        kinds = sorted(k for k in volume if k != "name")
        raise PodSpecError(
            "ContainerCreating", f"volume {volume['name']!r}: type {kinds} not supported by the test node"
        )

    def _projected_files(self, projected: dict) -> list[VolumeFile]:
        mode = int(projected.get("defaultMode", 0o644))
        files: list[VolumeFile] = []
        for source in projected.get("sources", []):
            if "serviceAccountToken" in source:
                src = source["serviceAccountToken"]
                token = self.agent.service_account_token(
                    self.pod, src.get("audience"), src.get("expirationSeconds")
                )
                files.append(VolumeFile(src["path"], token.encode(), mode))
            elif "configMap" in source:
                src = source["configMap"]
                data = self.agent.configmap(self.namespace, src["name"])
                files += key_files(
                    data,
                    src.get("items"),
                    mode,
                    what=f"configmap {src['name']!r}",
                    optional=bool(src.get("optional")),
                )
            elif "secret" in source:
                src = source["secret"]
                data = self.agent.secret(self.namespace, src["name"])
                files += key_files(
                    data,
                    src.get("items"),
                    mode,
                    what=f"secret {src['name']!r}",
                    optional=bool(src.get("optional")),
                )
            elif "downwardAPI" in source:
                files += downward_files(self._pod_with_ip(), source["downwardAPI"].get("items", []), mode)
            else:
                raise PodSpecError("ContainerCreating", f"projected source {sorted(source)} not supported")
        return files

    def _teardown_sandbox(self) -> None:
        for mount in reversed(self.memory_mounts):
            _run(["umount", "-l", str(mount)])
        self.memory_mounts.clear()
        if self.sandbox_ready:
            podnet.delete_pod_network(self.netns, self.veth)
            self.sandbox_ready = False
        shutil.rmtree(self.pod_dir, ignore_errors=True)
        self.agent.release_ip(self.uid)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.monotonic()
        while not self.initialized and self.init_index < len(self.init):
            c = self.init[self.init_index]
            if c.role == "sidecar":
                self._keep_running(c, now)
                if not c.status.started:
                    return
            else:
                if c.status.state == "terminated" and not c.running:
                    if c.status.exit_code == 0:
                        self.init_index += 1
                        continue
                    if self.restart_policy == "Never":
                        self._finish(f"init container {c.name!r} failed with exit code {c.status.exit_code}")
                        return
                self._keep_running(c, now)
                return
            self.init_index += 1
        self.initialized = True
        for c in self.init:
            if c.role == "sidecar":
                self._keep_running(c, now)
        for c in self.main:
            done = c.status.state == "terminated" and not c.running
            if not done or should_restart(self.restart_policy, c.status.exit_code or 0):
                self._keep_running(c, now)
        if all(
            c.status.state == "terminated"
            and not c.running
            and not should_restart(self.restart_policy, c.status.exit_code or 0)
            for c in self.main
        ):
            self._finish(None)

    def _finish(self, init_failure: str | None) -> None:
        """Nothing more will run: stop sidecars (reverse order) and settle the phase."""
        self._stop([c for c in reversed(self.init) if c.running], self.grace_s)
        ok = init_failure is None and all(c.status.exit_code == 0 for c in self.main)
        self.terminal_phase = "Succeeded" if ok else "Failed"
        if init_failure:
            self.failure = ("InitContainerFailed", init_failure)

    def _keep_running(self, c: Container, now: float) -> None:
        """Start `c` unless it runs or is backing off; a start after a previous run counts as a restart."""
        if c.running or c.kill_at is not None:
            return
        if c.status.state == "terminated":
            c.status.last_terminated = c.status.as_api()["state"]["terminated"]
            c.status.state, c.status.reason = "waiting", "CrashLoopBackOff"
            c.status.message = f"back-off restarting failed container {c.name}"
            c.restart_pending = True
        if now < c.not_before:
            return
        try:
            self._start(c)
        except PodSpecError as exc:
            c.status.state, c.status.message = "waiting", str(exc)
            c.status.reason = exc.reason
            if exc.reason == "ErrImagePull":
                c.pull_tries += 1
                if c.pull_tries > 1:
                    c.status.reason = "ImagePullBackOff"
            c.not_before = now + self.agent.retry_s
            return
        if c.restart_pending:
            c.status.restart_count += 1
            c.restart_pending = False

    def _start(self, c: Container) -> None:
        rewrite = self.agent.image_rewrite(c.spec.get("image", ""))
        if rewrite is None:
            raise PodSpecError(
                "ErrImagePull",
                f"image {c.spec.get('image')!r} is not registered with the test node agent (node_agent.register_image)",
            )
        pod = self._pod_with_ip()
        env = container_env(
            c.spec,
            pod,
            configmap=lambda n: self.agent.configmap(self.namespace, n),
            secret=lambda n: self.agent.secret(self.namespace, n),
            base=self.agent.base_env(self.pod_name),
        )
        argv = container_argv(c.spec, env, rewrite(c.spec, pod))
        script = self._mount_script(c)
        launcher = [
            shutil.which("ip") or "ip",
            *("netns", "exec", self.netns),
            shutil.which("unshare") or "unshare",
            *("-m", "-u", "--propagation", "private"),
            "/bin/sh",
            "-c",
            script,
            "sh",
            *argv,
        ]
        with c.log_path.open("ab") as log_file:
            c.proc = subprocess.Popen(
                launcher,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        c.env = env
        status = c.status
        status.state, status.reason, status.message = "running", "", ""
        status.exit_code, status.finished_at = None, None
        status.started_at = now_rfc3339()
        status.container_id = f"hsx-test://{uuid.uuid4().hex}"
        started_by_probe = c.spec.get("startupProbe")
        status.started = not started_by_probe
        status.ready = False
        c.kill_at = None
        now = time.monotonic()
        c.probes = []
        for kind in ("startup", "liveness", "readiness"):
            spec = ProbeSpec.parse(c.spec.get(f"{kind}Probe"))
            if spec is not None:
                c.probes.append(ProbeState(kind, spec, now + spec.initial_delay_s))
        if not any(p.kind == "readiness" for p in c.probes):
            status.ready = status.started

    def _mount_script(self, c: Container) -> str:
        """Shell run inside the container's fresh mount namespace: bind the volumes, cd, exec the argv."""
        mounts = list(c.spec.get("volumeMounts", []))
        lines = ["set -e", f"hostname {shlex.quote(self.pod_name[:63])}"]
        placed: list[str] = []
        for mount in sorted(mounts, key=lambda m: m["mountPath"].rstrip("/").count("/")):
            name = mount["name"]
            if name not in self.volume_dirs:
                raise PodSpecError(
                    "CreateContainerConfigError", f"volumeMount {name!r} names no volume of the pod"
                )
            source = self.volume_dirs[name] / mount.get("subPath", "")
            if mount.get("subPath") and not source.exists():
                source.mkdir(parents=True)
            target = mount["mountPath"]
            is_file = source.is_file()
            inside_other = any(target.startswith(p.rstrip("/") + "/") for p in placed)
            if not inside_other:
                self.agent.host_dirs.ensure(Path(target), is_file)
            make = f"touch {shlex.quote(target)}" if is_file else f"mkdir -p {shlex.quote(target)}"
            lines.append(f"[ -e {shlex.quote(target)} ] || {make}")
            lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
            placed.append(target)
        working_dir = c.spec.get("workingDir")
        if working_dir:
            if not any(working_dir.startswith(p.rstrip("/") + "/") or working_dir == p for p in placed):
                self.agent.host_dirs.ensure(Path(working_dir), False)
            lines.append(f"mkdir -p {shlex.quote(working_dir)} && cd {shlex.quote(working_dir)}")
        lines.append('exec "$@"')
        return "\n".join(lines)

    def _reap(self) -> None:
        now = time.monotonic()
        for c in self.containers():
            if c.proc is None:
                continue
            code = c.proc.poll()
            if code is None:
                if c.kill_at is not None and now >= c.kill_at:
                    self._signal(c, signal.SIGKILL)
                continue
            self._signal(c, signal.SIGKILL)  # the container's other processes go with it
            c.proc = None
            c.kill_at = None
            status = c.status
            status.state = "terminated"
            status.exit_code = exit_code_of(code)
            status.reason = "Completed" if status.exit_code == 0 else "Error"
            status.finished_at = now_rfc3339()
            status.ready = status.started = False
            c.probes = []
            if c.role == "sidecar" or should_restart(self.restart_policy, status.exit_code):
                c.not_before = now + self.agent.backoff_s(status.restart_count)

    def _signal(self, c: Container, sig: int) -> None:
        if c.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if sig == signal.SIGKILL:
                os.killpg(c.proc.pid, sig)
            else:
                os.kill(c.proc.pid, sig)

    def kill(self, name: str, sig: int) -> None:
        c = self.find(name)
        if c.proc is None:
            raise RuntimeError(f"container {name!r} of {self.namespace}/{self.pod_name} is not running")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, sig)
        self.wake.set()

    def _stop(self, containers: list[Container], grace_s: float) -> None:
        """SIGTERM each, wait up to the grace period for all, SIGKILL the rest."""
        for c in containers:
            self._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(c.running for c in containers) and time.monotonic() < deadline and not self._stopping():
            time.sleep(0.05)
        for c in containers:
            if c.running:
                self._signal(c, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    assert c.proc is not None
                    c.proc.wait(timeout=5)
        self._reap()
        for c in containers:
            c.not_before = float("inf")  # stopped on purpose: no restart

    def _kill_all(self) -> None:
        for c in self.containers():
            self._signal(c, signal.SIGKILL)
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)
            c.proc = None

    def _terminate(self, grace_s: float) -> None:
        """Pod deletion: main containers first, then sidecars in reverse order, within one grace period."""
        deadline = time.monotonic() + grace_s
        self._stop([c for c in self.main if c.running], grace_s)
        self._stop([c for c in reversed(self.init) if c.running], max(0.0, deadline - time.monotonic()))
        for c in self.containers():
            if c.status.state == "waiting":
                c.status.reason, c.status.message = "ContainerStatusUnknown", "pod deleted before it started"
        if self.terminal_phase is None:
            ok = self.main and all(
                c.status.state == "terminated" and c.status.exit_code == 0 for c in self.main
            )
            self.terminal_phase = "Succeeded" if ok else "Failed"

    def _finalize(self) -> None:
        self._push_status()
        self.agent.finalize_pod(self.namespace, self.pod_name, self.uid)

    # ---- probes ------------------------------------------------------------------------------------------
    def _probe_tick(self) -> None:
        now = time.monotonic()
        for c in self.containers():
            if not c.running or c.kill_at is not None:
                continue
            for probe in c.probes:
                active = probe.kind == "startup" and not c.status.started
                active = active or (probe.kind != "startup" and c.status.started)
                if not active:
                    continue
                if probe.pending is not None:
                    if not probe.pending.done():
                        continue
                    self._probe_result(c, probe, probe.pending.result())
                    probe.pending = None
                    probe.next_due = now + probe.spec.period_s
                elif now >= probe.next_due:
                    probe.pending = self.agent.probe_pool.submit(self._probe_once, c, probe.spec)

    def _probe_result(self, c: Container, probe: ProbeState, ok: bool) -> None:
        if ok:
            probe.successes, probe.failures = probe.successes + 1, 0
        else:
            probe.successes, probe.failures = 0, probe.failures + 1
        spec = probe.spec
        if probe.kind == "startup" and ok:
            c.status.started = True
            if not any(p.kind == "readiness" for p in c.probes):
                c.status.ready = True
        elif probe.kind == "readiness":
            if ok and probe.successes >= spec.success_threshold:
                c.status.ready = True
            elif not ok and probe.failures >= spec.failure_threshold:
                c.status.ready = False
        if not ok and probe.kind in ("startup", "liveness") and probe.failures >= spec.failure_threshold:
            log.info("%s/%s %s: %s probe failed, killing", self.namespace, self.pod_name, c.name, probe.kind)
            self._signal(c, signal.SIGTERM)
            c.kill_at = time.monotonic() + min(self.grace_s, 10.0)

    def _probe_once(self, c: Container, spec: ProbeSpec) -> bool:
        try:
            return self.agent.run_probe(c, spec, self.pod_ip or "")
        except Exception as exc:  # a probe that cannot run is a failed probe
            log.debug("probe of %s failed: %s", c.name, exc)
            return False

    # ---- status ------------------------------------------------------------------------------------------
    def view(self) -> PodView:
        failure_reason, failure_message = self.failure or (None, None)
        return PodView(
            init=[c.status for c in self.init],
            main=[c.status for c in self.main],
            sandbox_ready=self.sandbox_ready,
            initialized=self.initialized,
            terminal_phase=self.terminal_phase,
            pod_ip=self.pod_ip,
            host_ip=self.agent.net.gateway,
            start_time=self.start_time,
            failure_reason=failure_reason,
            failure_message=failure_message,
            previous_conditions=list(self.pod.get("status", {}).get("conditions") or []),
        )

    def _push_status(self) -> None:
        if self._stopping():
            return
        status = pod_status(self.view(), [c.role == "sidecar" for c in self.init])
        comparable = _without_times(status)
        if comparable == self._last_status:
            return
        try:
            self.agent.patch_pod_status(self.namespace, self.pod_name, status)
            self._last_status = comparable
        except ApiError as exc:
            if exc.status == 404:
                self.vanished = True
            else:
                log.warning("status of %s/%s: %s", self.namespace, self.pod_name, exc)


def _without_times(status: dict) -> dict:
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]]
    return {**status, "conditions": conditions}


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
            argv = ["nsenter", "-t", str(c.proc.pid), "-m", "-n", "-u", "--", *action["exec"]["command"]]
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
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
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
    root = Path(tempfile.mkdtemp(prefix="hsx-node-")) if workdir is None else workdir
    agent = NodeAgent(cluster, root, **options)  # type: ignore[arg-type]
    try:
        agent.start()
        yield agent
    finally:
        agent.close()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def node_agent(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeAgent]:
    """The session's test node (`hsx-test-node`, 8 nvidia.com/gpu). Needs root (netns, mounts)."""
    if os.geteuid() != 0:
        pytest.skip("the node agent needs root (network and mount namespaces)")
    with start_node_agent(kube_cluster, tmp_path_factory.mktemp("node")) as agent:
        yield agent
