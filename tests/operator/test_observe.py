"""observe.py: observations -> status, for each situation a run can be in."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hsx_operator.api import ExtractionJobSpec
from hsx_operator.conditions import human_duration, set_condition
from hsx_operator.observe import Outcome, needs_job, observe
from hsx_operator.status import ExtractionJobStatus
from tests.operator.helpers import (
    EXTRACTOR_RUNNING,
    EXTRACTOR_WAITING,
    SERVER_LOADING,
    SERVER_READY,
    job_json,
    make_spec,
    pod_json,
)

NOW = datetime(2026, 12, 2, 10, 5, tzinfo=UTC)


def run(
    spec: ExtractionJobSpec | None = None,
    prior: ExtractionJobStatus | None = None,
    job: dict[str, Any] | None = None,
    pods: list[dict[str, Any]] | None = None,
    events: dict[str, list[dict[str, Any]]] | None = None,
    progress: dict[str, dict[str, Any]] | None = None,
    now: datetime = NOW,
    generation: int = 1,
) -> Outcome:
    return observe(
        xj_name="xj",
        generation=generation,
        spec=spec or make_spec(),
        prior=prior or ExtractionJobStatus(),
        job=job,
        pods=pods or [],
        events=events or {},
        progress=progress or {},
        now=now,
    )


def cond(status: ExtractionJobStatus, type_: str) -> str:
    return next(c.status for c in status.conditions if c.type == type_)


def test_new_run_without_job_is_pending_and_needs_its_job() -> None:
    out = run()
    st = out.status
    assert (st.phase, st.observedRunId, st.jobName) == ("Pending", "r1", "xj-r1")
    assert st.output.prefix == "s3://out/hs/r1/" and st.output.manifestUri == "s3://out/hs/r1/manifest.json"
    assert needs_job(st, None)
    assert out.events[0].reason == "RunStarted"
    assert cond(st, "Reconciling") == "True" and cond(st, "Succeeded") == "False"


def test_a_seed_sglang_would_not_apply_is_warned_of_when_the_run_starts() -> None:
    def reasons(**spec: object) -> list[str]:
        return [e.reason for e in run(spec=make_spec(responses="regenerate", **spec)).events]

    assert "SeedIgnored" in reasons(generation={"seed": 7})
    warning = next(e for e in run(spec=make_spec(responses="regenerate", generation={"seed": 7})).events
                   if e.reason == "SeedIgnored")  # fmt: skip
    assert warning.type == "Warning" and "--enable-deterministic-inference" in warning.message
    assert "SeedIgnored" not in reasons(generation={"seed": 7}, server={"extraArgs": ["--enable-deterministic-inference"]})
    assert "SeedIgnored" not in reasons(generation={"temperature": 0.7})
    assert "SeedIgnored" not in reasons(generation={"seed": 7, "temperature": 0}, server={"engine": "vllm"})


def test_unschedulable_pod_says_the_schedulers_message() -> None:
    msg = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    st = run(
        job=job_json(), pods=[pod_json(phase="Pending", scheduled=False, unschedulable_message=msg)]
    ).status
    assert (st.phase, st.reason) == ("Pending", "Unschedulable")
    assert msg in st.message
    assert cond(st, "Stalled") == "True"


def test_failed_scheduling_event_is_used_when_the_pod_has_no_condition_yet() -> None:
    pod = pod_json(phase="Pending", scheduled=False)
    events = {pod["metadata"]["name"]: [{"reason": "FailedScheduling", "message": "no nodes available"}]}
    st = run(job=job_json(), pods=[pod], events=events).status
    assert st.reason == "Unschedulable" and "no nodes available" in st.message


def test_image_pull_backoff_is_the_reason() -> None:
    server = {
        "started": False,
        "ready": False,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}},
    }
    st = run(
        job=job_json(), pods=[pod_json(phase="Pending", server=server, extractor=EXTRACTOR_WAITING)]
    ).status
    assert (st.phase, st.reason) == ("Pending", "ImagePullBackOff")
    assert "sglang" in st.message and "Back-off" in st.message
    assert cond(st, "Stalled") == "True"


def test_a_server_that_served_and_then_crash_loops_is_named() -> None:
    # The extractor started, so this server was ready once; the extractor's own retries decide then.
    server = {
        "started": False,
        "ready": False,
        "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "CUDA error"}},
    }
    out = run(job=job_json(), pods=[pod_json(server=server, extractor=EXTRACTOR_RUNNING)])
    st = out.status
    assert (st.phase, st.reason) == ("Starting", "ServerCrashLooping")
    assert "4 times" in st.message and not out.stop_job


LOG_TAIL = "Traceback (most recent call last):\nsafetensors_rust.SafetensorError: Error while deserializing header"


@pytest.mark.parametrize(
    "server",
    [
        # Restarted by the kubelet already: the exit is in lastState.
        {"started": False, "ready": False, "restartCount": 1, "state": {"running": {}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": LOG_TAIL}}},
        # Seen between the exit and the restart.
        {"started": False, "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": LOG_TAIL}}},
    ],
    ids=["restarted", "terminated"],
)  # fmt: skip
def test_a_server_that_exits_before_ready_fails_the_run_with_its_exit_code_and_log(server: dict[str, Any]) -> None:
    out = run(job=job_json(), pods=[pod_json(server=server, extractor=EXTRACTOR_WAITING)])
    st = out.status
    assert (st.phase, st.reason) == ("Failed", "ServerExited") and out.stop_job
    assert "server container sglang exited with code 1 (Error) before it was ready" in st.message, st.message
    assert st.message.endswith(LOG_TAIL) and st.completionTime == "2026-12-02T10:05:00Z"
    assert cond(st, "Failed") == "True"
    # Settled: observed again, the failed run stays as it is and nothing is stopped twice.
    again = run(prior=st, job=job_json(), pods=[pod_json(server=server, extractor=EXTRACTOR_WAITING)])
    assert (again.status.phase, again.status.reason) == ("Failed", "ServerExited") and not again.stop_job


def test_an_exit_by_oom_or_a_kill_says_so_and_a_silent_exit_says_it_left_no_log() -> None:
    def exited(code: int, reason: str) -> str:
        server = {"started": False, "ready": False, "restartCount": 1, "state": {"running": {}},
                  "lastState": {"terminated": {"exitCode": code, "reason": reason}}}  # fmt: skip
        return run(job=job_json(), pods=[pod_json(server=server, extractor=EXTRACTOR_WAITING)]).status.message

    assert "code 137 (OOMKilled)" in exited(137, "OOMKilled") and "startup probe" not in exited(137, "OOMKilled")
    assert "startup probe failed" in exited(137, "Error")
    assert exited(2, "Error").endswith("it left no log")


def test_a_server_exit_at_the_end_of_a_run_is_not_a_failure() -> None:
    # The kubelet stops the sidecar once the extractor has ended: that exit says nothing.
    server = {"started": True, "ready": False, "restartCount": 0,
              "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}  # fmt: skip
    extractor = {"ready": False, "restartCount": 0, "state": {"terminated": {"exitCode": 0}}}
    out = run(job=job_json(), pods=[pod_json(server=server, extractor=extractor)])
    assert out.status.reason != "ServerExited" and not out.stop_job


def test_loading_server_is_starting_then_running_when_ready() -> None:
    starting = run(job=job_json(), pods=[pod_json(server=SERVER_LOADING, extractor=EXTRACTOR_WAITING)]).status
    assert (starting.phase, starting.reason) == ("Starting", "ServerStarting")
    assert cond(starting, "ServerReady") == "False"
    running = run(
        prior=starting, job=job_json(), pods=[pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]
    ).status
    assert running.phase == "Running" and running.serverReadyTime == "2026-12-02T10:05:00Z"
    assert cond(running, "ServerReady") == "True" and cond(running, "Reconciling") == "True"


def test_progress_of_two_replicas_is_the_run_they_see_and_kept_after_one_ends() -> None:
    """Each replica reports the run's counts as it has seen them (shards are leased): the run's are the
    largest; tokens and pace are each replica's own work, summed; the ETA is what is left at that pace."""
    p0 = pod_json("xj-r1-0-a", index=0, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    p1 = pod_json("xj-r1-1-b", index=1, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    reports = {
        "xj-r1-0-a": {
            "samplesTotal": 50,
            "samplesDone": 20,
            "samplesQuarantined": 5,
            "tokensDone": 2000,
            "tokensPerSecond": 100.0,
            "samplesPerSecond": 0.25,
            "etaSeconds": 30,
            "state": "running",
        },
        "xj-r1-1-b": {
            "samplesTotal": 50,
            "samplesDone": 25,
            "tokensDone": 2500,
            "tokensPerSecond": 150.0,
            "samplesPerSecond": 0.25,
            "etaSeconds": 90,
            "state": "running",
        },
    }
    st = run(job=job_json(), pods=[p0, p1], progress=reports).status
    p = st.progress
    assert (p.samplesTotal, p.samplesDone, p.samplesQuarantined, p.tokensDone) == (50, 25, 5, 4500)
    assert p.tokensPerSecond == 250.0 and p.etaSeconds == 50 and p.eta == "50s" and p.percent == 50
    assert p.generationDecodeTokensPerSecond == 0.0  # not regenerating: nothing reported, nothing shown
    regenerating = {k: {**r, "generationDecodeTokensPerSecond": 40.0, "generationPrefillTokensPerSecond": 90.0}
                    for k, r in reports.items()}  # fmt: skip
    paced = run(job=job_json(), pods=[p0, p1], progress=regenerating).status
    assert paced.progress.generationDecodeTokensPerSecond == 80.0  # summed over the pods, like the capture's pace
    assert paced.progress.generationPrefillTokensPerSecond == 180.0
    assert [r.generationDecodeTokensPerSecond for r in paced.replicas] == [40.0, 40.0]
    assert [r.index for r in st.replicas] == [0, 1]
    # Replica 0 finished (its pod is gone from the poll); its numbers stay in the sum.
    p0_done = pod_json("xj-r1-0-a", index=0, phase="Succeeded")
    later = run(
        prior=st,
        job=job_json(),
        pods=[p0_done, p1],
        progress={"xj-r1-1-b": {**reports["xj-r1-1-b"], "samplesDone": 40}},
    ).status
    assert later.progress.samplesDone == 40 and later.progress.tokensDone == 4500
    # Only replica 1 was polled: its pace is the run's; replica 0's last pace is gone, not summed.
    assert later.progress.tokensPerSecond == 150.0 and later.progress.etaSeconds == 40
    assert [r.tokensPerSecond for r in later.replicas] == [0.0, 150.0]
    # A reconcile that reaches no extractor (pod restarting, poll timed out) shows no pace, not an old one.
    unreachable = run(prior=later, job=job_json(), pods=[p0_done, p1], progress={}).status
    assert unreachable.progress.tokensPerSecond == 0 and unreachable.progress.etaSeconds is None
    stale = run(prior=paced, job=job_json(), pods=[p0, p1], progress={}).status
    assert stale.progress.generationDecodeTokensPerSecond == 0  # an old generation pace is not shown either
    assert unreachable.progress.samplesDone == 40 and unreachable.progress.eta == ""


def test_a_replica_still_planning_shows_its_totals_so_far_and_no_eta() -> None:
    p0 = pod_json("xj-r1-0-a", index=0, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    p1 = pod_json("xj-r1-1-b", index=1, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    planned = {"samplesTotal": 50, "samplesDone": 20, "samplesPerSecond": 1.0, "state": "running"}
    reading = {"samplesTotal": 12, "samplesDone": 3, "etaSeconds": None, "planning": True, "state": "running"}
    st = run(job=job_json(), pods=[p0, p1], progress={"xj-r1-0-a": planned, "xj-r1-1-b": reading}).status
    assert st.progress.planning and st.progress.etaSeconds is None and st.progress.eta == ""
    assert [r.planning for r in st.replicas] == [False, True]
    assert "20/50 samples" in st.message and "planning: the dataset is still being read" in st.message
    # Once it stored its plan, the run's totals and ETA are the plan's.
    known = {**reading, "samplesTotal": 50, "samplesDone": 21, "planning": False, "samplesPerSecond": 0.0}
    later = run(prior=st, job=job_json(), pods=[p0, p1], progress={"xj-r1-0-a": planned, "xj-r1-1-b": known}).status
    assert not later.progress.planning and later.progress.etaSeconds == 29 and "planning" not in later.message


def test_planning_progress_uses_the_estimated_total_and_never_goes_backwards() -> None:
    p0 = pod_json("xj-r1-0-a", index=0, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    # Rows read so far: 10 placed, 9 done; the bytes read say the dataset holds about 100.
    early = {"samplesTotal": 10, "samplesDone": 9, "planning": True, "samplesTotalEstimate": 100,
             "samplesPerSecond": 1.0, "state": "running"}  # fmt: skip
    st = run(job=job_json(), pods=[p0], progress={"xj-r1-0-a": early}).status
    assert st.progress.percent == 9 and st.progress.etaSeconds == 91  # not 90% of the rows read so far
    # A later report whose estimate grew gives a lower ratio: the printed progress holds.
    later = {**early, "samplesTotal": 20, "samplesDone": 10, "samplesTotalEstimate": 200}
    again = run(prior=st, job=job_json(), pods=[p0], progress={"xj-r1-0-a": later}).status
    assert again.progress.percent == 9
    # No estimate (a compressed dataset): no ETA while planning, as before.
    blind = {**early, "samplesTotalEstimate": None}
    assert run(job=job_json(), pods=[p0], progress={"xj-r1-0-a": blind}).status.progress.etaSeconds is None


def test_final_progress_is_read_from_the_termination_message() -> None:
    term = {
        "state": {
            "terminated": {
                "exitCode": 0,
                "message": '{"samplesTotal": 10, "samplesDone": 10, "state": "succeeded"}',
            }
        }
    }
    done = job_json(
        conditions=[{"type": "Complete", "status": "True"}], completion_time="2026-12-02T10:04:00Z"
    )
    st = run(job=done, pods=[pod_json(phase="Succeeded", extractor=term)]).status
    assert st.phase == "Succeeded" and st.completionTime == "2026-12-02T10:04:00Z"
    assert st.progress.samplesDone == 10 and st.progress.percent == 100
    assert (
        cond(st, "Succeeded") == "True"
        and cond(st, "Reconciling") == "False"
        and cond(st, "Stalled") == "False"
    )


def test_written_and_quarantined_are_shown_apart_from_reports_to_history() -> None:
    p0 = pod_json("xj-r1-0-a", index=0, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    p1 = pod_json("xj-r1-1-b", index=1, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    reports = {
        "xj-r1-0-a": {"samplesTotal": 50, "samplesDone": 20, "samplesWritten": 17, "samplesQuarantined": 3},
        # An extractor from before samplesWritten: it finished 25, of which 4 quarantined.
        "xj-r1-1-b": {"samplesTotal": 50, "samplesDone": 25, "samplesQuarantined": 4},
    }
    st = run(job=job_json(), pods=[p0, p1], progress=reports).status
    assert [(r.samplesDone, r.samplesWritten, r.samplesQuarantined) for r in st.replicas] == [
        (20, 17, 3),
        (25, 21, 4),
    ]
    p = st.progress
    assert (p.samplesDone, p.samplesWritten, p.samplesQuarantined) == (25, 21, 4)
    assert st.phase == "Running" and "25/50 samples (21 written, 4 quarantined)" in st.message
    dumped = st.model_dump()["progress"]
    assert dumped["samplesWritten"] == 21 and dumped["samplesQuarantined"] == 4  # the printer columns' paths
    # The final report of a finished pod (its termination message) splits them the same way.
    term = {"state": {"terminated": {"exitCode": 0, "message": (
        '{"samplesTotal": 10, "samplesDone": 10, "samplesWritten": 8, "samplesQuarantined": 2, "state": "succeeded"}'
    )}}}  # fmt: skip
    done_job = job_json(
        conditions=[{"type": "Complete", "status": "True"}], completion_time="2026-12-02T10:04:00Z"
    )
    done = run(job=done_job, pods=[pod_json(phase="Succeeded", extractor=term)]).status
    assert (done.progress.samplesWritten, done.progress.samplesQuarantined, done.progress.percent) == (
        8,
        2,
        100,
    )
    record = run(spec=make_spec(runId="r2"), prior=done, generation=2).status.history[-1]
    assert (record.samplesDone, record.samplesWritten, record.samplesQuarantined) == (10, 8, 2)


def test_terminal_run_is_sticky_even_when_its_job_is_gone() -> None:
    done = run(job=job_json(conditions=[{"type": "Complete", "status": "True"}])).status
    later = run(prior=done, job=None, now=NOW + timedelta(hours=1), generation=2)
    assert later.status.phase == "Succeeded" and later.events == []
    assert not needs_job(later.status, None)
    assert later.status.observedGeneration == 2
    assert all(c.observedGeneration == 2 for c in later.status.conditions)


def test_job_lost_mid_run_fails_the_run_instead_of_restarting_it() -> None:
    running = run(job=job_json(), pods=[pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]).status
    lost = run(prior=running, job=None).status
    assert (lost.phase, lost.reason) == ("Failed", "JobDeleted")
    assert not needs_job(lost, None)


def test_permanent_failure_is_reported_with_the_exit() -> None:
    term = {"state": {"terminated": {"exitCode": 3, "message": "tokenizer fingerprint mismatch"}}}
    failed = job_json(
        failed=1,
        conditions=[
            {
                "type": "Failed",
                "status": "True",
                "reason": "PodFailurePolicy",
                "message": "Container extractor ... exit code 3",
            }
        ],
    )
    st = run(job=failed, pods=[pod_json(phase="Failed", extractor=term)]).status
    assert (st.phase, st.reason) == ("Failed", "PermanentFailure")
    assert "exited 3 (permanent failure)" in st.message and "fingerprint" in st.message
    assert st.attempt == 1  # the failed pod was the only attempt
    assert cond(st, "Failed") == "True" and cond(st, "Stalled") == "True"


def test_a_failed_preflight_fails_the_run_as_preflight_failed_with_its_words() -> None:
    term = {
        "state": {"terminated": {"exitCode": 3, "message": "preflight failed: dataset /d.jsonl: not found"}}
    }
    pod = pod_json(phase="Failed")
    pod["status"]["initContainerStatuses"] = [{"name": "preflight", **term}]
    failed = job_json(conditions=[{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}])
    st = run(job=failed, pods=[pod]).status
    assert (st.phase, st.reason) == ("Failed", "PreflightFailed")
    assert "preflight exited 3 (permanent failure)" in st.message and st.message.endswith(
        "/d.jsonl: not found"
    )


def test_failure_message_takes_the_error_from_the_final_progress() -> None:
    final = (
        '{"state": "failed", "samplesDone": 4, "lastError": "tokenizer fingerprint mismatch: want a, got b"}'
    )
    term = {"state": {"terminated": {"exitCode": 3, "message": final}}}
    failed = job_json(conditions=[{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}])
    st = run(job=failed, pods=[pod_json(phase="Failed", extractor=term)]).status
    assert "exited 3 (permanent failure)" in st.message
    assert st.message.endswith("tokenizer fingerprint mismatch: want a, got b") and "{" not in st.message
    assert st.progress.samplesDone == 4


@pytest.mark.parametrize("named", ["DatasetRejected", "CaptureInconsistent", "SomethingNew"])
def test_a_failure_the_extractor_names_is_the_status_reason(named: str) -> None:
    final = json.dumps({"state": "failed", "lastError": f"{named}: what went wrong", "failureReason": named})
    term = {"state": {"terminated": {"exitCode": 3, "message": final}}}
    failed = job_json(conditions=[{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}])
    st = run(job=failed, pods=[pod_json(phase="Failed", extractor=term)]).status
    # A name the operator does not know (a newer extractor) stays a PermanentFailure with its message.
    assert (st.phase, st.reason) == ("Failed", named if named != "SomethingNew" else "PermanentFailure")
    assert st.message.endswith(f"{named}: what went wrong")


def test_retries_count_as_attempts() -> None:
    st = run(job=job_json(failed=2), pods=[pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]).status
    assert st.attempt == 3


def test_startup_deadline_stops_the_run() -> None:
    spec = make_spec(startupDeadlineSeconds=60)
    pods = [pod_json(server=SERVER_LOADING, extractor=EXTRACTOR_WAITING)]
    early = run(spec=spec, job=job_json(), pods=pods, now=datetime(2026, 12, 2, 10, 0, 30, tzinfo=UTC))
    assert early.status.phase == "Starting" and not early.stop_job
    late = run(
        spec=spec,
        prior=early.status,
        job=job_json(),
        pods=pods,
        now=datetime(2026, 12, 2, 10, 1, 30, tzinfo=UTC),
    )
    assert late.stop_job and (late.status.phase, late.status.reason) == ("Failed", "StartupDeadlineExceeded")
    assert "ServerStarting" in late.status.message
    # The Job then fails with DeadlineExceeded; the recorded reason stays.
    after = run(
        spec=spec,
        prior=late.status,
        job=job_json(conditions=[{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]),
    )
    assert after.status.reason == "StartupDeadlineExceeded" and not after.stop_job


def test_the_startup_deadline_counts_from_the_jobs_start_not_its_time_in_a_queue() -> None:
    """Kueue held the Job two hours (created 10:00, admitted 12:00): its startup is bounded from 12:00."""
    spec = make_spec(startupDeadlineSeconds=60)
    pods = [pod_json(server=SERVER_LOADING, extractor=EXTRACTOR_WAITING)]
    admitted = job_json()
    admitted["status"]["startTime"] = "2026-12-02T12:00:00Z"
    early = run(spec=spec, job=admitted, pods=pods, now=datetime(2026, 12, 2, 12, 0, 30, tzinfo=UTC))
    assert early.status.phase == "Starting" and not early.stop_job and early.status.startTime == "2026-12-02T10:00:00Z"
    late = run(spec=spec, prior=early.status, job=admitted, pods=pods, now=datetime(2026, 12, 2, 12, 1, 30, tzinfo=UTC))
    assert late.stop_job and late.status.reason == "StartupDeadlineExceeded"
    unsynced = job_json()  # resumed, but the Job controller has not set its start yet
    del unsynced["status"]["startTime"]
    out = run(spec=spec, job=unsynced, pods=pods, now=datetime(2026, 12, 2, 12, 1, 30, tzinfo=UTC))
    assert not out.stop_job and out.status.phase == "Starting"


def test_ready_servers_are_not_subject_to_the_startup_deadline() -> None:
    spec = make_spec(startupDeadlineSeconds=60)
    out = run(
        spec=spec,
        job=job_json(),
        pods=[pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)],
        now=NOW + timedelta(hours=2),
    )
    assert out.status.phase == "Running" and not out.stop_job


def test_suspended_and_queued() -> None:
    st = run(spec=make_spec(suspend=True), job=job_json(suspend=True)).status
    assert (st.phase, st.reason) == ("Suspended", "Suspended") and cond(st, "Suspended") == "True"
    # Kueue's side (Queued only when Kueue holds the Job): tests/operator/test_observe_kueue.py.


def test_run_id_change_starts_a_new_run_and_records_the_old_one() -> None:
    done = run(job=job_json(conditions=[{"type": "Complete", "status": "True"}])).status
    second = run(spec=make_spec(runId="r2"), prior=done, job=None, generation=2)
    st = second.status
    assert (st.phase, st.observedRunId, st.jobName, st.output.prefix) == (
        "Pending",
        "r2",
        "xj-r2",
        "s3://out/hs/r2/",
    )
    assert [(h.runId, h.phase, h.outputPrefix) for h in st.history] == [
        ("r1", "Succeeded", "s3://out/hs/r1/")
    ]
    assert needs_job(st, None) and second.events[0].reason == "RunStarted"
    running = run(job=job_json(), pods=[pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]).status
    superseded = run(spec=make_spec(runId="r3"), prior=running).status
    assert superseded.history[-1].phase == "Superseded"


def test_unchanged_observation_changes_nothing_and_emits_nothing() -> None:
    pods = [pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]
    first = run(job=job_json(), pods=pods).status
    second = run(prior=first, job=job_json(), pods=pods, now=NOW + timedelta(seconds=30))
    assert second.events == []
    assert second.status.model_dump() == first.model_dump()


def test_condition_transition_time_moves_only_on_change() -> None:
    c1 = set_condition([], "Stalled", "False", "Progressing", "", 1, NOW)
    c2 = set_condition(c1, "Stalled", "False", "Progressing", "", 2, NOW + timedelta(minutes=1))
    assert c2[0].lastTransitionTime == c1[0].lastTransitionTime and c2[0].observedGeneration == 2
    c3 = set_condition(c2, "Stalled", "True", "ImagePullBackOff", "x", 2, NOW + timedelta(minutes=2))
    assert c3[0].lastTransitionTime == "2026-12-02T10:07:00Z"


def test_human_duration() -> None:
    assert [human_duration(s) for s in (None, 5, 65, 3725, 90000)] == ["", "5s", "1m5s", "1h2m", "1d1h"]


def test_replica_status_takes_its_fields_from_the_progress_contract() -> None:
    from hsx_extractor.contract import ProgressReport
    from hsx_operator.status import ReplicaStatus

    assert set(ReplicaStatus.model_fields) - {"index", "pod"} <= set(ProgressReport.model_fields)


def test_quarantined_samples_are_announced_once_and_named_in_the_final_message() -> None:
    pod = pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    clean = run(
        job=job_json(), pods=[pod], progress={pod["metadata"]["name"]: {"samplesTotal": 10, "samplesDone": 2}}
    )
    assert not [n for n in clean.events if n.reason == "SamplesQuarantined"]
    report = {"samplesTotal": 10, "samplesDone": 4, "samplesQuarantined": 1}
    first = run(prior=clean.status, job=job_json(), pods=[pod], progress={pod["metadata"]["name"]: report})
    (note,) = [n for n in first.events if n.reason == "SamplesQuarantined"]
    assert note.type == "Warning" and note.message.startswith("1 sample(s) quarantined")
    report = {**report, "samplesDone": 6, "samplesQuarantined": 2}
    again = run(prior=first.status, job=job_json(), pods=[pod], progress={pod["metadata"]["name"]: report})
    assert not [n for n in again.events if n.reason == "SamplesQuarantined"]  # once, not per sample
    term = {
        "state": {
            "terminated": {
                "exitCode": 0,
                "message": json.dumps({**report, "samplesDone": 10, "state": "succeeded"}),
            }
        }
    }
    done = job_json(
        conditions=[{"type": "Complete", "status": "True"}], completion_time="2026-12-02T10:04:00Z"
    )
    st = run(prior=again.status, job=done, pods=[pod_json(phase="Succeeded", extractor=term)]).status
    assert st.phase == "Succeeded" and st.message.endswith("2 sample(s) quarantined (listed in the manifest)")


def test_shards_show_committed_leased_and_free_and_a_scale_patches_only_a_job_of_another_size() -> None:
    from hsx_operator.pods import scale_patch

    p0 = pod_json("xj-r1-0-a", index=0, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    p1 = pod_json("xj-r1-1-b", index=1, server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    seen = {"samplesTotal": 100, "shardsTotal": 10, "shardsCommitted": 4, "state": "running"}
    reports = {"xj-r1-0-a": {**seen, "shardsLeased": 2}, "xj-r1-1-b": {**seen, "shardsCommitted": 3, "shardsLeased": 1}}
    p = run(job=job_json(), pods=[p0, p1], progress=reports).status.progress
    assert (p.shardsCommitted, p.shardsLeased, p.shards) == (4, 3, "4/10 (3 leased, 3 free)")
    finished = {k: {**v, "shardsCommitted": 10, "shardsLeased": 0, "state": "succeeded"} for k, v in reports.items()}
    assert run(job=job_json(), pods=[p0, p1], progress=finished).status.progress.shards == "10/10"
    job = {"spec": {"parallelism": 2, "completions": 2}}
    assert scale_patch(job, 2) is None
    assert scale_patch(job, 4) == {"spec": {"completions": 4, "parallelism": 4}}
