"""Pure parts of the node agent: what a pod spec means for the processes it runs, and the status it reports.

Pods are plain dicts as the API server serves them (camelCase keys). Lookups of ConfigMaps and Secrets are
passed in as functions, so everything here is testable without a cluster.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

# name -> data (values already decoded to bytes), or None when the object does not exist.
DataLookup = Callable[[str], Mapping[str, bytes] | None]


class PodSpecError(ValueError):
    """The pod asks for something that cannot be resolved (yet): reported as the container's waiting reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, unknown ones kept, `$$` escapes a `$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REF.sub(replace, text)


_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_value(pod: Mapping, field_path: str) -> str:
    """The value of a downward-API fieldRef."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if field_path in simple:
        return str(simple[field_path] or "")
    match = _LABEL_REF.match(field_path)
    if match:
        return str(meta.get(match.group(1), {}).get(match.group(2), ""))
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = sorted(meta.get(field_path.split(".")[1], {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    raise PodSpecError("CreateContainerConfigError", f"fieldRef {field_path!r} is not supported")


_SUFFIXES: dict[str, Decimal | int] = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2Gi", "8") as a number."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise PodSpecError("CreateContainerConfigError", f"bad resource quantity {text!r}")
    return Decimal(match.group(1)) * Decimal(_SUFFIXES[match.group(2)])


def resource_field_value(container: Mapping, ref: Mapping) -> str:
    """A resourceFieldRef (limits.cpu, requests.memory, ...) divided by its divisor, rounded up."""
    where, _, resource = str(ref.get("resource", "")).partition(".")
    amount = container.get("resources", {}).get(where, {}).get(resource)
    if amount is None:
        return "0"
    divisor = parse_quantity(str(ref.get("divisor", "1")))
    return str(math.ceil(parse_quantity(str(amount)) / divisor))


def _key_of(lookup: DataLookup, kind: str, ref: Mapping) -> str | None:
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional", False))
    data = lookup(name)
    if data is None or key not in data:
        if optional:
            return None
        missing = f"{kind} {name!r} not found" if data is None else f"key {key!r} not in {kind} {name!r}"
        raise PodSpecError("CreateContainerConfigError", missing)
    return data[key].decode()


def container_env(
    container: Mapping,
    pod: Mapping,
    *,
    configmap: DataLookup,
    secret: DataLookup,
    base: Mapping[str, str],
) -> dict[str, str]:
    """The environment a container's process gets: base, then envFrom, then env (later wins)."""
    env = dict(base)
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, lookup, ref_key in (
            ("configmap", configmap, "configMapRef"),
            ("secret", secret, "secretRef"),
        ):
            ref = source.get(ref_key)
            if ref is None:
                continue
            data = lookup(ref.get("name", ""))
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError("CreateContainerConfigError", f"{kind} {ref.get('name')!r} not found")
            env.update({prefix + k: v.decode() for k, v in data.items()})
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand_refs(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_field_value(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = _key_of(configmap, "configmap", source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = _key_of(secret, "secret", source["secretKeyRef"])
        else:
            raise PodSpecError(
                "CreateContainerConfigError", f"env {name}: unsupported valueFrom {sorted(source)}"
            )
        if value is not None:
            env[name] = value
    return env


def container_argv(container: Mapping, env: Mapping[str, str], rewritten: list[str] | None) -> list[str]:
    """The argv to run: the image rewrite's, else command + args with $(VAR) expanded."""
    if rewritten is not None:
        return list(rewritten)
    command = container.get("command") or []
    if not command:
        raise PodSpecError(
            "CreateContainerError",
            f"container {container.get('name')!r} has no command and its image rewrite gave none",
        )
    return [expand_refs(str(part), env) for part in [*command, *(container.get("args") or [])]]


# What containerd gives a container unless its securityContext says otherwise.
DEFAULT_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
        "NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
# Every test image runs as root unless the pod says otherwise; a uid without a passwd entry gets
# group 0 and HOME=/ (containerd's fallbacks).
IMAGE_USER = 0


@dataclass(frozen=True)
class Identity:
    """Who a container's process is: the kubelet's merge of the pod's and the container's securityContext."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary: fsGroup, then supplementalGroups
    capabilities: frozenset[str]  # bounding set; a non-root uid holds none of them after exec
    no_new_privs: bool
    read_only_root: bool

    @property
    def home(self) -> str:
        return "/root" if self.uid == 0 else "/"

    def setpriv_argv(self) -> list[str]:
        """The prefix that makes an exec (as root) become this identity, as a container runtime does."""
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        caps = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(self.capabilities))])
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", groups]
        argv += [f"--bounding-set={caps}", "--inh-caps=-all"]
        if self.no_new_privs:
            argv.append("--no-new-privs")
        return [*argv, "--"]


def identity(pod_spec: Mapping, container: Mapping) -> Identity:
    """The container's identity; refuses what the kubelet refuses (runAsNonRoot with a root user)."""
    pod_ctx = pod_spec.get("securityContext") or {}
    ctx = container.get("securityContext") or {}

    def pick(key: str) -> object:
        return ctx[key] if ctx.get(key) is not None else pod_ctx.get(key)

    uid_set = pick("runAsUser")
    uid = IMAGE_USER if uid_set is None else int(str(uid_set))
    if pick("runAsNonRoot") and uid == 0:
        detail = "runAsUser 0" if uid_set is not None else "the image's user, root"
        raise PodSpecError(
            "CreateContainerConfigError",
            f"container {container.get('name')!r} has runAsNonRoot and would run as root ({detail})",
        )
    gid_set = pick("runAsGroup")
    gid = 0 if gid_set is None else int(str(gid_set))
    fs_group = pod_ctx.get("fsGroup")
    groups = [int(fs_group)] if fs_group is not None else []
    groups += [int(g) for g in pod_ctx.get("supplementalGroups") or [] if int(g) not in groups]
    if ctx.get("privileged"):
        raise PodSpecError("CreateContainerConfigError", "privileged containers are not supported by the test node")
    caps_spec = ctx.get("capabilities") or {}
    drop = {str(c).upper().removeprefix("CAP_") for c in caps_spec.get("drop") or []}
    add = {str(c).upper().removeprefix("CAP_") for c in caps_spec.get("add") or []}
    if "ALL" in add:
        raise PodSpecError("CreateContainerConfigError", "capabilities.add [ALL] is not supported by the test node")
    caps = (set() if "ALL" in drop else set(DEFAULT_CAPABILITIES) - drop) | add
    return Identity(
        uid=uid,
        gid=gid,
        groups=tuple(groups),
        capabilities=frozenset(caps),
        no_new_privs=ctx.get("allowPrivilegeEscalation") is False,
        read_only_root=bool(ctx.get("readOnlyRootFilesystem")),
    )


def traversal_barrier(path: str, ident: Identity, stat_of: Callable[[str], tuple[int, int, int]]) -> str | None:
    """The outermost ancestor of ``path`` that ``ident`` may not search (no x bit for it), or None.

    ``stat_of(dir)`` gives (mode, uid, gid). DAC_OVERRIDE / DAC_READ_SEARCH would let root pass; the
    pods here drop them, so only the mode bits count."""
    if ident.uid == 0 and {"DAC_OVERRIDE", "DAC_READ_SEARCH"} & ident.capabilities:
        return None
    parts = [p for p in path.split("/") if p]
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        mode, owner, group = stat_of(ancestor)
        if owner == ident.uid:
            bit = 0o100
        elif group == ident.gid or group in ident.groups:
            bit = 0o010
        else:
            bit = 0o001
        if not mode & bit:
            return ancestor
    return None


def decoded_secret_data(secret: Mapping) -> dict[str, bytes]:
    """A Secret's data (base64) and stringData as bytes."""
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return data


def configmap_data(configmap: Mapping) -> dict[str, bytes]:
    data = {k: v.encode() for k, v in (configmap.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (configmap.get("binaryData") or {}).items()})
    return data


@dataclass(frozen=True)
class VolumeFile:
    """One file a configMap/secret/projected/downwardAPI volume holds."""

    path: str
    content: bytes
    mode: int


def key_files(
    data: Mapping[str, bytes] | None,
    items: list[Mapping] | None,
    default_mode: int,
    *,
    what: str,
    optional: bool,
) -> list[VolumeFile]:
    """The files of a configMap or secret volume source (all keys, or only `items`)."""
    if data is None:
        if optional:
            return []
        raise PodSpecError("ContainerCreating", f"{what} not found")
    if not items:
        return [VolumeFile(key, value, default_mode) for key, value in sorted(data.items())]
    files = []
    for item in items:
        key = item["key"]
        if key not in data:
            if optional:
                continue
            raise PodSpecError("ContainerCreating", f"key {key!r} not in {what}")
        files.append(VolumeFile(item.get("path", key), data[key], int(item.get("mode", default_mode))))
    return files


def downward_files(pod: Mapping, items: list[Mapping], default_mode: int) -> list[VolumeFile]:
    files = []
    for item in items:
        if "fieldRef" not in item:
            raise PodSpecError("ContainerCreating", "downwardAPI: only fieldRef items are supported")
        value = field_value(pod, item["fieldRef"]["fieldPath"])
        files.append(VolumeFile(item["path"], value.encode(), int(item.get("mode", default_mode))))
    return files


def is_sidecar(init_container: Mapping) -> bool:
    """A native sidecar: an init container with restartPolicy Always."""
    return init_container.get("restartPolicy") == "Always"


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """Whether a regular (main or init) container that exited is started again."""
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def exit_code_of(returncode: int) -> int:
    """Popen's returncode (negative for a signal) as a container exit code (128 + signal)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class ProbeSpec:
    """A probe's action and timing, with Kubernetes defaults filled in."""

    action: Mapping
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def parse(cls, probe: Mapping | None) -> ProbeSpec | None:
        if not probe:
            return None
        actions = {k: probe[k] for k in ("httpGet", "exec", "tcpSocket", "grpc") if k in probe}
        return cls(
            action=actions,
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


def resolve_port(port: int | str, container: Mapping) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise PodSpecError(
        "CreateContainerConfigError", f"probe port {port!r} is not a named port of the container"
    )


@dataclass
class ContainerStatus:
    """What the agent knows about one container, in the shape of a v1.ContainerStatus."""

    name: str
    image: str
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    exit_code: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""
    last_terminated: dict | None = None

    def as_api(self) -> dict:
        state: dict
        if self.state == "running":
            state = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {
                "terminated": {
                    "exitCode": self.exit_code,
                    "reason": self.reason,
                    "message": self.message or None,
                    "startedAt": self.started_at,
                    "finishedAt": self.finished_at,
                    "containerID": self.container_id or None,
                }
            }
        else:
            state = {"waiting": {"reason": self.reason, "message": self.message or None}}
        status = {
            "name": self.name,
            "image": self.image,
            "imageID": f"hsx-test://{self.image}",
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


@dataclass
class PodView:
    """Inputs for a pod's status: container states and where the pod's lifecycle is."""

    init: list[ContainerStatus]
    main: list[ContainerStatus]
    sandbox_ready: bool
    initialized: bool
    terminal_phase: str | None  # Succeeded / Failed once nothing will run again
    pod_ip: str | None
    host_ip: str
    start_time: str | None
    failure_reason: str | None = None
    failure_message: str | None = None
    previous_conditions: list[dict] = field(default_factory=list)


def pod_phase(view: PodView) -> str:
    if view.terminal_phase:
        return view.terminal_phase
    if view.initialized and any(c.state != "waiting" or c.restart_count for c in view.main):
        return "Running"
    return "Pending"


def _condition(previous: list[dict], kind: str, ok: bool, reason: str | None = None) -> dict:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now_rfc3339()
    condition = {"type": kind, "status": status, "lastTransitionTime": since, "lastProbeTime": None}
    if reason and not ok:
        condition["reason"] = reason
    return condition


def pod_status(view: PodView, sidecars: list[bool]) -> dict:
    """A v1.PodStatus patch. `sidecars[i]` tells whether init container i is a native sidecar."""
    running_sidecars = [c for c, side in zip(view.init, sidecars, strict=True) if side]
    readiness = [*view.main, *running_sidecars] if view.terminal_phase is None else view.main
    containers_ready = bool(view.main) and all(c.ready for c in readiness)
    previous = view.previous_conditions
    conditions = [
        _condition(previous, "PodReadyToStartContainers", view.sandbox_ready),
        _condition(previous, "Initialized", view.initialized, "ContainersNotInitialized"),
        _condition(previous, "ContainersReady", containers_ready, "ContainersNotReady"),
        _condition(previous, "Ready", containers_ready, "ContainersNotReady"),
    ]
    owned = {c["type"] for c in conditions}
    conditions += [c for c in previous if c.get("type") not in owned]  # PodScheduled, DisruptionTarget, ...
    status: dict = {
        "phase": pod_phase(view),
        "conditions": conditions,
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "startTime": view.start_time,
        "initContainerStatuses": [c.as_api() for c in view.init],
        "containerStatuses": [c.as_api() for c in view.main],
    }
    if view.pod_ip:
        status["podIP"] = view.pod_ip
        status["podIPs"] = [{"ip": view.pod_ip}]
    if view.failure_reason:
        status["reason"] = view.failure_reason
        status["message"] = view.failure_message
    return status
