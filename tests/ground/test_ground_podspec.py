"""The node agent's pure parts: env, argv, volume files, probe defaults, pod status."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.ground.podspec import (
    ContainerStatus,
    PodSpecError,
    PodView,
    ProbeSpec,
    configmap_data,
    container_argv,
    container_env,
    decoded_secret_data,
    downward_files,
    exit_code_of,
    expand_refs,
    field_value,
    identity,
    key_files,
    parse_quantity,
    pod_phase,
    pod_status,
    resolve_port,
    should_restart,
    traversal_barrier,
)
from tests.ground.tools import ToolMissing, candidate_paths, module_version, tool_path

POD = {
    "metadata": {
        "name": "p",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "x"},
        "annotations": {"a": "b"},
    },
    "spec": {"nodeName": "n1", "serviceAccountName": "sa"},
    "status": {"podIP": "10.244.0.7", "hostIP": "10.244.0.1"},
}


def lookup(objects: dict[str, dict[str, bytes]]):
    return objects.get


def test_expand_refs_follows_kubernetes_rules():
    env = {"A": "1", "B": "two"}
    assert expand_refs("$(A)-$(B)", env) == "1-two"
    assert expand_refs("$(MISSING)", env) == "$(MISSING)"
    assert expand_refs("$$(A) costs $$5", env) == "$(A) costs $5"


@given(st.text(alphabet=st.characters(blacklist_characters="$")))
def test_text_without_dollar_is_unchanged(text):
    assert expand_refs(text, {"A": "x"}) == text


def test_field_values():
    assert field_value(POD, "metadata.name") == "p"
    assert field_value(POD, "status.podIP") == "10.244.0.7"
    assert field_value(POD, "metadata.labels['app']") == "x"
    assert field_value(POD, "metadata.annotations") == 'a="b"'
    with pytest.raises(PodSpecError, match="not supported"):
        field_value(POD, "spec.bogus")


def test_container_env_precedence_and_sources():
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "C_"}, {"secretRef": {"name": "s"}}],
        "env": [
            {"name": "TOKEN", "value": "override"},
            {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope", "optional": True}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "DERIVED", "value": "$(NS)/$(FROM_CM)"},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
        ],
        "resources": {"limits": {"memory": "1Gi"}},
    }
    env = container_env(
        container,
        POD,
        configmap=lookup({"cm": {"k": b"v"}}),
        secret=lookup({"s": {"TOKEN": b"secret"}}),
        base={"PATH": "/bin", "C_k": "base"},
    )
    assert env == {
        "PATH": "/bin",
        "C_k": "v",
        "TOKEN": "override",
        "FROM_CM": "v",
        "NS": "ns",
        "DERIVED": "ns/v",
        "MEM": "1024",
    }


def test_missing_required_key_is_a_clear_config_error():
    container = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(PodSpecError, match="secret 's' not found") as caught:
        container_env(container, POD, configmap=lookup({}), secret=lookup({}), base={})
    assert caught.value.reason == "CreateContainerConfigError"


def test_argv_from_command_args_or_rewrite():
    container = {"name": "c", "command": ["run", "$(X)"], "args": ["--flag=$(X)"]}
    assert container_argv(container, {"X": "1"}, None) == ["run", "1", "--flag=1"]
    assert container_argv(container, {"X": "1"}, ["other"]) == ["other"]
    with pytest.raises(PodSpecError, match="no command"):
        container_argv({"name": "c", "args": ["x"]}, {}, None)


def test_volume_key_files_and_items():
    data = {"a": b"1", "b": b"2"}
    all_files = key_files(data, None, 0o644, what="configmap 'x'", optional=False)
    assert [(f.path, f.content, f.mode) for f in all_files] == [("a", b"1", 0o644), ("b", b"2", 0o644)]
    picked = key_files(
        data, [{"key": "b", "path": "sub/b.txt", "mode": 0o400}], 0o644, what="x", optional=False
    )
    assert [(f.path, f.content, f.mode) for f in picked] == [("sub/b.txt", b"2", 0o400)]
    assert key_files(None, None, 0o644, what="x", optional=True) == []
    with pytest.raises(PodSpecError, match="not found"):
        key_files(None, None, 0o644, what="configmap 'x'", optional=False)


def test_secret_and_configmap_decoding():
    secret = {"data": {"k": base64.b64encode(b"\x00bin").decode()}, "stringData": {"s": "plain"}}
    assert decoded_secret_data(secret) == {"k": b"\x00bin", "s": b"plain"}
    configmap = {"data": {"t": "text"}, "binaryData": {"b": base64.b64encode(b"\xff").decode()}}
    assert configmap_data(configmap) == {"t": b"text", "b": b"\xff"}


def test_downward_files():
    files = downward_files(POD, [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}], 0o644)
    assert [(f.path, f.content) for f in files] == [("name", b"p")]


def test_quantities_ports_and_restart_rules():
    assert parse_quantity("500m") == parse_quantity("0.5")
    assert parse_quantity("2Gi") == 2 * 2**30
    with pytest.raises(PodSpecError):
        parse_quantity("lots")
    assert resolve_port("http", {"ports": [{"name": "http", "containerPort": 8080}]}) == 8080
    assert resolve_port(30000, {}) == 30000
    with pytest.raises(PodSpecError, match="named port"):
        resolve_port("grpc", {"ports": []})
    assert should_restart("OnFailure", 1) and not should_restart("OnFailure", 0)
    assert should_restart("Always", 0) and not should_restart("Never", 1)
    assert exit_code_of(-9) == 137 and exit_code_of(3) == 3


def test_probe_defaults():
    probe = ProbeSpec.parse({"httpGet": {"port": 1}})
    assert probe is not None
    assert (probe.period_s, probe.timeout_s, probe.failure_threshold, probe.success_threshold) == (
        10,
        1,
        3,
        1,
    )
    assert ProbeSpec.parse(None) is None


def _view(**changes) -> PodView:
    base = {
        "init": [ContainerStatus("side", "img", state="running", ready=True, started=True)],
        "main": [ContainerStatus("main", "img", state="running", ready=True, started=True)],
        "sandbox_ready": True,
        "initialized": True,
        "terminal_phase": None,
        "pod_ip": "10.244.0.9",
        "host_ip": "10.244.0.1",
        "start_time": "2026-01-01T00:00:00Z",
        "previous_conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
            {"type": "Ready", "status": "True", "lastTransitionTime": "t1"},
        ],
    }
    return PodView(**{**base, **changes})


def test_pod_status_shape_and_condition_times():
    status = pod_status(_view(), sidecars=[True])
    assert status["phase"] == "Running"
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["status"] == "True" and by_type["Ready"]["lastTransitionTime"] == "t1"
    assert by_type["PodScheduled"]["lastTransitionTime"] == "t0"  # not ours: kept as the scheduler set it
    assert status["podIP"] == "10.244.0.9"
    assert status["initContainerStatuses"][0]["state"] == {"running": {"startedAt": None}}


def test_sidecar_not_ready_makes_pod_not_ready_until_terminal():
    side = ContainerStatus("side", "img", state="running", ready=False, started=True)
    status = pod_status(_view(init=[side]), sidecars=[True])
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] != "t1"


def test_phases():
    waiting = ContainerStatus("main", "img")
    assert pod_phase(_view(main=[waiting], initialized=False)) == "Pending"
    assert pod_phase(_view()) == "Running"
    assert pod_phase(_view(terminal_phase="Succeeded")) == "Succeeded"


def test_terminated_status_has_exit_code_and_reason():
    status = ContainerStatus("c", "img", state="terminated", reason="Error", exit_code=137, restart_count=2)
    api = status.as_api()
    assert api["state"]["terminated"]["exitCode"] == 137
    assert api["state"]["terminated"]["reason"] == "Error"
    assert api["restartCount"] == 2


def test_go_mod_versions_are_read_in_both_forms():
    text = "module x\n\nrequire helm.sh/helm/v4 v4.3.2\n\nrequire (\n\tk8s.io/kubernetes v1.37.2\n)\n"
    assert module_version(text, "helm.sh/helm/v4") == "v4.3.2"
    assert module_version(text, "k8s.io/kubernetes") == "v1.37.2"
    assert module_version(text, "k8s.io/api") is None


def test_missing_tool_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HSX_CACHE", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    with pytest.raises(ToolMissing, match="make test-tools"):
        tool_path("kube-apiserver")
    assert candidate_paths("etcd")[-1].parent.name.startswith("etcd-v")
    with pytest.raises(ValueError, match="unknown test tool"):
        tool_path("kubelet")


def test_kubebuilder_assets_win(tmp_path, monkeypatch):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    assert tool_path("etcd") == fake


def test_identity_merges_pod_and_container_security_contexts():
    pod = {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000, "supplementalGroups": [2000, 5]}}
    container = {"name": "c", "securityContext": {"runAsUser": 65532, "capabilities": {"drop": ["ALL"], "add": ["NET_RAW"]}}}
    ident = identity(pod, container)
    assert (ident.uid, ident.gid, ident.groups) == (65532, 1000, (2000, 5))
    assert ident.capabilities == {"NET_RAW"} and not ident.no_new_privs and not ident.read_only_root
    assert ident.setpriv_argv() == [
        "setpriv", "--reuid=65532", "--regid=1000", "--groups=2000,5", "--bounding-set=-all,+net_raw",
        "--inh-caps=-all", "--",
    ]  # fmt: skip
    plain = identity({}, {"name": "c"})
    assert (plain.uid, plain.gid, plain.groups, plain.home) == (0, 0, (), "/root")
    assert "DAC_OVERRIDE" in plain.capabilities and "--clear-groups" in plain.setpriv_argv()
    strict = identity({}, {"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["cap_chown"]}}})
    assert strict.no_new_privs and "CHOWN" not in strict.capabilities and "KILL" in strict.capabilities


@pytest.mark.parametrize(
    ("pod_ctx", "ctx"),
    [({"runAsNonRoot": True}, {}), ({}, {"runAsNonRoot": True, "runAsUser": 0}), ({"runAsNonRoot": True, "runAsUser": 0}, {})],
)
def test_run_as_non_root_refuses_a_root_user(pod_ctx, ctx):
    with pytest.raises(PodSpecError) as err:
        identity({"securityContext": pod_ctx}, {"name": "c", "securityContext": ctx})
    assert err.value.reason == "CreateContainerConfigError" and "runAsNonRoot" in str(err.value)
    # A user given anywhere satisfies it.
    assert identity({"securityContext": {**pod_ctx, "runAsUser": 7}}, {"name": "c", "securityContext": {**ctx, "runAsUser": 7}}).uid == 7


def test_traversal_barrier_finds_the_outermost_unsearchable_ancestor():
    modes = {"/root": (0o40700, 0, 0), "/root/.pyenv": (0o40755, 0, 0), "/work": (0o40750, 0, 3000)}
    stat = lambda path: modes.get(path, (0o40755, 0, 0))  # noqa: E731
    user = identity({}, {"name": "c", "securityContext": {"runAsUser": 65532}})
    assert traversal_barrier("/root/.pyenv/versions/3.11/bin", user, stat) == "/root"
    assert traversal_barrier("/usr/lib/python3", user, stat) is None
    assert traversal_barrier("/work/main", user, stat) == "/work"
    member = identity({"securityContext": {"runAsUser": 65532, "fsGroup": 3000}}, {"name": "c"})
    assert traversal_barrier("/work/main", member, stat) is None  # group bits
    capless_root = identity({}, {"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}})
    assert traversal_barrier("/root/.pyenv", capless_root, stat) is None  # the owner
    assert traversal_barrier("/work/main", capless_root, stat) is None  # the owner too
    plain_root = identity({}, {"name": "c"})
    assert traversal_barrier("/srv", plain_root, lambda p: (0o40000, 5, 5)) is None  # DAC_OVERRIDE
