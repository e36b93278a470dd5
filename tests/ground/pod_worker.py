"""One pod on the test node: sandbox (netns, volumes), containers in Kubernetes order, probes, status."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.ground import podnet
from tests.ground.podspec import (
    ContainerStatus,
    Identity,
    PodSpecError,
    PodView,
    ProbeSpec,
    VolumeFile,
    container_argv,
    container_env,
    downward_files,
    exit_code_of,
    identity,
    is_sidecar,
    key_files,
    now_rfc3339,
    parse_quantity,
    pod_status,
    should_restart,
    traversal_barrier,
)
from tests.ground.rest import ApiError

if TYPE_CHECKING:
    from tests.ground.node_agent import NodeAgent

log = logging.getLogger("hsx.node_agent")

# The kubelet's defaults for a container's termination message.
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_MAX_BYTES = 4096


def image_roots() -> list[Path]:
    """Host directories that stand for the images' contents: the checkout, the interpreter's prefixes and
    the test tools' cache (engine venvs, Kueue's manager)."""
    from tests.ground.tools import cache_root  # a pytest plugin module: imported late, by then loaded

    candidates = {
        Path(__file__).resolve().parents[2],
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
        cache_root().resolve(),
    }
    # The outermost of nested ones suffices.
    return sorted(c for c in candidates if not any(o != c and o in c.parents for o in candidates))


class SourceHandles:
    """Descriptors on bind sources, opened by the container's mount script before its first mount.

    A source is then named `/proc/self/fd/N`, which resolves to the opened file itself even after a volume
    covers its path (mount runs with --no-canonicalize, which would turn it back into the path). They are
    opened inside the container's mount namespace: a bind from a descriptor of another one is refused."""

    FIRST_FD = 20  # above what bash and the launcher use

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def ref(self, path: Path) -> str:
        if not (path.is_dir() or path.is_file()):  # sockets, devices: opening one has effects; by path
            return shlex.quote(str(path))
        if path not in self._fds:
            self._fds[path] = self.FIRST_FD + len(self._fds)
        return f"/proc/self/fd/{self._fds[path]}"

    def open_lines(self) -> list[str]:
        return [f"exec {fd}<{shlex.quote(str(path))}" for path, fd in self._fds.items()]

    def close_lines(self) -> list[str]:
        return [f"exec {fd}<&-" for fd in self._fds.values()]


def covers(mount_path: str, path: Path) -> bool:
    """Whether a volume mounted at ``mount_path`` hides ``path``."""
    return Path(mount_path) == path or Path(mount_path) in path.parents


def _stat_triple(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_gid


def run_quiet(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


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
    termination_file: Path | None = None  # host file bound at the spec's terminationMessagePath
    identity: Identity | None = None  # the user its process runs as (securityContext), once started

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
        if self.init:
            for c in self.main:
                c.status.reason = "PodInitializing"
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
            if self.terminal_phase is not None and self.sandbox_ready:
                self._teardown_sandbox()  # as a kubelet does: nothing runs, free the netns and volumes
            self.wake.wait(0.1 if self.terminal_phase is None else 1.0)
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
        if "persistentVolumeClaim" in volume:
            return self.agent.claimed_dir(self.namespace, volume["persistentVolumeClaim"]["claimName"])
        target.mkdir(parents=True, exist_ok=True)
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        if "emptyDir" in volume:
            source = volume["emptyDir"] or {}
            if source.get("medium") == "Memory":
                size = source.get("sizeLimit")
                options = f"size={int(parse_quantity(size))}" if size else "size=50%"
                result = run_quiet(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)])
                if result.returncode != 0:
                    raise PodSpecError("ContainerCreating", f"emptyDir {name}: {result.stderr.strip()}")
                self.memory_mounts.append(target)
            # As the kubelet makes it: 0777, and with an fsGroup owned by it, setgid.
            if fs_group is not None:
                os.chown(target, -1, int(fs_group))
            target.chmod(0o2777 if fs_group is not None else 0o777)
            return target
        files = self._volume_files(volume)
        for item in files:
            path = target / item.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(item.content)
            path.chmod(item.mode)
            if fs_group is not None:  # the kubelet's volume ownership: group fsGroup, group-readable
                os.chown(path, -1, int(fs_group))
                path.chmod(item.mode | 0o440)
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
            run_quiet(["umount", "-l", str(mount)])
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
        ident = identity(self.pod["spec"], c.spec)
        env = container_env(
            c.spec,
            pod,
            configmap=lambda n: self.agent.configmap(self.namespace, n),
            secret=lambda n: self.agent.secret(self.namespace, n),
            base={**self.agent.base_env(self.pod_name), "HOME": ident.home},
        )
        argv = container_argv(c.spec, env, rewrite(c.spec, pod))
        c.termination_file = self._fresh_termination_file(c)
        c.identity = ident
        script = self._mount_script(c, ident)
        launcher = [
            shutil.which("ip") or "ip",
            *("netns", "exec", self.netns),
            shutil.which("unshare") or "unshare",
            *("-m", "-u", "--propagation", "private"),
            shutil.which("bash") or "/bin/bash",  # dash cannot close descriptors above 9
            "-c",
            script,
            "bash",
            *ident.setpriv_argv(),
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

    def _mount_script(self, c: Container, ident: Identity) -> str:
        """Bash run as root inside the container's fresh mount namespace: bind the volumes, cd, then
        exec the argv ("$@", which starts with the setpriv that becomes the container's user).

        Every bind source is reached through a descriptor opened before any mount, so a
        volume over the node's own directories (the chart's emptyDir at /tmp, with the node's work dir
        under /tmp) cannot hide a source that a later mount needs, as a real kubelet's never can."""
        mounts = list(c.spec.get("volumeMounts", []))
        lines: list[str] = []
        placed: list[str] = []
        handles = SourceHandles()

        def bind(source: Path, target: str) -> None:
            lines.append(f"mount --no-canonicalize --bind {handles.ref(source)} {shlex.quote(target)}")

        roots = image_roots()
        # A real image's files are world-readable; here the interpreter may sit under /root (0700).
        # A non-root user gets an empty, searchable directory over such an ancestor ("veil"), with the
        # image's directories bound back inside it. Nothing else of the host's /root shows.
        veils = sorted(
            {b for r in roots if (b := traversal_barrier(str(r), ident, _stat_triple)) is not None}
        )

        def rebind_roots_under(cover: str) -> None:
            """Every container's "image" is this checkout and its interpreter: bind them back over a
            mount at ``cover`` that hides them (a volume at /tmp with the clone under /tmp, a veil)."""
            for root in roots:
                if covers(cover, root):
                    lines.append(f"mkdir -p {shlex.quote(str(root))}")
                    bind(root, str(root))

        for i, veil in enumerate(veils):
            empty = self.pod_dir / "veil" / str(i)
            empty.mkdir(parents=True, exist_ok=True)
            empty.chmod(0o755)
            bind(empty, veil)
            rebind_roots_under(veil)
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
            bind(source, target)
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
            placed.append(target)
            rebind_roots_under(target)
        if c.termination_file is not None:
            target = c.spec.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
            self.agent.host_dirs.ensure(Path(target), True)
            lines.append(f"[ -e {shlex.quote(target)} ] || touch {shlex.quote(target)}")
            bind(c.termination_file, target)
        working_dir = c.spec.get("workingDir")
        if working_dir:
            if not any(working_dir.startswith(p.rstrip("/") + "/") or working_dir == p for p in placed):
                self.agent.host_dirs.ensure(Path(working_dir), False)
            lines.append(f"mkdir -p {shlex.quote(working_dir)} && cd {shlex.quote(working_dir)}")
        if ident.read_only_root:
            # Only the root mount: volumes, /dev, /proc and the termination file are mounts of their own.
            lines.append("mount -o remount,bind,ro /")
        lines.extend(handles.close_lines())  # the container never holds a handle on the node's files
        lines.append('exec "$@"')
        head = ["set -e", f"hostname {shlex.quote(self.pod_name[:63])}", *handles.open_lines()]
        return "\n".join(head + lines)

    def _fresh_termination_file(self, c: Container) -> Path:
        """An empty file per container run, as the kubelet makes one for each container start."""
        path = self.pod_dir / "termination" / f"{c.name}-{c.status.restart_count}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        path.chmod(0o666)  # as the kubelet's: writable by whatever user the container runs as
        return path

    def _termination_message(self, c: Container, exit_code: int) -> str:
        """The kubelet's rule: the file's first 4096 bytes; with FallbackToLogsOnError and an empty
        file after a failure, the log's last 80 lines (at most 2048 bytes)."""
        text = ""
        if c.termination_file is not None and c.termination_file.exists():
            with c.termination_file.open("rb") as f:
                text = f.read(TERMINATION_MESSAGE_MAX_BYTES).decode(errors="replace")
        policy = c.spec.get("terminationMessagePolicy", "File")
        if not text and exit_code != 0 and policy == "FallbackToLogsOnError" and c.log_path.exists():
            tail = c.log_path.read_bytes().splitlines()[-80:]
            text = b"\n".join(tail)[-2048:].decode(errors="replace")
        return text

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
            status.message = self._termination_message(c, status.exit_code)
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
