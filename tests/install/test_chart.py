"""The Helm chart, offline: lint, schema, Kubernetes API schemas, defaults, and agreement with the operator."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator.cluster_defaults import ClusterDefaults
from hsx_operator.main import build_parser
from tests.install.chart import CHART, CRDS, chart_meta, find, helm, render, render_text

KUBE_VERSION = (1, 37)
# Sets of values that between them render every template and branch.
VALUE_SETS: dict[str, dict[str, str]] = {
    "defaults": {},
    "namespaced": {"rbac.namespaced": "true", "watchNamespaces": "{ml,research}"},
    "cluster-wide": {"rbac.namespaced": "false"},
    "peering": {
        "rbac.namespaced": "false",
        "replicaCount": "2",
        "peering.enabled": "true",
        "logLevel": "debug",
        "metrics.serviceMonitor.enabled": "true",
        "policy.allowedHostPaths": "{/mnt/models,/data}",
        "policy.allowedPriorityClasses": "{system-cluster-critical}",
        "policy.allowedImagePrefixes": "{registry.example.com/ml/,ghcr.io/hsx-dev/}",
    },
    "observability": {
        "metrics.extractorPodMonitor.enabled": "true",
        "metrics.grafanaDashboard.enabled": "true",
        "watchNamespaces": "{ml}",
    },
    "no-metrics-service": {
        "metrics.service.enabled": "false",
        "serviceAccount.create": "false",
        "serviceAccount.name": "ops",
    },
    "cluster-defaults": {
        "clusterDefaults.imageRegistry": "registry.example.com/mirror/hsx",
        "clusterDefaults.imagePullSecrets": "{mirror-pull}",
        "clusterDefaults.tolerations[0].key": "nvidia.com/gpu",
        "clusterDefaults.tolerations[0].operator": "Exists",
        "clusterDefaults.nodeSelector.pool": "gpu",
        "clusterDefaults.queueName": "team-queue",
        "clusterDefaults.s3.endpoint": "https://s3.internal.example.com",
        "clusterDefaults.s3.pathStyle": "true",
    },
}


PROMETHEUS_OPERATOR_KINDS = ("ServiceMonitor", "PodMonitor")


def test_chart_crds_are_a_copy_of_the_repository_crds() -> None:
    chart_crds = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    repo_crds = {p.name: p.read_bytes() for p in CRDS.glob("*.yaml")}
    assert repo_crds, "crds/ is empty: run `make crds`"
    stale = sorted(n for n in repo_crds.keys() | chart_crds.keys() if repo_crds.get(n) != chart_crds.get(n))
    assert not stale, f"charts/hsx/crds differs from crds/ in {stale}: run `cp crds/*.yaml charts/hsx/crds/`"


def test_helm_lint_strict_is_clean() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def closest_validate_version() -> str:
    from kubernetes_validate.utils import all_versions

    def distance(v: str) -> tuple[int, int]:
        major, minor = (int(x) for x in v.split(".")[:2])
        return abs(major - KUBE_VERSION[0]), abs(minor - KUBE_VERSION[1])

    return min(all_versions(), key=distance)


def kubernetes_validate(path: Path) -> subprocess.CompletedProcess[str]:
    argv = [
        str(Path(sys.executable).parent / "kubernetes-validate"),
        "-k",
        closest_validate_version(),
        "--strict",
        str(path),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_pass_the_kubernetes_api_schemas(name: str, tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render_text(VALUE_SETS[name]))
    result = kubernetes_validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = result.stdout.count(" passed for resource ")
    assert passed == sum(
        1 for d in yaml.safe_load_all(rendered.read_text()) if d and d["kind"] not in PROMETHEUS_OPERATOR_KINDS
    )
    # The only kinds without a built-in schema are the Prometheus Operator's.
    unknown = [
        line for line in (result.stdout + result.stderr).splitlines() if "Couldn't find schema" in line
    ]
    assert all(any(k in line for k in PROMETHEUS_OPERATOR_KINDS) for line in unknown), unknown


def test_the_validator_rejects_a_broken_manifest(tmp_path: Path) -> None:
    # Control: the validation above can fail.
    docs = render()
    deployment = find(docs, "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonRot"] = True
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(deployment))
    result = kubernetes_validate(broken)
    assert result.returncode != 0
    assert "runAsNonRot" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"logLevl": "debug"}, "additional properties 'logLevl' not allowed"),
        ({"metrics.prot": "9000"}, "additional properties 'prot' not allowed"),
        ({"logLevel": "trace"}, "logLevel"),
        ({"securityContext.privileged": "true"}, "privileged"),
        ({"replicaCount": "7"}, "replicaCount"),
    ],
)
def test_bad_values_fail_with_the_schema_message(values: dict[str, str], message: str) -> None:
    from tests.install.chart import set_args

    result = helm("template", "hsx", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": "2"}, "replicaCount > 1 needs peering.enabled=true"),
        (
            {"metrics.service.enabled": "false", "metrics.serviceMonitor.enabled": "true"},
            "needs metrics.service.enabled",
        ),
    ],
)
def test_broken_combinations_fail_with_a_message(values: dict[str, str], message: str) -> None:
    from tests.install.chart import set_args

    result = helm("template", "hsx", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_defaults_are_pinned_hardened_and_probed() -> None:
    docs = render()
    app_version = chart_meta()["appVersion"]
    (deployment,) = find(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(docs)
    assert container["image"] == f"ghcr.io/hsx-dev/hsx-operator:{app_version}"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    health_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--liveness=http://0.0.0.0:{health_port}/healthz" in container["args"]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert not find(docs, "PodDisruptionBudget") and not find(docs, "ServiceMonitor")


def test_the_operator_accepts_the_arguments_the_chart_passes() -> None:
    for name, values in VALUE_SETS.items():
        container = operator_container(render(values))
        assert container["command"] == ["hsx-operator"], name
        args = build_parser().parse_args(container["args"])
        metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        assert args.metrics_port == metrics_port, name
        watched = [n for n in values.get("watchNamespaces", "{}").strip("{}").split(",") if n]
        # Namespaced (the default) watches the release's namespace unless told others; cluster-wide, all.
        namespaced = values.get("rbac.namespaced", "true") == "true"
        assert args.namespace == (watched or (["hsx-system"] if namespaced else [])), name
        assert args.all_namespaces == (not args.namespace)
        assert args.verbose == (values.get("logLevel") == "debug")
        assert bool(args.peering) == (values.get("peering.enabled") == "true")
        host_paths = values.get("policy.allowedHostPaths", "{}").strip("{}")
        assert args.allow_host_path == [p for p in host_paths.split(",") if p], name
        classes = values.get("policy.allowedPriorityClasses", "{}").strip("{}")
        assert args.allow_priority_class == [c for c in classes.split(",") if c], name
        images = values.get("policy.allowedImagePrefixes", "{}").strip("{}")
        assert args.allow_image_prefix == [i for i in images.split(",") if i], name
        defaults = ClusterDefaults.from_json(args.cluster_defaults)  # what the operator does at start
        if name == "cluster-defaults":
            assert defaults.imageRegistry == "registry.example.com/mirror/hsx" and defaults.imagePullSecrets == ["mirror-pull"]
            assert defaults.tolerations[0].key == "nvidia.com/gpu" and defaults.nodeSelector == {"pool": "gpu"}
            assert defaults.s3 is not None and defaults.s3.pathStyle is True and defaults.queueName == "team-queue"
        else:
            assert defaults == ClusterDefaults(), name


def rules_of(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (group, res)
        for rule in doc.get("rules", [])
        for group in rule["apiGroups"]
        for res in rule["resources"]
    }


def test_namespaced_install_grants_job_rights_only_in_the_listed_namespaces() -> None:
    docs = render(VALUE_SETS["namespaced"])
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert sorted(b["metadata"]["namespace"] for b in find(docs, "RoleBinding")) == ["ml", "research"]
    for role in find(docs, "ClusterRole"):
        assert not rules_of(role) & {("batch", "jobs"), ("", "pods"), ("hsx.dev", "extractionjobs")}, role
        verbs = {v for rule in role["rules"] for v in rule["verbs"]}
        assert verbs <= {"get", "list", "watch"}, "cluster-wide rights must be read-only"


def test_the_default_install_manages_only_its_own_namespace() -> None:
    docs = render()
    assert [r["metadata"]["namespace"] for r in find(docs, "Role")] == ["hsx-system"]
    assert [b["metadata"]["namespace"] for b in find(docs, "RoleBinding")] == ["hsx-system"]
    for role in find(docs, "ClusterRole"):  # only discovery: read-only, no jobs, pods or runs
        assert not rules_of(role) & {("batch", "jobs"), ("", "pods"), ("hsx.dev", "extractionjobs")}, role
    assert "--namespace=hsx-system" in operator_container(docs)["args"]


def test_cluster_wide_install_binds_one_cluster_role_to_the_service_account() -> None:
    docs = render(VALUE_SETS["cluster-wide"])
    assert not find(docs, "Role")
    (sa,) = find(docs, "ServiceAccount")
    bindings = find(docs, "ClusterRoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == {
        r["metadata"]["name"] for r in find(docs, "ClusterRole")
    }
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "hsx-system"}
        ]
    main = max(find(docs, "ClusterRole"), key=lambda r: len(r["rules"]))
    assert {("batch", "jobs"), ("hsx.dev", "extractionjobs/status"), ("", "configmaps")} <= rules_of(main)
    assert not any("*" in v for rule in main["rules"] for v in rule["verbs"] + rule["resources"])
    assert ("", "secrets") not in rules_of(main), "the operator never reads Secrets"


def test_peering_renders_pdb_rolling_update_and_peering_rights() -> None:
    docs = render(VALUE_SETS["peering"])
    (pdb,) = find(docs, "PodDisruptionBudget")
    (deployment,) = find(docs, "Deployment")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert any(("kopf.dev", "clusterkopfpeerings") in rules_of(r) for r in find(docs, "ClusterRole"))
    (monitor,) = find(docs, "ServiceMonitor")
    (service,) = find(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()


def test_crd_default_images_follow_the_app_version() -> None:
    app_version = chart_meta()["appVersion"]
    crd = yaml.safe_load((CHART / "crds" / "extractionjobs.hsx.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # The images default in the operator (the cluster's defaults first), so the CRD names hsx's in the descriptions.
    from hsx_operator.api import DEFAULT_EXTRACTOR_IMAGE, DEFAULT_SERVER_IMAGES

    image = DEFAULT_EXTRACTOR_IMAGE
    assert "default" not in spec["extractor"]["properties"]["image"]
    assert image.startswith("ghcr.io/hsx-dev/") and image.endswith(f":{app_version}"), image
    assert image in spec["extractor"]["properties"]["image"]["description"]

    described = spec["server"]["properties"]["image"]["description"]
    for engine, image in DEFAULT_SERVER_IMAGES.items():
        assert image.startswith("ghcr.io/hsx-dev/") and image.endswith(f":{app_version}"), image
        assert f"{engine}: {image}" in described, (engine, described)


def test_notes_tell_the_next_steps() -> None:
    result = helm("install", "hsx", str(CHART), "--dry-run=client", "--namespace", "hsx-system")
    notes = result.stdout.split("NOTES:", 1)[1]
    for step in ("rollout status", "helm test hsx -n hsx-system", "examples/minimal.yaml", "hsx estimate", "runId",
                 "argocd-health.lua"):  # fmt: skip
        assert step in notes, step
    # The commands it shows are real: hsx's own parser accepts them (it printed --aux-layers, no such flag).
    from hsx_extractor.tools.cli import parser

    (estimate,) = [line.split() for line in notes.splitlines() if line.strip().startswith("hsx estimate")]
    args = parser().parse_args(estimate[1:])
    assert args.dataset == "data.jsonl" and str(args.model) == "/path/to/model"


def test_network_policy_admits_only_the_operator_to_the_pods_it_makes() -> None:
    from hsx_operator.desired import Owner, desired_job
    from tests.operator.helpers import make_spec

    docs = render(VALUE_SETS["namespaced"])
    policies = find(docs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["ml", "research"]
    job = desired_job(Owner(name="xj", namespace="ml", uid="u"), make_spec())
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    operator_pod = find(docs, "Deployment")[0]["spec"]["template"]["metadata"]
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()  # selects the run's pods
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "hsx-system"}
        assert peer["podSelector"]["matchLabels"].items() <= operator_pod["labels"].items()
    # Without watchNamespaces the policy guards the release's namespace; it can be switched off.
    assert [p["metadata"]["namespace"] for p in find(render(), "NetworkPolicy")] == ["hsx-system"]
    assert not find(render({"networkPolicy.enabled": "false"}), "NetworkPolicy")


@pytest.mark.parametrize(("values", "target"), [("defaults", "hsx-system"), ("namespaced", "ml")])
def test_helm_test_probes_a_watched_namespace_with_rights_only_there(values: str, target: str) -> None:
    tests = [
        d
        for d in render(VALUE_SETS[values], with_tests=True)
        if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    assert sorted(d["kind"] for d in tests) == ["Pod", "Role", "RoleBinding", "ServiceAccount"]
    (pod,) = find(tests, "Pod")
    (role,) = find(tests, "Role")
    (sa,) = find(tests, "ServiceAccount")
    (operator,) = find(render(VALUE_SETS[values]), "Deployment")
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "hsx_operator.selftest", "--namespace", target]
    assert container["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["securityContext"] == operator["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"] and pod["spec"]["restartPolicy"] == "Never"
    assert role["metadata"]["namespace"] == target
    assert rules_of(role) == {("hsx.dev", "extractionjobs"), ("batch", "jobs")}
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"create", "get", "delete"}
    # Not counted as the operator by its NetworkPolicy peer or PodDisruptionBudget.
    selector = operator["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["labels"]


def exported_metric_names() -> set[str]:
    """Every series name the extractor and the operator expose (counters with _total, histograms' _bucket)."""
    from prometheus_client import REGISTRY

    import hsx_operator.metrics  # noqa: F401  (registers the operator's series)
    from hsx_extractor.run.progress import Metrics

    names = set()
    for registry in (Metrics().registry, REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            # A labelled series has no samples until its first label value: its names from its type.
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
            names.update(family.name + s for s in suffixes)
    return names


def test_the_dashboard_and_pod_monitor_read_what_hsx_exports() -> None:
    docs = render({"metrics.extractorPodMonitor.enabled": "true", "metrics.grafanaDashboard.enabled": "true"})
    (monitor,) = find(docs, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["hsx-system"]}  # where runs are managed
    wide = render({"metrics.extractorPodMonitor.enabled": "true", "rbac.namespaced": "false"})
    assert find(wide, "PodMonitor")[0]["spec"]["namespaceSelector"] == {"any": True}
    from hsx_operator.desired import Owner, desired_job
    from tests.operator.helpers import make_spec

    pod = desired_job(Owner(name="xj", namespace="ml", uid="u"), make_spec())["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    (dashboard,) = [c for c in find(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["hsx.json"])["panels"]
    queried = {name for p in panels for t in p["targets"] for name in re.findall(r"\bhsx_[a-z_]+", t["expr"])}
    assert len(panels) >= 8 and queried and queried <= exported_metric_names(), queried - exported_metric_names()
    for wanted in ("hsx_tokens_done_total", "hsx_samples_quarantined_total", "hsx_bytes_committed_total",
                   "hsx_shard_seal_seconds_bucket"):  # fmt: skip
        assert wanted in queried
