"""desired.py: spec -> ConfigMap and Job, checked field by field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_PERMANENT
from hsx_operator.desired import (
    DUMP_DIR,
    EXTRACTOR_DEFAULT_REQUESTS,
    LABEL_QUEUE,
    MAX_NAME,
    Owner,
    desired_config_map,
    desired_job,
    extract_config,
    initial_suspend,
    job_name,
    label_value,
    server_argv,
)
from tests.ground.podspec import expand_refs
from tests.operator.helpers import make_spec

OWNER = Owner(name="xj", namespace="ns", uid="uid-1")


def _pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def test_job_name_is_deterministic_and_fits_a_label() -> None:
    assert job_name("xj", "r1") == "xj-r1"
    long = job_name("a" * 60, "run-" + "b" * 30)
    assert long == job_name("a" * 60, "run-" + "b" * 30)
    assert len(long) <= MAX_NAME and long[-9] == "-"
    assert job_name("a" * 60, "run-1") != job_name("a" * 60, "run-2")
    # Indexed pods are named and hostnamed "<job>-<index>" (index < 64): still a DNS label.
    assert len(f"{long}-63") <= 63


def test_a_long_extraction_job_name_becomes_a_valid_label_value() -> None:
    name = "x" * 100
    owner = Owner(name=name, namespace="ns", uid="u")
    job = desired_job(owner, make_spec())
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        value = labels["hsx.dev/extractionjob"]
        assert value == label_value(name) and len(value) <= 63 and value[-1].isalnum()
    assert label_value("short") == "short" and label_value(name) != label_value("x" * 99 + "y")


def test_job_is_owned_labelled_and_indexed() -> None:
    job = desired_job(
        OWNER, make_spec(parallelism=2, backoffLimit=5, activeDeadlineSeconds=600, ttlSecondsAfterFinished=30)
    )
    ref = job["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["uid"], ref["controller"]) == ("ExtractionJob", "uid-1", True)
    assert job["metadata"]["labels"]["hsx.dev/run-id"] == "r1"
    s = job["spec"]
    assert (s["completionMode"], s["completions"], s["parallelism"]) == ("Indexed", 2, 2)
    assert (s["backoffLimit"], s["activeDeadlineSeconds"], s["ttlSecondsAfterFinished"]) == (5, 600, 30)
    assert s["podReplacementPolicy"] == "Failed"
    assert job["spec"]["template"]["metadata"]["labels"]["hsx.dev/extractionjob"] == "xj"


def test_pod_failure_policy_fails_fast_on_permanent_exit_and_ignores_disruptions() -> None:
    rules = desired_job(OWNER, make_spec())["spec"]["podFailurePolicy"]["rules"]
    fail = [r["onExitCodes"] for r in rules if r["action"] == "FailJob"]
    assert fail == [
        {"containerName": name, "operator": "In", "values": [EXIT_PERMANENT]}
        for name in ("preflight", "extractor")
    ]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore[0]["onPodConditions"][0]["type"] == "DisruptionTarget"


def test_server_is_a_native_sidecar_with_the_gpus_and_a_startup_budget() -> None:
    spec = make_spec(server={"gpus": 4, "startupTimeoutSeconds": 900})
    pod = _pod(desired_job(OWNER, spec))
    (preflight, server) = pod["initContainers"]
    (extractor,) = pod["containers"]
    assert "restartPolicy" not in preflight  # runs to completion before the server starts
    assert server["restartPolicy"] == "Always"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in str(extractor.get("resources", {}))
    probe = server["startupProbe"]
    # The server listens on 127.0.0.1 only: the kubelet probes it from inside the container.
    assert (
        probe["exec"]["command"][:2] == ["python3", "-c"]
        and "127.0.0.1:30000/health" in probe["exec"]["command"][2]
    )
    assert server["readinessProbe"]["exec"] == probe["exec"] and "ports" not in server
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 900
    assert {"name": "SGLANG_HS_DUMP_DIR", "value": DUMP_DIR} in server["env"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    assert extractor["securityContext"]["runAsNonRoot"] is True
    assert extractor["command"] == ["hsx", "extract", "--config", "/etc/hsx/config.yaml"]


def test_preflight_runs_the_extractors_checks_first_as_the_extractor() -> None:
    pod = _pod(desired_job(OWNER, make_spec()))
    preflight, (extractor,) = pod["initContainers"][0], pod["containers"]
    assert preflight["name"] == "preflight"
    assert preflight["command"] == ["hsx", "preflight", "--config", "/etc/hsx/config.yaml"]
    # Same image, user, environment (credentials) and volumes as the extractor: it checks what the run will see.
    for key in ("image", "env", "volumeMounts", "securityContext", "resources", "terminationMessagePolicy"):
        assert preflight[key] == extractor[key], key
    assert "ports" not in preflight


def test_shared_memory_volume_is_sized_from_the_spec_and_mounted_in_both() -> None:
    pod = _pod(desired_job(OWNER, make_spec(server={"shmSize": "32Gi"})))
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    for c in pod["initContainers"] + pod["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_credentials_come_from_the_secret_by_reference_only() -> None:
    extractor = _pod(desired_job(OWNER, make_spec()))["containers"][0]
    env = {e["name"]: e for e in extractor["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds",
        "key": "AWS_ACCESS_KEY_ID",
        "optional": False,
    }
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert all("value" not in e for name, e in env.items() if name.startswith("AWS_"))


def test_config_map_holds_a_valid_extractor_config() -> None:
    spec = make_spec(parallelism=3, concurrency=7, server={"port": 31000})
    cm = desired_config_map(OWNER, spec)
    raw = yaml.safe_load(cm["data"]["config.yaml"])
    assert "replicaIndex" not in raw  # each pod's index comes from JOB_COMPLETION_INDEX
    config = ExtractConfig.model_validate(raw)
    assert (config.runId, config.replicaCount, config.concurrency) == ("r1", 3, 7)
    assert config.serverUrl == "http://127.0.0.1:31000"
    assert config.dumpDir == DUMP_DIR
    assert config.dataset.tokenizer == "/models/tiny"
    assert config.output.uri == "s3://out/hs"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    volume = next(v for v in _pod(desired_job(OWNER, spec))["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]


def test_server_argv_turns_capture_on_and_prefix_caching_off() -> None:
    argv = server_argv(
        make_spec(
            model={"path": "/m", "auxLayerIds": [1, 15, 28]}, dataset={"uri": "/d/x.jsonl", "tokenizer": "/t"}
        )
    )
    joined = " ".join(argv)
    assert "--model-path /m" in joined and "--tp-size 8" in joined and "--host 127.0.0.1" in joined
    assert "--enable-return-aux-hidden-states" in argv and "--speculative-algorithm EAGLE3" in joined
    assert "--return-aux-hidden-state-layer-ids 1 15 28" in joined
    assert "--disable-radix-cache" in argv and "--chunked-prefill-size -1" in joined
    assert "--disable-prefill-cuda-graph" in argv
    dp = server_argv(
        make_spec(server={"gpus": 8, "tensorParallel": 4, "extraArgs": ["--mem-fraction-static", "0.8"]})
    )
    assert " ".join(dp).count("--dp-size 2") == 1 and dp[-2:] == ["--mem-fraction-static", "0.8"]


def test_model_sources_become_read_only_volumes() -> None:
    pvc = _pod(
        desired_job(
            OWNER,
            make_spec(
                model={
                    "path": "/models/llama",
                    "source": {"pvc": {"claimName": "weights", "subPath": "llama"}},
                }
            ),
        )
    )
    vol = next(v for v in pvc["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in pvc["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama"}
    image = _pod(
        desired_job(
            OWNER, make_spec(model={"path": "/models/x", "source": {"image": {"reference": "reg/m:1"}}})
        )
    )
    assert next(v for v in image["volumes"] if v["name"] == "model")["image"]["reference"] == "reg/m:1"


def test_local_dataset_and_output_are_mounted_from_the_node() -> None:
    spec = make_spec(dataset={"uri": "/data/sets/chat.jsonl"}, output={"uri": "file:///data/out"})
    pod = _pod(desired_job(OWNER, spec))
    by_name = {v["name"]: v for v in pod["volumes"]}
    assert by_name["dataset"]["hostPath"]["path"] == "/data/sets"
    assert by_name["output"]["hostPath"]["path"] == "/data/out"
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["dataset"]["readOnly"] is True and mounts["output"]["mountPath"] == "/data/out"


def test_scheduling_and_queue() -> None:
    spec = make_spec(
        scheduling={
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "batch-low",
            "queueName": "team-a",
            "affinity": {"nodeAffinity": {"x": 1}},
        }
    )
    job = desired_job(OWNER, spec, suspend=initial_suspend(spec))
    pod = _pod(job)
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "batch-low" and pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert job["metadata"]["labels"][LABEL_QUEUE] == "team-a"
    assert job["spec"]["suspend"] is True  # Kueue admits by unsuspending
    assert initial_suspend(make_spec()) is False and initial_suspend(make_spec(suspend=True)) is True


def test_desired_job_is_a_pure_function_of_the_spec() -> None:
    assert desired_job(OWNER, make_spec()) == desired_job(OWNER, make_spec())
    assert (
        desired_job(OWNER, make_spec())["metadata"]["name"]
        != desired_job(OWNER, make_spec(runId="r2"))["metadata"]["name"]
    )


def test_pre_norm_final_state_reaches_the_server_and_the_extractor() -> None:
    spec = make_spec(model={"path": "/m", "finalState": "pre-norm"})
    (_, server) = _pod(desired_job(OWNER, spec))["initContainers"]
    assert {"name": "SGLANG_HS_FINAL_STATE", "value": "pre-norm"} in server["env"]
    config = ExtractConfig.model_validate(yaml.safe_load(desired_config_map(OWNER, spec)["data"]["config.yaml"]))
    assert config.finalState == "pre-norm"
    (_, default) = _pod(desired_job(OWNER, make_spec()))["initContainers"]
    assert not [e for e in default["env"] if e["name"] == "SGLANG_HS_FINAL_STATE"]
    with pytest.raises(ValueError, match="the vllm engine dumps only pre-norm"):
        ExtractConfig.model_validate({**config.model_dump(), "engine": "vllm", "finalState": "post-norm"})


def test_vllm_engine_renders_hsx_launcher_in_a_vllm_container() -> None:
    spec = make_spec(
        model={"path": "/m", "auxLayerIds": [1, 15, 28]},
        server={"engine": "vllm", "gpus": 2, "extraArgs": ["--gpu-memory-utilization", "0.8"]},
    )
    pod = _pod(desired_job(OWNER, spec))
    (_, server) = pod["initContainers"]
    assert server["name"] == "vllm" and server["image"] == "ghcr.io/hsx-dev/hsx-vllm:0.1.0"
    # hsx's launcher reads the model's config in the pod, then execs vLLM (docs/vllm.md).
    assert server["command"] == [
        "python3", "-m", "hsx_extractor.vllm_hook", "serve", "--model", "/m", "--tp", "2", "--port", "30000",
        "--host", "127.0.0.1", "--chunked-prefill-size", "-1", "--layer-ids", "1,15,28",
        "--", "--gpu-memory-utilization", "0.8",
    ]  # fmt: skip
    assert {"name": "SGLANG_HS_DUMP_DIR", "value": DUMP_DIR} in server["env"]
    assert "127.0.0.1:30000/health" in server["startupProbe"]["exec"]["command"][2]
    assert server["readinessProbe"]["exec"] == server["startupProbe"]["exec"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    config = ExtractConfig.model_validate(
        yaml.safe_load(desired_config_map(OWNER, spec)["data"]["config.yaml"])
    )
    assert config.engine == "vllm" and config.auxLayerIds == [1, 15, 28]
    # The consistency check stays unset through the CRD (no default there) and the ConfigMap: vLLM
    # cannot check, and only a check the user asked for fails the run.
    assert not config.validation.consistency.asked
    crd = yaml.safe_load((Path(__file__).parents[2] / "crds" / "extractionjobs.hsx.dev.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    check = spec_schema["validation"]["properties"]["consistency"]["properties"]["samplesPerShard"]
    assert check["type"] == "integer" and "default" not in check
    # The default engine keeps SGLang's container, image and config.
    sglang = _pod(desired_job(OWNER, make_spec()))["initContainers"][-1]
    assert (sglang["name"], sglang["image"]) == ("sglang", "ghcr.io/hsx-dev/hsx-sglang:0.1.0")
    default_cm = yaml.safe_load(desired_config_map(OWNER, make_spec())["data"]["config.yaml"])
    assert ExtractConfig.model_validate(default_cm).engine == "sglang"
    mine = make_spec(server={"image": "my/vllm:1", "engine": "vllm"})
    assert _pod(desired_job(OWNER, mine))["initContainers"][-1]["image"] == "my/vllm:1"


def test_user_arguments_reach_the_server_literally_through_kubernetes_expansion() -> None:
    # The kubelet expands $(VAR) in command entries (the test node agent does it the same way):
    # the server must get `$(SGLANG_HS_DUMP_DIR)` and `$$` as typed, not the dump dir and `$`.
    spec = make_spec(
        model={"path": "/models/$(HOME)/m"},
        server={"extraArgs": ["--chat-template", "$(SGLANG_HS_DUMP_DIR)/t.jinja", "--x", "$$", "$"]},
    )
    container = next(c for c in _pod(desired_job(OWNER, spec))["initContainers"] if c["name"] == "sglang")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["SGLANG_HS_DUMP_DIR"] == DUMP_DIR
    assert [expand_refs(a, env) for a in container["command"]] == server_argv(spec)
    assert server_argv(spec)[-5:] == ["--chat-template", "$(SGLANG_HS_DUMP_DIR)/t.jinja", "--x", "$$", "$"]


def test_pod_settings_pass_through_and_hsx_keys_win() -> None:
    spec = make_spec(pod={"serviceAccountName": "s3-reader", "imagePullSecrets": ["registry"], "runtimeClassName": "nvidia",
                          "labels": {"team": "ml"}, "annotations": {"example.com/cost": "a"},
                          "caBundleConfigMap": "corp-ca"})  # fmt: skip
    job = desired_job(Owner(name="xj", namespace="ml", uid="u"), spec)
    pod = job["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "s3-reader" and pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}] and pod["spec"]["runtimeClassName"] == "nvidia"
    assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"]["hsx.dev/run-id"] == spec.runId
    assert pod["metadata"]["annotations"]["example.com/cost"] == "a"
    assert {"name": "ca-bundle", "configMap": {"name": "corp-ca"}} in pod["spec"]["volumes"]
    reaching_s3 = [*pod["spec"]["containers"], pod["spec"]["initContainers"][0]]
    assert [c["name"] for c in reaching_s3] == ["extractor", "preflight"]
    for container in reaching_s3:  # each once: preflight was copied from the extractor
        assert [e for e in container["env"] if e["name"] == "AWS_CA_BUNDLE"] == [{"name": "AWS_CA_BUNDLE", "value": "/etc/hsx-ca/ca.crt"}]
        assert [m["mountPath"] for m in container["volumeMounts"]].count("/etc/hsx-ca") == 1
    server = pod["spec"]["initContainers"][1]
    assert all(e["name"] != "AWS_CA_BUNDLE" for e in server["env"])
    # No mount point inside a read-only volume: the runtime cannot make one there (it once sat under /etc/hsx).
    for container in [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]:
        mounts = container["volumeMounts"]
        for ro in (m["mountPath"].rstrip("/") + "/" for m in mounts if m.get("readOnly")):
            assert not [m["mountPath"] for m in mounts if m["mountPath"].startswith(ro)], (container["name"], ro)
    plain = desired_job(Owner(name="xj", namespace="ml", uid="u"), make_spec())["spec"]["template"]["spec"]
    assert not {"serviceAccountName", "imagePullSecrets", "runtimeClassName"} & plain.keys()


def test_extra_volumes_reach_the_extractor_and_preflight_only_and_never_over_hsxs_mounts() -> None:
    volumes = [{"name": "tok", "mountPath": "/opt/tokenizer", "configMap": "tok"},
               {"name": "cert", "mountPath": "/etc/client-cert", "secret": "client-cert"},
               {"name": "data", "mountPath": "/data", "persistentVolumeClaim": "shared", "readOnly": False}]  # fmt: skip
    pod = desired_job(Owner(name="xj", namespace="ml", uid="u"), make_spec(pod={"volumes": volumes}))["spec"]["template"]["spec"]
    assert {"name": "user-tok", "configMap": {"name": "tok"}} in pod["volumes"]
    assert {"name": "user-cert", "secret": {"secretName": "client-cert"}} in pod["volumes"]
    assert {"name": "user-data", "persistentVolumeClaim": {"claimName": "shared", "readOnly": False}} in pod["volumes"]
    by_name = {c["name"]: c for c in [*pod["containers"], *pod["initContainers"]]}
    for name in ("extractor", "preflight"):
        mounts = {m["name"]: m for m in by_name[name]["volumeMounts"]}
        assert mounts["user-tok"] == {"name": "user-tok", "mountPath": "/opt/tokenizer", "readOnly": True}
        assert mounts["user-data"]["readOnly"] is False
    assert not [m for c in by_name.values() if c["name"] not in ("extractor", "preflight") for m in c["volumeMounts"]
                if m["name"].startswith("user-")]  # fmt: skip
    with pytest.raises(ValueError, match=r"pod.volumes\[1\].mountPath /opt/tokenizer overlaps /opt/tokenizer"):
        desired_job(Owner(name="xj", namespace="ml", uid="u"), make_spec(pod={"volumes": [volumes[0], {**volumes[1],
                    "mountPath": "/opt/tokenizer"}]}))  # fmt: skip
    for sources in ({}, {"configMap": "a", "secret": "b"}):  # the CRD's rule, for hsx render and preflight too
        with pytest.raises(ValidationError, match="exactly one of configMap, secret or persistentVolumeClaim"):
            make_spec(pod={"volumes": [{"name": "x", "mountPath": "/x", **sources}]})
    scratch = next(m["mountPath"] for m in by_name["extractor"]["volumeMounts"] if m["name"] == "scratch")
    for path in (scratch, scratch + "/mine", "/"):
        with pytest.raises(ValueError, match=r"pod.volumes\[0\].mountPath .* overlaps"):
            desired_job(Owner(name="xj", namespace="ml", uid="u"),
                        make_spec(pod={"volumes": [{"name": "x", "mountPath": path, "secret": "s"}]}))  # fmt: skip


def test_the_kueue_queue_label_on_the_extractionjob_names_its_queue() -> None:
    from hsx_operator.desired import initial_suspend, with_queue_label

    queued = with_queue_label(make_spec(), {"kueue.x-k8s.io/queue-name": "team-a"})
    job = desired_job(Owner(name="xj", namespace="ml", uid="u"), queued, suspend=initial_suspend(queued))
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and job["spec"]["suspend"] is True
    explicit = with_queue_label(make_spec(scheduling={"queueName": "mine"}), {"kueue.x-k8s.io/queue-name": "team-a"})
    assert explicit.scheduling.queueName == "mine"
    assert with_queue_label(make_spec(), None).scheduling.queueName is None


def test_a_continued_run_writes_under_the_run_it_continues() -> None:
    from hsx_operator.desired import desired_config_map, output_prefix

    spec = make_spec(runId="r2", continueFrom="r1")
    owner = Owner(name="xj", namespace="ml", uid="u")
    assert extract_config(spec).runId == "r1" and output_prefix(spec).endswith("/r1/")
    assert yaml.safe_load(desired_config_map(owner, spec)["data"]["config.yaml"])["runId"] == "r1"
    job = desired_job(owner, spec)
    assert job["metadata"]["name"] == "xj-r2" and job["metadata"]["labels"]["hsx.dev/run-id"] == "r2"
    assert extract_config(make_spec(runId="r2")).runId == "r2"


def test_pod_labels_and_annotations_under_hsxs_prefixes_are_refused() -> None:
    import pytest
    from pydantic import ValidationError

    for field in ("labels", "annotations"):
        with pytest.raises(ValidationError, match=f"pod.{field} must not use hsx's own prefixes"):
            make_spec(pod={field: {"hsx.dev/run-id": "x"}})


def test_the_extractor_requests_real_numbers_and_its_scratch_has_a_ceiling() -> None:
    pod = _pod(desired_job(OWNER, make_spec()))
    (extractor,) = pod["containers"]
    assert extractor["resources"]["requests"] == EXTRACTOR_DEFAULT_REQUESTS  # Kueue and the scheduler see them
    scratch = next(v for v in pod["volumes"] if v["name"] == "scratch")
    # Default 6 open shards of 1 GiB, plus 1 GiB: the engine never holds more spool files than that.
    assert scratch["emptyDir"] == {"sizeLimit": str(7 << 30)}
    spec = make_spec(
        output={"uri": "s3://b/p", "shardTargetBytes": 256 << 20, "maxOpenShards": 3},
        extractor={"resources": {"requests": {"memory": "16Gi"}, "limits": {"cpu": "8"}}},
    )
    pod = _pod(desired_job(OWNER, spec))
    (extractor,) = pod["containers"]
    # What the user names wins; a limit alone keeps Kubernetes' own default (request = limit).
    assert extractor["resources"] == {"requests": {"memory": "16Gi"}, "limits": {"cpu": "8"}}
    scratch = next(v for v in pod["volumes"] if v["name"] == "scratch")
    # 8 cores run two extractor workers (one per 4), each with its own 3 open shards.
    assert extract_config(spec).workers == 2
    assert scratch["emptyDir"]["sizeLimit"] == str(2 * 3 * (256 << 20) + (1 << 30))


def test_the_server_requests_cpu_and_memory_by_its_gpus_unless_the_spec_names_them() -> None:
    owner = Owner(name="xj", namespace="ml", uid="u")

    def server(**spec: object) -> dict[str, object]:
        job = desired_job(owner, make_spec(**spec))
        return dict(job["spec"]["template"]["spec"]["initContainers"][1]["resources"])

    assert server(server={"gpus": 8})["requests"] == {"cpu": "10", "memory": "64Gi", "nvidia.com/gpu": "8"}
    named = server(server={"gpus": 2, "resources": {"requests": {"cpu": "40"}, "limits": {"memory": "900Gi"}}})
    # A limit alone makes the request (Kubernetes copies it): no default beside it.
    assert named["requests"] == {"cpu": "40", "nvidia.com/gpu": "2"}, named
    assert named["limits"] == {"memory": "900Gi", "nvidia.com/gpu": "2"}, named


def test_extractor_env_passes_to_the_extractor_and_its_preflight_and_hsx_names_are_its_own() -> None:
    from pydantic import ValidationError

    from hsx_operator.pod_settings import EXTRACTOR_OWN_ENV

    proxy = [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, {"name": "NO_PROXY", "value": ".cluster.local"}]
    spec = make_spec(extractor={"env": proxy}, pod={"caBundleConfigMap": "ca"},
                     dataset={"uri": "s3://data/chat.jsonl", "credentialsSecret": "data-creds"})  # fmt: skip
    pod = desired_job(Owner(name="xj", namespace="ml", uid="u"), spec)["spec"]["template"]["spec"]
    for container in (pod["containers"][0], pod["initContainers"][0]):
        assert container["env"][:2] == proxy, container["name"]
        # Every other name the extractor gets is hsx's own, which a user's env may not replace.
        assert {e["name"] for e in container["env"][2:]} <= set(EXTRACTOR_OWN_ENV), container["env"]
    assert all(e["name"] != "HTTPS_PROXY" for e in pod["initContainers"][1]["env"])  # not the server's
    with pytest.raises(ValidationError, match="hsx's own variables"):
        make_spec(extractor={"env": [{"name": "AWS_ACCESS_KEY_ID", "value": "x"}]})
