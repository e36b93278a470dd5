"""Reading and writing the test namespace's objects as the admin (plain dicts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.ground.wait import wait_for


def xj_manifest(
    name: str, run_id: str, *, model_root: Path, dataset: Path, output: Path, **spec: Any
) -> dict[str, Any]:
    """An ExtractionJob for the tiny model; `spec` entries replace (or, for dicts, extend) the defaults."""
    base: dict[str, Any] = {
        "runId": run_id,
        "model": {"path": "/models/tiny", "source": {"hostPath": {"path": str(model_root)}}},
        "server": {"startupTimeoutSeconds": 120, "extraArgs": ["--delay-ms", "30"]},
        "dataset": {"uri": str(dataset)},
        "output": {"uri": str(output), "shardTargetBytes": 1 << 20},
        "concurrency": 4,
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return {
        "apiVersion": "hsx.dev/v1alpha1",
        "kind": "ExtractionJob",
        "metadata": {"name": name},
        "spec": base,
    }


class Namespace:
    """One test namespace, seen through kubectl as the cluster admin."""

    def __init__(self, cluster: Any, name: str):
        self.cluster = cluster
        self.name = name

    def kubectl(self, *args: str, **kw: Any) -> Any:
        return self.cluster.kubectl("-n", self.name, *args, **kw)

    def apply(self, manifest: dict[str, Any]) -> str:
        return str(self.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest)).stdout)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.kubectl("get", kind, name, "-o", "json", "--ignore-not-found", check=False)
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None

    def forbid_pods(self) -> None:
        """A ResourceQuota of no pods, in force: every pod create in the namespace is refused (FailedCreate)."""
        self.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"},
                    "spec": {"hard": {"pods": "0"}}})  # fmt: skip
        wait_for(lambda: (self.get("resourcequota", "no-pods") or {}).get("status", {}).get("hard"), 60, "the quota")

    def items(self, kind: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json"] + (["-l", selector] if selector else [])
        return json.loads(self.kubectl(*args).stdout)["items"]  # type: ignore[no-any-return]

    def status(self, name: str) -> dict[str, Any]:
        xj = self.get("xj", name)
        return (xj or {}).get("status") or {}

    def pods_of(self, job: str) -> list[dict[str, Any]]:
        return self.items("pods", f"batch.kubernetes.io/job-name={job}")

    def event_reasons(self, name: str) -> list[str]:
        events = self.items("events")
        mine = [
            e
            for e in events
            if e["involvedObject"].get("name") == name and e["involvedObject"].get("kind") == "ExtractionJob"
        ]
        return [
            e["reason"]
            for e in sorted(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        ]
