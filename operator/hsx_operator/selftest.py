"""``python -m hsx_operator.selftest``: the chart's `helm test`. Proves an install works end to end without
spending a GPU: a suspended ExtractionJob is created in a watched namespace (the API server admits it: CRD and
CEL rules served), the operator must answer with a status for it and a suspended Job (it watches that
namespace, may create Jobs there, writes status), then the ExtractionJob is deleted and must go (the operator
lifts its finalizer; the Job goes with its owner). Exit 0, or 1 with what is wrong."""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException

from hsx_operator.api import GROUP, PLURAL, VERSION


class SelfTestFailed(Exception):
    """The install does not work; the message says what was seen."""


def probe_manifest(name: str, namespace: str) -> dict[str, Any]:
    """A valid run that never starts: suspended, so its Job is created without pods."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ExtractionJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runId": "selftest",
            "suspend": True,
            "model": {"path": "/models/selftest", "source": {"pvc": {"claimName": "hsx-selftest-none"}}},
            "server": {"gpus": 1},
            "dataset": {"uri": "s3://hsx-selftest/none.jsonl"},
            "output": {"uri": "s3://hsx-selftest/out"},
        },
    }


def _until(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SelfTestFailed(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(1)


def run(namespace: str, timeout_s: float, say: Callable[[str], None]) -> None:
    try:
        _run(namespace, timeout_s, say)
    except ApiException as exc:
        raise SelfTestFailed(f"the API server answered {exc.status} {exc.reason}: {exc.body}") from exc


def _run(namespace: str, timeout_s: float, say: Callable[[str], None]) -> None:
    api = kubernetes.client.CustomObjectsApi()
    batch = kubernetes.client.BatchV1Api()
    name = f"hsx-selftest-{uuid.uuid4().hex[:6]}"
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, probe_manifest(name, namespace))
    except ApiException as exc:
        raise SelfTestFailed(f"the API server refused ExtractionJob {namespace}/{name}: {exc.status} {exc.body}") from exc
    say(f"created suspended ExtractionJob {namespace}/{name}")
    try:

        def answered() -> dict[str, Any] | None:
            xj = cast(dict[str, Any], api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
            status: dict[str, Any] = xj.get("status") or {}
            return status if status.get("observedGeneration") == xj["metadata"]["generation"] else None

        status = _until(
            f"no operator wrote the status of {namespace}/{name} (is it running, and does it watch {namespace}?)",
            answered,
            timeout_s,
        )
        if status.get("phase") != "Suspended":
            raise SelfTestFailed(
                f"the operator reported phase {status.get('phase')} ({status.get('reason')}: "
                f"{status.get('message')}), expected Suspended"
            )
        job_name = status.get("jobName") or ""
        try:
            job = batch.read_namespaced_job(job_name, namespace) if job_name else None
        except ApiException as exc:
            if exc.status != 404:
                raise
            job = None
        if job is None or job.spec is None or not job.spec.suspend:
            raise SelfTestFailed(f"the operator reported Suspended but Job {job_name!r} is missing or running")
        say(f"the operator answered: phase Suspended, Job {job_name} created suspended")
    finally:
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def gone() -> bool:
        try:
            api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    _until(f"ExtractionJob {namespace}/{name} was not deleted (its finalizer stays)", gone, timeout_s)
    say(f"deleted {namespace}/{name}; the install works")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx_operator.selftest", description=__doc__)
    parser.add_argument("--namespace", required=True, help="a namespace the operator watches")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer")
    args = parser.parse_args(argv)
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    try:
        run(args.namespace, args.timeout, lambda line: print(f"hsx selftest: {line}", flush=True))
    except SelfTestFailed as exc:
        print(f"hsx selftest FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
