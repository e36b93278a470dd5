"""The test ground is real: the API server, scheduler, controllers and the node agent behave as in a cluster."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import uuid
from pathlib import Path
from urllib.request import urlopen

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.ground.wait import condition_true, get_json, wait_for

pytestmark = pytest.mark.cluster

IMAGE = "hsx-test/local:1"  # runs the container's command as written


@pytest.fixture
def node(node_agent):
    node_agent.register_image("hsx-test/local:*")
    return node_agent


def apply(cluster, *objects: dict) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    )


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def pod_manifest(name: str, namespace: str, containers: list[dict], **spec: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"restartPolicy": "Never", "containers": containers, **spec},
    }


def pod_phase(cluster, namespace: str, name: str) -> str:
    return str(get_json(cluster, "pod", name, "-n", namespace).get("status", {}).get("phase", ""))


def test_crd_is_served_and_its_schema_enforced(kube_cluster, namespace):
    group = f"g{uuid.uuid4().hex[:6]}.test.hsx.dev"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["size"],
                                    "properties": {"size": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    apply(kube_cluster, crd)
    try:
        kube_cluster.wait_crd_established(f"widgets.{group}")
        good = {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": "good"},
            "spec": {"size": 3},
        }
        kube_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(good))
        listed = get_json(kube_cluster, f"widgets.{group}", "-n", namespace)
        assert [w["spec"]["size"] for w in listed["items"]] == [3]

        bad = {**good, "metadata": {"name": "bad"}, "spec": {"size": 0}}
        refused = kube_cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False
        )
        assert refused.returncode != 0
        assert "spec.size" in refused.stderr and "greater than or equal to 1" in refused.stderr, (
            refused.stderr
        )
        missing = {**good, "metadata": {"name": "missing"}, "spec": {}}
        refused = kube_cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(missing), check=False
        )
        assert refused.returncode != 0 and "spec.size: Required value" in refused.stderr, refused.stderr
    finally:
        kube_cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def test_identity_without_rbac_is_refused_until_granted(kube_cluster, namespace):
    eve = kube_cluster.user_kubeconfig("eve", groups=["hsx-testers"])
    refused = kube_cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=eve, check=False)
    assert refused.returncode != 0
    assert 'User "eve" cannot list resource "pods"' in refused.stderr, refused.stderr
    with pytest.raises(ApiException) as caught:
        client.CoreV1Api(kube_cluster.api_client(eve)).list_namespaced_pod(namespace)
    assert caught.value.status == 403

    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pod-reader", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "testers-read-pods", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "hsx-testers"}],
    }
    apply(kube_cluster, role, binding)
    wait_for(
        lambda: (
            kube_cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=eve, check=False).returncode == 0
        ),
        30,
        "eve's group binding to take effect",
    )
    # Authorization comes before lookup: deleting even a missing pod is refused without the verb.
    still_refused = kube_cluster.kubectl(
        "delete", "pod", "anything", "-n", namespace, kubeconfig=eve, check=False
    )
    assert still_refused.returncode != 0
    assert 'cannot delete resource "pods"' in still_refused.stderr, still_refused.stderr


def test_job_is_scheduled_run_completed_and_garbage_collected(kube_cluster, node, namespace):
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "hello", "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": IMAGE,
                            "command": ["sh", "-c", "echo hello from $(POD_NAME) in $(NS)"],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {
                                    "name": "NS",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                                },
                            ],
                            "resources": {"limits": {"nvidia.com/gpu": "8"}},
                        }
                    ],
                }
            },
        },
    }
    apply(kube_cluster, job)
    wait_for(
        lambda: condition_true(get_json(kube_cluster, "job", "hello", "-n", namespace), "Complete"),
        90,
        "the Job controller to mark the Job Complete",
    )
    pods = get_json(kube_cluster, "pods", "-n", namespace, "-l", "job-name=hello")["items"]
    assert len(pods) == 1
    pod = pods[0]
    assert pod["spec"]["nodeName"] == node.node_name
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    name = pod["metadata"]["name"]
    assert node.logs(namespace, name, "main").strip() == f"hello from {name} in {namespace}"

    kube_cluster.kubectl("delete", "job", "hello", "-n", namespace, "--cascade=background")
    wait_for(
        lambda: not get_json(kube_cluster, "pods", "-n", namespace, "-l", "job-name=hello")["items"],
        60,
        "the garbage collector to delete the Job's pod",
    )


SIDECAR = """
    import http.server, os, signal, sys
    journal = os.environ["JOURNAL"]
    def note(line):
        with open(journal, "a") as f:
            f.write(line + "\\n")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("0.0.0.0", 30000), Health)  # inside the pod's own netns
    def stop(*_):
        note("sidecar stopping"); sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    note("sidecar serving")
    server.serve_forever()
"""
MAIN = """
    import os, urllib.request
    body = urllib.request.urlopen("http://127.0.0.1:30000/").read().decode()
    with open(os.environ["JOURNAL"], "a") as f:
        f.write(f"main saw {body}\\n")
"""


def test_native_sidecar_starts_first_and_stops_after_main(kube_cluster, node, namespace, tmp_path):
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    env = [{"name": "JOURNAL", "value": "/journal/events"}]
    mounts = [{"name": "journal", "mountPath": "/journal"}]
    sidecar = {
        "name": "server",
        "image": IMAGE,
        "restartPolicy": "Always",
        "command": python(SIDECAR),
        "env": env,
        "volumeMounts": mounts,
        "startupProbe": {"httpGet": {"path": "/", "port": 30000}, "periodSeconds": 1, "failureThreshold": 60},
    }
    main = {"name": "extractor", "image": IMAGE, "command": python(MAIN), "env": env, "volumeMounts": mounts}
    pod = pod_manifest(
        "sidecar-order",
        namespace,
        [main],
        initContainers=[sidecar],
        volumes=[{"name": "journal", "hostPath": {"path": str(journal_dir), "type": "Directory"}}],
    )
    apply(kube_cluster, pod)
    wait_for(
        lambda: pod_phase(kube_cluster, namespace, "sidecar-order") == "Succeeded", 90, "the pod to succeed"
    )
    events = (journal_dir / "events").read_text().splitlines()
    assert events == ["sidecar serving", "main saw ok", "sidecar stopping"]
    status = get_json(kube_cluster, "pod", "sidecar-order", "-n", namespace)["status"]
    assert status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


SERVER = """
    import http.server, os
    class Name(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(os.environ["POD_NAME"].encode())
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("0.0.0.0", 8080), Name).serve_forever()  # inside the pod's own netns
"""


def test_two_pods_listen_on_the_same_port(kube_cluster, node, namespace):
    def server_pod(name: str) -> dict:
        container = {
            "name": "web",
            "image": IMAGE,
            "command": python(SERVER),
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        }
        return pod_manifest(name, namespace, [container], terminationGracePeriodSeconds=2)

    apply(kube_cluster, server_pod("web-a"), server_pod("web-b"))
    for name in ("web-a", "web-b"):
        kube_cluster.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "-n", namespace, "--timeout=90s")
    ips = {
        name: get_json(kube_cluster, "pod", name, "-n", namespace)["status"]["podIP"]
        for name in ("web-a", "web-b")
    }
    assert len(set(ips.values())) == 2
    for name, ip in ips.items():
        with urlopen(f"http://{ip}:8080/", timeout=10) as response:
            assert response.read().decode() == name

    kube_cluster.kubectl("delete", "pod", "web-a", "web-b", "-n", namespace, "--wait=true", "--timeout=60s")
    assert not get_json(kube_cluster, "pods", "-n", namespace)["items"]


def test_env_and_volumes_from_the_api(kube_cluster, node, namespace):
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": namespace},
        "data": {"greeting": "hi", "mode": "fast"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "creds", "namespace": namespace},
        "stringData": {"password": "s3cret"},
    }
    script = """
        set -u
        echo "greeting=$GREETING password=$PASSWORD prefixed=$CFG_mode ns=$NS sub=$(SUB)"
        echo "file=$(cat /etc/cfg/greeting) secret=$(cat /etc/sec/password) label=$(cat /etc/podinfo/app)"
        echo "scratch=$(stat -f -c %T /scratch) workdir=$(pwd)"
        if touch /etc/sec/extra 2>/dev/null; then echo secret-writable; else echo secret-read-only; fi
        test -s /var/run/secrets/kubernetes.io/serviceaccount/token && echo token-present
        echo "default-routes=$(ip route show default | wc -l)"
    """
    container = {
        "name": "show",
        "image": IMAGE,
        "command": ["sh", "-c", textwrap.dedent(script)],
        "workingDir": "/scratch/work",
        "env": [
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "SUB", "value": "$(NS)-x"},
        ],
        "envFrom": [{"prefix": "CFG_", "configMapRef": {"name": "settings"}}],
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "podinfo", "mountPath": "/etc/podinfo"},
        ],
    }
    pod = pod_manifest(
        "show-env",
        namespace,
        [container],
        volumes=[
            {"name": "cfg", "configMap": {"name": "settings"}},
            {"name": "sec", "secret": {"secretName": "creds"}},
            {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {
                "name": "podinfo",
                "downwardAPI": {
                    "items": [{"path": "app", "fieldRef": {"fieldPath": "metadata.labels['app']"}}]
                },
            },
        ],
    )
    pod["metadata"]["labels"] = {"app": "shower"}
    apply(kube_cluster, configmap, secret, pod)
    wait_for(lambda: pod_phase(kube_cluster, namespace, "show-env") == "Succeeded", 90, "the pod to succeed")
    assert node.logs(namespace, "show-env", "show").splitlines() == [
        f"greeting=hi password=s3cret prefixed=fast ns={namespace} sub={namespace}-x",
        "file=hi secret=s3cret label=shower",
        "scratch=tmpfs workdir=/scratch/work",
        "secret-read-only",
        "token-present",
        "default-routes=0",  # pods reach their own subnet only
    ]


def test_pod_reaches_the_api_server_with_its_service_account(kube_cluster, node, namespace):
    grant = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "default-view", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
    }
    reader = """
        import os
        from kubernetes import client, config
        config.load_incluster_config()
        pod = client.CoreV1Api().read_namespaced_pod(os.environ["HOSTNAME"], os.environ["NS"])
        print("read", pod.metadata.name, pod.spec.node_name)
        try:
            client.CoreV1Api().list_namespaced_secret(os.environ["NS"])
        except client.exceptions.ApiException as exc:
            print("secrets", exc.status)
    """
    container = {
        "name": "reader",
        "image": IMAGE,
        "command": python(reader),
        "env": [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    }
    apply(kube_cluster, grant, pod_manifest("reader", namespace, [container]))
    wait_for(
        lambda: pod_phase(kube_cluster, namespace, "reader") in ("Succeeded", "Failed"), 90, "the pod to end"
    )
    output = node.logs(namespace, "reader", "reader")
    assert pod_phase(kube_cluster, namespace, "reader") == "Succeeded", output
    assert output.splitlines() == [f"read reader {node.node_name}", "secrets 403"]


def test_unregistered_image_waits_in_image_pull_back_off(kube_cluster, node, namespace):
    image = f"hsx-test/unknown-{uuid.uuid4().hex[:6]}:1"
    apply(kube_cluster, pod_manifest("pull", namespace, [{"name": "c", "image": image, "command": ["true"]}]))

    def waiting_reason() -> str:
        statuses = (
            get_json(kube_cluster, "pod", "pull", "-n", namespace).get("status", {}).get("containerStatuses")
        )
        return str((statuses or [{}])[0].get("state", {}).get("waiting", {}).get("reason", ""))

    wait_for(lambda: waiting_reason() == "ImagePullBackOff", 60, "ImagePullBackOff")
    assert pod_phase(kube_cluster, namespace, "pull") == "Pending"
    node.register_image(image)
    try:
        wait_for(
            lambda: pod_phase(kube_cluster, namespace, "pull") == "Succeeded",
            60,
            "the pod to run once pullable",
        )
    finally:
        node.unregister_image(image)


def test_killed_container_is_restarted_under_on_failure(kube_cluster, node, namespace):
    container = {"name": "sleeper", "image": IMAGE, "command": ["sleep", "1000"]}
    pod = pod_manifest(
        "crashy", namespace, [container], restartPolicy="OnFailure", terminationGracePeriodSeconds=1
    )
    apply(kube_cluster, pod)

    def status() -> dict:
        return get_json(kube_cluster, "pod", "crashy", "-n", namespace).get("status", {})

    wait_for(lambda: status().get("phase") == "Running", 60, "the pod to run")
    node.kill_container(namespace, "crashy", "sleeper", signal.SIGKILL)

    def restarted() -> dict | None:
        container_status = (status().get("containerStatuses") or [{}])[0]
        running = "running" in container_status.get("state", {})
        return container_status if container_status.get("restartCount") == 1 and running else None

    after = wait_for(restarted, 60, "the container to be restarted")
    assert after["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    kube_cluster.kubectl("delete", "pod", "crashy", "-n", namespace, "--timeout=60s")


def test_node_death_and_return(kube_cluster, node, namespace):
    def ready() -> str:
        conditions = get_json(kube_cluster, "node", node.node_name)["status"]["conditions"]
        return next(c["status"] for c in conditions if c["type"] == "Ready")

    assert ready() == "True"
    node.stop()
    try:
        wait_for(lambda: ready() == "Unknown", 60, "the node lifecycle controller to notice the silent node")
    finally:
        node.start()
    wait_for(lambda: ready() == "True", 60, "the node to be Ready again")
    apply(
        kube_cluster, pod_manifest("after", namespace, [{"name": "c", "image": IMAGE, "command": ["true"]}])
    )
    wait_for(
        lambda: pod_phase(kube_cluster, namespace, "after") == "Succeeded",
        60,
        "a pod to run after the return",
    )


def test_user_kubeconfig_file_is_a_usable_identity(kube_cluster):
    path = kube_cluster.user_kubeconfig("system:serviceaccount:x:y", groups=["system:authenticated"])
    assert Path(path).exists()
    whoami = kube_cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=path)
    info = json.loads(whoami.stdout)["status"]["userInfo"]
    assert info["username"] == "system:serviceaccount:x:y"
    assert "system:authenticated" in info["groups"]


def test_exec_readiness_probe_runs_inside_the_container(kube_cluster, node, namespace):
    # /ready exists only in the container's mount namespace: the probe passes only if it runs in there.
    container = {
        "name": "slow-start",
        "image": IMAGE,
        "command": ["sh", "-c", "sleep 1; touch /ready/flag; exec sleep 1000"],
        "volumeMounts": [{"name": "ready", "mountPath": "/ready"}],
        "readinessProbe": {"exec": {"command": ["cat", "/ready/flag"]}, "periodSeconds": 1},
    }
    pod = pod_manifest(
        "exec-probe",
        namespace,
        [container],
        volumes=[{"name": "ready", "emptyDir": {}}],
        terminationGracePeriodSeconds=1,
    )
    apply(kube_cluster, pod)
    kube_cluster.kubectl("wait", "--for=condition=Ready", "pod/exec-probe", "-n", namespace, "--timeout=60s")
    assert not Path("/ready/flag").exists()
    kube_cluster.kubectl("delete", "pod", "exec-probe", "-n", namespace, "--timeout=60s")


def test_job_active_deadline_deletes_the_running_pod(kube_cluster, node, namespace):
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "forever", "namespace": namespace},
        "spec": {
            "activeDeadlineSeconds": 3,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": IMAGE, "command": ["sleep", "1000"]}],
                }
            },
        },
    }
    apply(kube_cluster, job)

    def failed_reason() -> str | None:
        conditions = (
            get_json(kube_cluster, "job", "forever", "-n", namespace).get("status", {}).get("conditions", [])
        )
        return next(
            (c.get("reason") for c in conditions if c["type"] == "Failed" and c["status"] == "True"), None
        )

    assert wait_for(failed_reason, 60, "the Job to fail on its deadline") == "DeadlineExceeded"
    wait_for(
        lambda: not get_json(kube_cluster, "pods", "-n", namespace, "-l", "job-name=forever")["items"],
        60,
        "the Job controller's delete of the pod to be carried out by the node",
    )


def test_termination_message_from_file_and_from_logs(kube_cluster, node, namespace):
    """As the kubelet: each pod's own file at terminationMessagePath, or the log tail on failure."""
    writes = {
        "name": "c",
        "image": IMAGE,
        "command": python("open('/dev/termination-log', 'w').write('{\"done\": 3}')"),
    }
    custom = {
        "name": "c",
        "image": IMAGE,
        "command": python("open('/var/tmp/hsx-term-msg', 'w').write('custom path')"),
        "terminationMessagePath": "/var/tmp/hsx-term-msg",
    }
    fails = {
        "name": "c",
        "image": IMAGE,
        "command": python("print('first'); print('why it failed'); raise SystemExit(3)"),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    silent = {"name": "c", "image": IMAGE, "command": ["true"]}
    pods = {"writes": writes, "custom": custom, "fails": fails, "silent": silent}
    apply(kube_cluster, *(pod_manifest(name, namespace, [c]) for name, c in pods.items()))

    def terminated(name: str):
        def check() -> dict | None:
            statuses = get_json(kube_cluster, "pod", name, "-n", namespace)["status"].get("containerStatuses")
            return ((statuses or [{}])[0].get("state") or {}).get("terminated")

        return check

    got = {name: wait_for(terminated(name), 90, f"pod {name} to end") for name in pods}
    assert got["writes"]["message"] == '{"done": 3}'
    assert got["custom"]["message"] == "custom path"
    assert got["fails"]["exitCode"] == 3 and got["fails"]["message"].endswith("why it failed")
    assert not got["silent"].get("message")
    # The file was the container's own: nothing was left on the host by the pod that wrote it.
    assert not Path("/dev/termination-log").exists() or Path("/dev/termination-log").read_text() == ""


def test_volumes_over_the_checkout_do_not_hide_the_program(kube_cluster, node, namespace):
    """The checkout and its interpreter stand for the image: an emptyDir over an ancestor of them (the
    chart's /tmp, with a clone under /tmp) hides the node's files there, not the program."""
    checkout = Path(__file__).resolve().parents[2]
    # A volume at the checkout itself: covering an ancestor is the same case, but an ancestor may also
    # hold the node agent's own directory (a clone under /var/tmp), which no test should cover.
    code = f"""
        import os, pathlib
        assert pathlib.Path({str(checkout / "pyproject.toml")!r}).is_file(), os.listdir({str(checkout)!r})
        import hsx_extractor
        print("ok")
    """
    mounts = [{"name": "cover", "mountPath": str(checkout)}]
    volumes = [{"name": "cover", "emptyDir": {}}]
    if checkout != Path("/tmp"):
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
        volumes.append({"name": "tmp", "emptyDir": {}})
    container = {"name": "c", "image": IMAGE, "command": python(code), "volumeMounts": mounts}
    apply(kube_cluster, pod_manifest("covered", namespace, [container], volumes=volumes))
    wait_for(
        lambda: pod_phase(kube_cluster, namespace, "covered") in ("Succeeded", "Failed"), 90, "the pod to end"
    )
    assert pod_phase(kube_cluster, namespace, "covered") == "Succeeded", node.logs(namespace, "covered", "c")
    assert node.logs(namespace, "covered", "c").strip() == "ok"


def test_security_context_is_honoured(kube_cluster, node, namespace, tmp_path):
    """runAsUser/runAsGroup/fsGroup, dropped capabilities, no-new-privs and a read-only root filesystem
    hold for the container's process, checked by the kernel as in a real runtime."""
    host_dir = tmp_path / "root-owned"  # a hostPath as the kubelet makes one: root's, 0755
    host_dir.mkdir(mode=0o755)  # bound at /host: its own mode counts, not its ancestors'
    code = """
        import json, os
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)

        def writes(path):
            try:
                open(path, "w").close()
                return "ok"
            except OSError as exc:
                return os.strerror(exc.errno)

        st = os.stat("/scratch")
        print(json.dumps({
            "ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
            "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
            "no_new_privs": status["NoNewPrivs"].strip(), "home": os.environ["HOME"],
            "scratch": [oct(st.st_mode & 0o7777), st.st_gid, writes("/scratch/x")],
            "host_dir": writes("/host/x"), "root_fs": writes("/var/tmp/hsx-sc-probe"),
        }))
    """
    container = {
        "name": "c",
        "image": IMAGE,
        "command": python(code),
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}, {"name": "host", "mountPath": "/host"}],
        "securityContext": {
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    volumes = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "host", "hostPath": {"path": str(host_dir), "type": "Directory"}},
    ]
    context = {"runAsGroup": 3000, "fsGroup": 2000, "supplementalGroups": [4000]}
    root_only = {"name": "c", "image": IMAGE, "command": ["true"], "securityContext": {"runAsNonRoot": True}}
    apply(
        kube_cluster,
        pod_manifest("restricted", namespace, [container], volumes=volumes, securityContext=context),
        pod_manifest("nonroot", namespace, [root_only]),
    )
    wait_for(
        lambda: pod_phase(kube_cluster, namespace, "restricted") in ("Succeeded", "Failed"), 90, "the pod to end"
    )
    logs = node.logs(namespace, "restricted", "c")
    assert pod_phase(kube_cluster, namespace, "restricted") == "Succeeded", logs
    seen = json.loads(logs.strip().splitlines()[-1])
    assert seen["ids"] == [65532, 3000, [2000, 4000]]
    assert seen["cap_eff"] == seen["cap_bnd"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert seen["home"] == "/"
    assert seen["scratch"] == ["0o2777", 2000, "ok"]  # emptyDir: 0777, fsGroup's, setgid
    assert seen["host_dir"] == "Permission denied"  # hostPath ownership is the node's, fsGroup or not
    assert seen["root_fs"] == "Read-only file system"

    def refused() -> dict | None:
        statuses = get_json(kube_cluster, "pod", "nonroot", "-n", namespace)["status"].get("containerStatuses")
        waiting = ((statuses or [{}])[0].get("state") or {}).get("waiting") or {}
        return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

    waiting = wait_for(refused, 60, "the runAsNonRoot pod to be refused")
    assert "runAsNonRoot" in waiting["message"] and "root" in waiting["message"]


def test_kubectl_logs_reads_the_node_agents_containers(kube_cluster, node, namespace):
    """`kubectl logs` goes through the API server to the node's kubelet API, as on a cluster: the whole
    log, --tail, -f until the container ends, and an unknown container refused."""
    chatty = {
        "name": "c",
        "image": IMAGE,
        "command": python(
            """
            import time
            for i in range(5):
                print(f"line {i}", flush=True)
                time.sleep(0.4)
            """
        ),
    }
    apply(kube_cluster, pod_manifest("chatty", namespace, [chatty]))
    wait_for(lambda: pod_phase(kube_cluster, namespace, "chatty") in ("Running", "Succeeded"), 60, "the pod")
    followed = kube_cluster.kubectl("logs", "-n", namespace, "chatty", "-c", "c", "-f", timeout=60)
    assert followed.stdout.splitlines() == [f"line {i}" for i in range(5)], followed.stdout
    wait_for(lambda: pod_phase(kube_cluster, namespace, "chatty") == "Succeeded", 60, "the pod to end")
    assert kube_cluster.kubectl("logs", "-n", namespace, "chatty").stdout == "".join(
        f"line {i}\n" for i in range(5)
    )
    assert kube_cluster.kubectl("logs", "-n", namespace, "chatty", "--tail=2").stdout == "line 3\nline 4\n"
    missing = kube_cluster.kubectl("logs", "-n", namespace, "chatty", "-c", "nope", check=False)
    assert missing.returncode != 0 and "nope" in missing.stderr
