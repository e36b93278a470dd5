"""Desired state of a run whose server spans several nodes (spec.server.nodes > 1): one JobSet. Pure.

For G = spec.parallelism groups of N = spec.server.nodes pods each:

- replicatedJob ``leader``: one Indexed Job of G pods. Pod g is group g's rank 0, the run's usual pod
  (preflight, the server with hsx's hook, the extractor); its JOB_COMPLETION_INDEX is its replica index.
- replicatedJob ``rank-r``, r = 1..N-1: one Indexed Job of G pods. Pod g runs rank r of group g's server
  and nothing else. Each rank is its own replicatedJob so that its --node-rank is a literal (Kubernetes
  has no arithmetic on $(JOB_COMPLETION_INDEX)); Kueue takes each as one pod set, at most 8.

Every rank of group g reaches its leader at ``<jobset>-leader-0-<g>.<jobset>:DIST_INIT_PORT``, the
hostname JobSet's headless service gives it. The JobSet succeeds when the leader Job does (the other
ranks' servers never end by themselves; JobSet deletes them). Any Job failing restarts the JobSet as a
whole, every group (BlockingRecreate: the old pods are gone before new ones start), up to backoffLimit
times; a permanent exit of the preflight or extractor fails it. The ground runs JobSet without its
webhooks, so everything its defaulting webhook would set is set here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from hsx_operator.api import ExtractionJobSpec
from hsx_operator.desired import (
    MAX_LABEL_VALUE,
    SERVER_CONTAINERS,
    Owner,
    _shortened,
    desired_job,
    job_name,
    server_command,
)
from hsx_operator.pods import container_status, event_time, replica_index, server_container
from hsx_operator.status import GroupPod, GroupStatus

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
# The labels JobSet puts on its Jobs and their pods.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
LEADER = "leader"
KUEUE_GROUP_ANNOTATION = "kueue.x-k8s.io/podset-group-name"
# SGLang's torch.distributed rendezvous on the leader (the port LeaderWorkerSet's SGLang example uses).
DIST_INIT_PORT = 20000
# Pod hostnames are <jobset>-rank-<r>-0-<g>: room for "-rank-7-0-" and a group index of 2 digits.
MAX_GROUP_NAME = MAX_LABEL_VALUE - len("-rank-7-0-99")


def rank_job(rank: int) -> str:
    """The replicatedJob that runs ``rank`` of every group (0 is the leader)."""
    return LEADER if rank == 0 else f"rank-{rank}"


def child_jobs(jobset: str, nodes: int) -> list[str]:
    """The Jobs JobSet makes of the run's JobSet (one per rank; JobSet names them <jobset>-<rjob>-<i>)."""
    return [f"{jobset}-{rank_job(rank)}-0" for rank in range(nodes)]


def group_name(xj_name: str, run_id: str) -> str:
    """The run's JobSet: ``{name}-{runId}``, shortened so its pods' hostnames fit a DNS label."""
    return _shortened(job_name(xj_name, run_id), MAX_GROUP_NAME)


def leader_address(jobset: str) -> str:
    """Where each rank of a group finds its leader: the leader pod of the same index, by hostname."""
    return f"{jobset}-{LEADER}-0-$(JOB_COMPLETION_INDEX).{jobset}:{DIST_INIT_PORT}"


def desired_jobset(owner: Owner, spec: ExtractionJobSpec, *, suspend: bool | None = None) -> dict[str, Any]:
    """The run's JobSet (spec.server.nodes > 1). ``suspend`` overrides the initial suspend flag (Kueue)."""
    if spec.server.nodes < 2:
        raise ValueError("a JobSet is for server.nodes > 1; one pod per replica is a Job (desired_job)")
    name = group_name(owner.name, spec.runId)
    address = leader_address(name)
    job = desired_job(owner, spec, suspend=suspend, dist_init_addr=address)
    leader_job = job["spec"]
    leader_pod = leader_job["template"]["spec"]
    server = next(c for c in leader_pod["initContainers"] if c["name"] == SERVER_CONTAINERS[spec.server.engine])
    # A group restarts as one: a pod lost for any reason fails its Job, and the JobSet restarts.
    leader_job["backoffLimit"] = 0
    leader_job["podFailurePolicy"]["rules"] = [
        r for r in leader_job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"
    ]
    suspended = bool(leader_job.pop("suspend"))
    ttl = leader_job.pop("ttlSecondsAfterFinished", None)
    leader_job.pop("podReplacementPolicy")  # a Job of backoffLimit 0 never replaces a pod
    # A Job's own deadline would restart the JobSet and start again with each restart: the operator
    # holds the run's, from the JobSet's start across restarts (observe.past_group_deadline).
    leader_job.pop("activeDeadlineSeconds", None)
    if spec.scheduling.topology is not None and spec.server.nodes == 2 and spec.parallelism == 1:
        # Kueue puts a group of pod sets in one domain only for exactly two, one of a single pod: this one.
        leader_job["template"]["metadata"]["annotations"][KUEUE_GROUP_ANNOTATION] = LEADER
    # The Jobs carry no hsx labels of their own (their pods do): the operator finds a run by its JobSet.
    replicated = [{"name": LEADER, "replicas": 1, "template": {"spec": leader_job}}]
    for rank in range(1, spec.server.nodes):
        rank_spec = _rank_job(spec, leader_job, server, rank, address)
        replicated.append({"name": rank_job(rank), "replicas": 1, "template": {"spec": rank_spec}})
    jobset_spec: dict[str, Any] = {
        "suspend": suspended,
        "replicatedJobs": replicated,
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [LEADER]},
        "failurePolicy": {
            "maxRestarts": spec.backoffLimit,
            "restartStrategy": "BlockingRecreate",
            "rules": [
                {
                    "name": "permanent-exit",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "targetReplicatedJobs": [LEADER],
                }
            ],
        },
        "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
        "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
    }
    if ttl is not None:
        jobset_spec["ttlSecondsAfterFinished"] = ttl
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {**job["metadata"], "name": name},
        "spec": jobset_spec,
    }


def _rank_job(
    spec: ExtractionJobSpec, leader_job: Mapping[str, Any], server: Mapping[str, Any], rank: int, address: str
) -> dict[str, Any]:
    """Rank ``rank`` of every group: the leader's pod with its server alone, as the main container, and no
    probes (only rank 0 serves HTTP)."""
    pod = copy.deepcopy(leader_job["template"])  # its annotations too: Kueue's topology request, its group
    worker = {
        k: copy.deepcopy(v)
        for k, v in server.items()
        if k not in ("restartPolicy", "startupProbe", "readinessProbe")
    }
    worker["command"] = server_command(spec, rank, address)
    mounted = {m["name"] for m in worker.get("volumeMounts") or []}
    del pod["spec"]["initContainers"]
    pod["spec"]["containers"] = [worker]
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] in mounted]
    pod["metadata"]["annotations"] = {
        **pod["metadata"].get("annotations", {}),
        "kubectl.kubernetes.io/default-container": worker["name"],
    }
    out = {
        k: copy.deepcopy(v) for k, v in leader_job.items() if k not in ("template", "podFailurePolicy")
    }
    out["template"] = pod
    return out


# JobSet condition -> the Job condition observe reads (pods.job_condition).
_JOB_CONDITIONS = {"Completed": "Complete", "Failed": "Failed"}
# Its only FailJobSet rule is on a pod failure policy's verdict: observe names that failure from the pods.
_JOB_REASONS = {"FailJobSetFailurePolicyAction": "PodFailurePolicy"}
RESTART_EVENT = "RestartJobSetFailurePolicyAction"


def job_view(jobset: Mapping[str, Any]) -> dict[str, Any]:
    """A JobSet as the Job observe reads: its name, labels and uid, its suspend flag, the number of
    groups as parallelism, and Complete/Failed conditions from its own."""
    leader: Mapping[str, Any] = next(
        (r for r in jobset.get("spec", {}).get("replicatedJobs") or [] if r.get("name") == LEADER), {}
    )
    conditions = [
        {**c, "type": _JOB_CONDITIONS[c["type"]], "reason": _JOB_REASONS.get(c.get("reason", ""), c.get("reason", ""))}
        for c in (jobset.get("status") or {}).get("conditions") or []
        if c.get("type") in _JOB_CONDITIONS and c.get("status") == "True"
    ]
    done = next((c for c in conditions if c["type"] == "Complete"), None)
    status: dict[str, Any] = {"conditions": conditions}
    if done:
        status["completionTime"] = done.get("lastTransitionTime")
    if not (jobset.get("spec") or {}).get("suspend"):
        status["startTime"] = started(jobset)
    return {
        "kind": "JobSet",
        "metadata": dict(jobset.get("metadata") or {}),
        "spec": {
            "suspend": bool(jobset.get("spec", {}).get("suspend")),
            "parallelism": (leader.get("template") or {}).get("spec", {}).get("parallelism", 1),
        },
        "status": status,
    }


def started(jobset: Mapping[str, Any]) -> str | None:
    """When the JobSet last started running, as a Job's startTime: its creation if it was never
    suspended (JobSet records no Suspended condition then), else its resume (Kueue's admission,
    spec.suspend lifted), and None while JobSet has not resumed it yet. Its restarts do not count."""
    suspended = next(
        (c for c in (jobset.get("status") or {}).get("conditions") or [] if c.get("type") == "Suspended"), None
    )
    if suspended is None:
        return (jobset.get("metadata") or {}).get("creationTimestamp")
    return suspended.get("lastTransitionTime") if suspended.get("status") == "False" else None


def is_leader(pod: Mapping[str, Any]) -> bool:
    return (pod.get("metadata", {}).get("labels") or {}).get(REPLICATED_JOB_LABEL) == LEADER


def group_status(
    jobset: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    prior: GroupStatus | None,
) -> GroupStatus:
    """The groups' pods and restarts as the JobSet, its pods and its events say; the last restart's reason
    is kept once its event has expired."""
    nodes = len((jobset.get("spec") or {}).get("replicatedJobs") or []) or 1
    seen = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        rjob = labels.get(REPLICATED_JOB_LABEL, "")
        rank = 0 if rjob == LEADER else int(rjob.removeprefix("rank-") or 0) if rjob.startswith("rank-") else -1
        cs = container_status(pod, server_container(pod)) or {}
        ready = bool(cs.get("ready")) if rank == 0 else "running" in (cs.get("state") or {})
        seen.append(
            GroupPod(
                name=pod.get("metadata", {}).get("name", ""),
                group=replica_index(pod),
                rank=rank,
                phase=pod.get("status", {}).get("phase", ""),
                ready=ready,
            )
        )
    restarts = [e for e in events if e.get("reason") == RESTART_EVENT]
    last = max(restarts, key=event_time, default=None)
    out = GroupStatus(
        jobSet=jobset.get("metadata", {}).get("name", ""),
        nodes=nodes,
        restarts=int((jobset.get("status") or {}).get("restarts") or 0),
        pods=sorted(seen, key=lambda p: (p.group, p.rank, p.name)),
    )
    if last is not None:
        out.lastRestart = str(last.get("message", ""))[:4096]
        out.lastRestartTime = event_time(last) or None
    elif prior is not None and prior.jobSet == out.jobSet:
        out.lastRestart, out.lastRestartTime = prior.lastRestart, prior.lastRestartTime
    return out


def pod_specs(manifest: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod specs a Job or JobSet manifest would run (what the node-access policy checks)."""
    if manifest.get("kind") == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in manifest["spec"]["replicatedJobs"]]
    return [manifest["spec"]["template"]["spec"]]


def desired_run(owner: Owner, spec: ExtractionJobSpec, *, suspend: bool | None = None) -> dict[str, Any]:
    """The run's workload: a Job (one pod per replica) or, when the server spans nodes, a JobSet."""
    if spec.server.nodes > 1:
        return desired_jobset(owner, spec, suspend=suspend)
    return desired_job(owner, spec, suspend=suspend)
