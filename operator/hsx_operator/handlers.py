"""kopf wiring: read the world, call the pure functions in desired/observe, write what they say.

Every trigger (create, spec update, resume after an operator restart, and a periodic timer) runs
the same idempotent :func:`reconcile`. Job names are deterministic, so a second operator or a
restarted one finds the Job instead of creating another (creation answers 409 AlreadyExists).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from hsx_extractor.usage import describe_validation_error
from hsx_operator import metrics
from hsx_operator.api import GROUP, PLURAL, VERSION, ExtractionJobSpec
from hsx_operator.cluster import Cluster, client_refusal, create_refusal, poll_pods
from hsx_operator.cluster_defaults import ClusterDefaults, annotate, with_cluster_defaults
from hsx_operator.desired import (
    LABEL_QUEUE,
    LABEL_RUN,
    MANAGER,
    Owner,
    desired_config_map,
    initial_suspend,
    job_name,
    with_queue_label,
)
from hsx_operator.group import (
    child_jobs,
    desired_run,
    group_name,
    group_status,
    is_leader,
    job_view,
    pod_specs,
)
from hsx_operator.observe import Refusal, needs_job, observe
from hsx_operator.pods import job_finished, scale_patch
from hsx_operator.policy import NodeAccessPolicy, violations
from hsx_operator.status import TERMINAL_PHASES, ExtractionJobStatus, Phase, Reason, status_patch

POLL_SECONDS = float(os.environ.get("HSX_OPERATOR_POLL_SECONDS", "5"))
# The cluster admin's allow-lists; main() sets them from the command line before kopf runs.
POLICY = NodeAccessPolicy()
CLUSTER_DEFAULTS = ClusterDefaults()
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
log = logging.getLogger("hsx_operator")


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # kopf's bookkeeping goes into annotations: the status schema would prune it, and spec is the user's.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # Events say they come from hsx-operator (kubectl describe's "From"), not from kopf.
    settings.posting.reporting_component = MANAGER
    settings.posting.reporting_instance = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or MANAGER
    settings.watching.server_timeout = 120
    # Handlers are sync, in kopf's thread pool (default: cores + 4 threads); a few slow polls must not
    # queue every other object's handlers, deletions included, behind them.
    settings.execution.max_workers = 32
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def reconcile(
    *,
    trigger: str,
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: kopf.Patch,
    generation: int,
) -> None:
    started = time.monotonic()
    try:
        with _lock(uid):
            _reconcile(
                body=body,
                name=name,
                namespace=namespace,
                uid=uid,
                spec=spec,
                status=status,
                patch=patch,
                generation=generation,
            )
    except Exception:
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    metrics.RECONCILES.labels(trigger=trigger, result="ok").inc()


def _reconcile(
    *,
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: kopf.Patch,
    generation: int,
) -> None:
    try:
        labelled = with_queue_label(ExtractionJobSpec.model_validate(dict(spec)), body.get("metadata", {}).get("labels"))
        xj, from_defaults = with_cluster_defaults(labelled, CLUSTER_DEFAULTS)
    except ValidationError as exc:
        # The API server accepted it, so the CRD and the models disagree: say so, touch nothing.
        wanted = {
            "phase": Phase.FAILED.value,
            "reason": Reason.INVALID_SPEC.value,
            "message": describe_validation_error(exc, prefix="spec")[:4000],
            "observedGeneration": generation,
        }
        patch.status.update(status_patch(dict(status or {}), wanted))
        return
    prior_raw = dict(status or {})
    prior = ExtractionJobStatus.model_validate(prior_raw)
    owner = Owner(name=name, namespace=namespace, uid=uid)
    cluster = Cluster()
    kind = "JobSet" if xj.server.nodes > 1 else "Job"
    current = group_name(name, xj.runId) if kind == "JobSet" else job_name(name, xj.runId)
    jobsets = {j["metadata"]["name"]: j for j in cluster.jobsets_of(owner)}
    # A JobSet is read as the Job it stands for (group.job_view); its own status feeds status.group.
    jobs = cluster.jobs_of(owner) + [job_view(j) for j in jobsets.values()]
    for other in jobs:
        # A runId change supersedes the old run: stop its pods, keep its data and its finished Job.
        if (
            other["metadata"]["name"] != current
            and not job_finished(other)
            and not other["metadata"].get("deletionTimestamp")
        ):
            cluster.delete_job(namespace, other["metadata"]["name"], "Background", other.get("kind", "Job"))
            kopf.info(
                body,
                reason="RunSuperseded",
                message=f"run {other['metadata']['labels'].get(LABEL_RUN)} stopped: runId is now {xj.runId}",
            )
    job = next((j for j in jobs if j["metadata"]["name"] == current and j.get("kind", "Job") == kind), None)
    run_status = (
        prior
        if prior.observedRunId == xj.runId
        else ExtractionJobStatus.model_validate({"observedRunId": xj.runId})
    )
    refusal: Refusal | None = None
    if needs_job(run_status, job):
        created, refusal = _create_run(cluster, owner, xj, from_defaults)
        if created is not None:
            metrics.JOBS_CREATED.inc()
            kopf.info(body, reason="JobCreated", message=f"created {kind} {current} for run {xj.runId}")
            if kind == "JobSet":
                jobsets[current] = created
                created = job_view(created)
        job = created
    elif job is not None and not job_finished(job) and run_status.phase not in TERMINAL_PHASES:
        # A JobSet's groups are fixed for its run (the CRD refuses a parallelism change).
        if kind == "Job" and (scale := scale_patch(job, xj.parallelism)) is not None:
            cluster.patch_job(namespace, current, scale)
            before = job["spec"].get("parallelism")
            job["spec"].update(scale["spec"])
            kopf.info(body, reason="Scaled", message=f"Job {current}: {before} -> {xj.parallelism} pods")
        want = True if xj.suspend else (None if xj.scheduling.queueName else False)
        if want is not None and bool(job["spec"].get("suspend")) != want:
            cluster.patch_job(namespace, current, {"spec": {"suspend": want}}, kind)
            job["spec"]["suspend"] = want
            kopf.info(
                body,
                reason="Suspended" if want else "Resumed",
                message=f"Job {current} {'suspended' if want else 'resumed'}",
            )
    # A finished run's status no longer changes (observe keeps it): read nothing, poll nobody.
    watching = job is not None and run_status.phase not in TERMINAL_PHASES
    every_pod = cluster.pods_of(namespace, current, kind) if watching else []
    # The extractors and their progress are on the leaders; the other ranks only show in status.group.
    pods = [p for p in every_pod if is_leader(p)] if kind == "JobSet" else every_pod
    events = {
        p["metadata"]["name"]: cluster.events_of(namespace, p["metadata"]["name"])
        for p in pods
        if p["status"].get("phase") == "Pending"
    }
    live = watching and job is not None and not job_finished(job)
    job_events = cluster.events_of(namespace, current, kind) if live else []
    if live and kind == "JobSet":  # its Jobs are what fail to create pods (quota, PodSecurity)
        job_events += [e for j in child_jobs(current, xj.server.nodes) for e in cluster.events_of(namespace, j, "Job")]
    polled = [p for p in pods if live]
    waits_for_kueue = (
        live
        and job is not None
        and not xj.suspend
        and bool(job["spec"].get("suspend"))
        and bool((job["metadata"].get("labels") or {}).get(LABEL_QUEUE))
    )
    kueue = cluster.kueue_view(namespace, job["metadata"]["uid"]) if waits_for_kueue and job else None
    reports = poll_pods(polled, xj.extractor.progressPort, xj.output_run_id())
    now = cluster.now()  # the API server's clock, as the Job's timestamps are
    outcome = observe(
        xj_name=name,
        generation=generation,
        spec=xj,
        prior=prior,
        job=job,
        pods=pods,
        events=events,
        progress=reports,
        now=now,
        job_events=job_events,
        refusal=refusal,
        kueue=kueue,
    )
    if kind == "JobSet" and current in jobsets and outcome.status.phase not in TERMINAL_PHASES:
        outcome.status.group = group_status(jobsets[current], every_pod, job_events, prior.group)
    if outcome.stop_job and job is not None:
        _stop(cluster, namespace, current, kind)
    for note in outcome.events:
        kopf.event(body, type=note.type, reason=note.reason, message=note.message)
    new = outcome.status.model_dump(mode="json")
    changed = status_patch(prior_raw, new)
    if changed:
        patch.status.update(changed)
    metrics.record_phase(uid, outcome.status.phase)


def _create_run(
    cluster: Cluster, owner: Owner, xj: ExtractionJobSpec, from_defaults: list[str]
) -> tuple[dict[str, Any] | None, Refusal | None]:
    """Create the run's ConfigMap and Job: (the Job, None), or (None, why not)."""
    try:
        config_map = desired_config_map(owner, xj)
        manifest = annotate(desired_run(owner, xj, suspend=initial_suspend(xj)), from_defaults)
    except ValueError as exc:  # the spec passed the CRD but cannot make a Job (launch.server_args' checks)
        return None, Refusal(Reason.INVALID_SPEC, f"{exc}; fix the spec and change runId", permanent=True)
    denied = [v for pod in pod_specs(manifest) for v in violations(pod, POLICY)]
    if denied:
        message = "; ".join(dict.fromkeys(denied)) + "; then change runId to run again"
        return None, Refusal(Reason.NOT_PERMITTED, message, permanent=True)
    for kind, obj in (("ConfigMap", config_map), (manifest["kind"], manifest)):
        try:
            created = cluster.create_or_read(owner, obj, kind)
        except ValidationError as exc:  # the client's own models refused it before any request
            refusal = client_refusal(exc, kind, obj["metadata"]["name"])
        except ApiException as exc:
            maybe = create_refusal(exc, kind, obj["metadata"]["name"])
            if maybe is None:
                raise
            refusal = maybe
        else:
            continue
        log.warning("%s: creating %s %s: %s", owner.ref(xj.runId), kind, obj["metadata"]["name"], refusal.message)
        return None, refusal
    return created, None


def _stop(cluster: Cluster, namespace: str, job: str, kind: str) -> None:
    """End a Job now, keeping it (and its pods' logs) for inspection; delete it if that is refused. A
    JobSet's Jobs take no deadline from it: it is deleted."""
    if kind == "JobSet":
        cluster.delete_job(namespace, job, "Background", kind)
        return
    try:
        cluster.patch_job(namespace, job, {"spec": {"activeDeadlineSeconds": 1}})
    except ApiException as exc:
        if exc.status != 422:
            raise
        cluster.delete_job(namespace, job, "Background")


def _handle(trigger: str, kwargs: dict[str, Any]) -> None:
    reconcile(
        trigger=trigger,
        body=kwargs["body"],
        name=kwargs["name"],
        namespace=kwargs["namespace"],
        uid=kwargs["uid"],
        spec=kwargs["spec"],
        status=kwargs["status"],
        patch=kwargs["patch"],
        generation=int(kwargs["meta"].get("generation") or 0),
    )


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(**kwargs: Any) -> None:
    _handle("create", kwargs)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_update(**kwargs: Any) -> None:
    _handle("update", kwargs)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(**kwargs: Any) -> None:
    _handle("resume", kwargs)


def ever_ran(status: Mapping[str, Any], **_: Any) -> bool:
    """Whether a Job of this resource was ever created (this run's or an earlier one's). kopf puts the
    finalizer only on such objects, so deleting a refused or never-started run waits on nothing, not
    even on a running operator; ownerReferences collect anything created after this was read."""
    return bool(status.get("startTime") or status.get("history"))


def has_anything_to_poll(status: Mapping[str, Any], **_: Any) -> bool:
    """Every run but one refused before any Job: kopf holds a finalizer for each object a timer
    matches, so without this filter a refused run's delete would wait on the operator after all."""
    return ever_ran(status) or status.get("phase") not in TERMINAL_PHASES


@kopf.timer(GROUP, VERSION, PLURAL, interval=POLL_SECONDS, initial_delay=POLL_SECONDS, when=has_anything_to_poll)
def on_timer(**kwargs: Any) -> None:
    _handle("timer", kwargs)


@kopf.on.delete(GROUP, VERSION, PLURAL, when=ever_ran)
def on_delete(**kwargs: Any) -> None:
    """Remove the runs' Jobs and pods (foreground, so GPUs are free once this returns). Data is never touched."""
    name, namespace, uid = kwargs["name"], kwargs["namespace"], kwargs["uid"]
    cluster = Cluster()
    owner = Owner(name=name, namespace=namespace, uid=uid)
    jobs = [*cluster.jobs_of(owner), *({**j, "kind": "JobSet"} for j in cluster.jobsets_of(owner))]
    for job in jobs:
        if not job["metadata"].get("deletionTimestamp"):
            cluster.delete_job(namespace, job["metadata"]["name"], "Foreground", job.get("kind", "Job"))
    metrics.record_phase(uid, None)
    if jobs:
        raise kopf.TemporaryError(f"waiting for {len(jobs)} Job(s) or JobSet(s) and their pods to go", delay=2)
