"""One language: `hsx render|preflight|extract -f job.yaml` read the ExtractionJob manifest itself, and the
CLI's user errors are one line with the permanent exit code, never a traceback (issue 31, items 1-4)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.runner import extract
from hsx_extractor.tools.cli import main
from hsx_operator.desired import desired_config_map, initial_suspend
from hsx_operator.group import desired_run
from hsx_operator.manifests import read_manifest
from tests.run.helpers import RefServer, chat_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
# The manifests as written (quickstart.yaml is a template envsubst fills: the README quick-start test runs it).
EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.yaml") if "kind: ExtractionJob" in p.read_text() and "${" not in p.read_text()
)


def run_hsx(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def manifest(tmp_path: Path, model: Path, dataset: Path, **spec: Any) -> Path:
    doc = {
        "apiVersion": "hsx.dev/v1alpha1",
        "kind": "ExtractionJob",
        "metadata": {"name": "local", "namespace": "ml"},
        "spec": {
            "runId": "r1",
            "model": {"path": "/models/tiny", "source": {"hostPath": {"path": str(model.parent)}}},
            "dataset": {"uri": str(dataset), "maxLength": 512},
            "output": {"uri": str(tmp_path / "out"), "shardTargetBytes": 1 << 20},
            "concurrency": 4,
            **spec,
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def model_at_models_tiny(tmp_path: Path, tiny_model: Path) -> Path:
    """The session's tiny model as a node directory would hold it: <root>/tiny."""
    root = tmp_path / "node-models"
    root.mkdir()
    (root / "tiny").symlink_to(tiny_model)
    return root / "tiny"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_render_prints_what_the_operators_pure_functions_make(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_hsx(["render", "-f", str(example)], capsys)
    assert code == EXIT_OK, err
    config_map, job = yaml.safe_load_all(out)
    owner, spec = read_manifest(example)
    assert config_map == desired_config_map(owner, spec)
    assert job == desired_run(owner, spec, suspend=initial_suspend(spec))  # a JobSet for a multi-node example
    # Examples name no namespace (`kubectl -n NS apply` puts them anywhere): kubectl's default, as render's.
    assert job["metadata"]["namespace"] == yaml.safe_load(example.read_text())["metadata"].get("namespace", "default")
    assert "&id" not in out and "*id" not in out  # plain YAML, no anchors


def test_render_warns_what_the_default_policy_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = manifest(tmp_path, tmp_path / "m" / "tiny", tmp_path / "data.jsonl")
    code, out, err = run_hsx(["render", "-f", str(path), "-n", "other"], capsys)
    assert code == EXIT_OK
    assert "warning: the operator's default policy refuses this Job" in err and "hostPath" in err
    assert all(d["metadata"]["namespace"] == "other" for d in yaml.safe_load_all(out))


def test_render_applies_the_clusters_defaults_as_the_operator_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "values.yaml"  # the chart's block as an admin writes it
    values.write_text("clusterDefaults:\n  imagePullSecrets: [mirror-pull]\n  imageRegistry: registry.example.com/hsx\n")
    example = next(e for e in EXAMPLES if e.name == "minimal.yaml")
    code, out, err = run_hsx(["render", "-f", str(example), "--cluster-defaults", f"@{values}"], capsys)
    assert code == EXIT_OK, err
    _, job = yaml.safe_load_all(out)
    assert job["metadata"]["annotations"]["hsx.dev/cluster-defaults"] == "server.image,extractor.image,pod.imagePullSecrets"
    pod = job["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror-pull"}]
    assert all(c["image"].startswith("registry.example.com/hsx/") for c in [*pod["containers"], *pod["initContainers"]])
    code, _, err = run_hsx(["render", "-f", str(example), "--cluster-defaults", '{"imagePullSecret": []}'], capsys)
    assert code != EXIT_OK and "clusterDefaults.imagePullSecret" in err


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_preflight_reads_each_example_manifest(
    example: Path, tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The examples as written, their pod paths mapped to a local tree holding the tiny model and a dataset."""
    _, spec = read_manifest(example)
    local = tmp_path / "mnt"
    model = local / Path(spec.model.path).relative_to(spec.model.mountPath)
    model.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_model, model)  # a copy: the example's own chat template may be set
    dataset = local / Path(spec.dataset.uri).relative_to(spec.model.mountPath)
    dataset.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(dataset, chat_rows(3))
    argv = ["preflight", "-f", str(example), "--mount", f"{spec.model.mountPath}={local}",
            "--output", str(tmp_path / "out"), "--dump-dir", str(tmp_path / "dumps"),
            "--set", "dataset.expectedTokenizerFingerprint=null"]  # fmt: skip
    code, out, err = run_hsx(argv, capsys)
    assert code == EXIT_OK, (out, err)
    assert "Traceback" not in err


def test_a_manifests_pod_paths_need_a_mount_here(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_hsx(["preflight", "-f", str(ROOT / "examples" / "minimal.yaml")], capsys)
    assert code == EXIT_PERMANENT
    assert "/models/Llama-3.1-8B-Instruct does not exist here" in err and "--mount /models=LOCAL_DIR" in err


@pytest.mark.slow
def test_extract_runs_from_the_manifest_itself(
    tmp_path: Path, ref_server: RefServer, model_at_models_tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hostPath model source maps itself: the manifest runs here unchanged but for the server's address."""
    dataset = write_jsonl(tmp_path / "data.jsonl", chat_rows(6))
    path = manifest(tmp_path, model_at_models_tiny, dataset)
    argv = ["extract", "-f", str(path), "--server-url", ref_server.url, "--dump-dir", str(ref_server.dump_dir),
            "--progress-port", "0"]  # fmt: skip
    code, out, err = run_hsx(argv, capsys)
    assert code == EXIT_OK, err
    written = json.loads((tmp_path / "out" / "r1" / "manifest.json").read_text())
    assert written["runId"] == "r1" and written["samples"] == 6 and written["quarantined"] == 0
    assert "hsx extract: done:" in out


def test_a_missing_server_is_named_with_its_last_error_and_the_wait_is_a_setting(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(2))
    port = free_port()  # nothing listens there
    cfg = ExtractConfig.model_validate({
        "runId": "r1", "dataset": {"uri": str(dataset)}, "output": {"uri": str(tmp_path / "out")},
        "modelPath": str(tiny_model), "serverUrl": f"http://127.0.0.1:{port}", "dumpDir": str(tmp_path / "dumps"),
        "progressPort": 0, "serverStartTimeoutSeconds": 2,
    })  # fmt: skip
    progress = Progress(run_id="r1", replica_index=0)
    seen: list[str | None] = []

    async def watch() -> tuple[int, Any]:
        task = asyncio.create_task(extract(cfg, progress))
        while not task.done():
            seen.append(progress.snapshot()["lastError"] if progress.state == "starting" else None)
            await asyncio.sleep(0.2)
        return await task

    began = time.monotonic()
    code, _ = asyncio.run(watch())
    took = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == EXIT_TRANSIENT
    waited = f"waiting for the server at http://127.0.0.1:{port}/health: ClientConnectorError"
    assert any(s and s.startswith(waited) for s in seen), seen  # /progress says what is awaited meanwhile
    assert waited in err and "gave up after 2s (serverStartTimeoutSeconds)" in err
    assert took < 60  # the setting, not the old fixed 600 s


def test_the_pods_wait_for_the_server_is_its_startup_probes_budget() -> None:
    from hsx_operator.desired import extract_config

    _, spec = read_manifest(ROOT / "examples" / "kimi-k2.5-production.yaml")
    assert extract_config(spec).serverStartTimeoutSeconds == spec.server.startupTimeoutSeconds


def test_a_busy_progress_port_is_a_configuration_error(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(1))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["extract", "--run-id", "r1", "--dataset", str(dataset), "--output", str(tmp_path / "o"),
                "--model", str(tiny_model), "--progress-host", "127.0.0.1", "--progress-port", str(port)]  # fmt: skip
        code, out, err = run_hsx(argv, capsys)
    assert code == EXIT_PERMANENT
    assert f"cannot serve progress on 127.0.0.1:{port}" in err and "choose another progressPort" in err
    assert "samples written" not in out  # a failed run prints no result


# (arguments, files to write first {name: text}, a fragment of the one-line error)
ERROR_CASES: list[tuple[list[str], dict[str, str], str]] = [
    (["extract", "--config", "{t}/bad.yaml"], {"bad.yaml": "runId: [\n"}, "is not valid YAML"),
    (["extract", "-f", "{t}/absent.yaml"], {}, "cannot read file {t}/absent.yaml: No such file"),
    (["preflight", "-f", "{t}/spec.yaml"], {"spec.yaml": "model: {path: /m}\nrunId: r\n"},
     "looks like an ExtractionJob's spec alone"),
    (["extract", "-f", "{t}/list.yaml"], {"list.yaml": "- 1\n- 2\n"}, "must hold one ExtractionJob manifest"),
    (["extract", "-f", "{t}/two.yaml"], {"two.yaml": "runId: a\n---\nrunId: b\n"}, "must hold one"),
    (["extract", "-f", "{t}/flat.yaml"], {"flat.yaml": "runId: r1\nmodelPath: /m\n"}, "dataset: required; output: required"),
    (["extract", "-f", "{t}/typo.yaml"], {"typo.yaml": "runId: r1\ndataset: {uri: d}\noutput: {uri: o}\nconcurency: 3\n"},
     "concurency: unknown field"),
    (["extract", "-f", "{t}/xj.yaml"], {"xj.yaml": "apiVersion: hsx.dev/v1alpha1\nkind: ExtractionJob\nmetadata: {name: a}\n"
                                        "spec: {runId: r1, model: {path: /m}, dataset: {uri: /d}, output: {uri: 's3:/x'}}\n"},
     "spec.output.uri: unsupported URI 's3:/x'"),
    (["render", "-f", "{t}/xj.yaml"], {"xj.yaml": "apiVersion: hsx.dev/v1alpha1\nkind: ExtractionJob\nmetadata: {name: a}\n"
                                       "spec: {runId: R1, model: {path: /m}, dataset: {uri: /d}, output: {uri: /o}}\n"},
     "spec.runId: String should match pattern"),
    (["render", "-f", "{t}/v2.yaml"], {"v2.yaml": "apiVersion: hsx.dev/v2\nkind: ExtractionJob\nmetadata: {name: a}\nspec: {}\n"},
     "apiVersion is 'hsx.dev/v2'"),
    (["render", "-f", "{t}/noname.yaml"], {"noname.yaml": "apiVersion: hsx.dev/v1alpha1\nkind: ExtractionJob\nspec: {}\n"},
     "metadata.name is missing"),
    (["render", "-f", "{t}/secret.yaml"], {"secret.yaml": "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n"},
     "holds 0 ExtractionJobs (kinds: Secret)"),
    (["render", "-f", "{t}/absent.yaml"], {}, "cannot read {t}/absent.yaml"),
    (["extract", "--config", "{t}/x.yaml", "--mount", "/m=/n"], {"x.yaml": "runId: r1\n"}, "--mount maps a manifest's pod paths"),
    (["extract", "--mount", "nonsense", "--run-id", "r1"], {}, "--mount wants POD_PATH=LOCAL_PATH"),
    (["extract", "--set", "x", "--run-id", "r1"], {}, "--set wants FIELD=VALUE"),
    (["extract", "--set", "output=3", "--set", "output.uri=x"], {}, "cannot set output.uri: output is a int"),
    (["extract", "--run-id", "BAD", "--dataset", "d", "--output", "o"], {}, "runId: String should match pattern"),
    (["extract", "--run-id", "r1", "--dataset", "d", "--output", "s3:/bucket"], {}, "output.uri: unsupported URI 's3:/bucket'"),
    (["extract", "--override", "{t}/absent.yaml", "--run-id", "r1"], {}, "cannot read override file"),
    (["extract", "--override", "{t}/o.yaml", "--run-id", "r1"], {"o.yaml": "- a\n"}, "must hold one mapping of config fields"),
    (["extract", "--chat-template", "{t}/absent.jinja", "--run-id", "r1"], {}, "cannot read --chat-template"),
    (["preflight", "--run-id", "r1"], {}, "dataset: required"),
    (["vocab", "{t}/absent", "--draft-vocab-size", "10"], {}, "absent has no manifest.json"),
    (["vocab", "/", "--draft-vocab-size", "10"], {}, "does not end in a runId"),
    (["vocab", "{t}/out/r1", "--draft-vocab-size", "10", "--out", "s3://bucket/v"], {}, "--out 's3://bucket/v' must be a local directory"),
    (["vocab", "{t}/out/r1", "--draft-vocab-size", "10", "--out", "s3:/bucket/v"], {}, "--out 's3:/bucket/v' must be a local directory"),
    (["export", "{t}/out/r1", "s3://bucket/x", "--to", "specforge"], {}, "export destination 's3://bucket/x' must be a local"),
    (["export", "{t}/out/r1", "s3:/bucket/x", "--to", "speculators"], {}, "export destination 's3:/bucket/x' must be a local"),
    (["export", "{t}/absent", "{t}/e", "--to", "specforge"], {}, "absent has no manifest.json"),
    (["verify", "s3:/x"], {}, "unsupported URI 's3:/x'"),
    (["verify", "{t}/absent"], {}, "no hsx run there"),
    (["serve-reference", "--model", "{t}/absent", "--dump-dir", "{t}/d"], {}, "is not a model directory"),
    (["fingerprint", "{t}/absent"], {}, "holds no tokenizer"),
    (["estimate", "--tokens", "100"], {}, "give --model DIR, or both --hidden-size and --num-layers"),
    (["estimate", "--tokens", "100", "--model", "{t}/absent"], {}, "config.json does not exist"),
    (["ls", "{t}/absent"], {}, "no hsx runs there"),
    (["show", "s3:/bucket/run"], {}, "unsupported URI 's3:/bucket/run'"),
    (["show", "{t}/absent"], {}, "no hsx run there"),
    (["make-tiny-model", "{t}/file/inside"], {"file": "not a directory"}, "Not a directory"),
]


@pytest.mark.parametrize(("argv", "files", "expected"), ERROR_CASES, ids=[" ".join(c[0][:3]) for c in ERROR_CASES])
def test_every_user_error_is_one_line_with_the_permanent_code(
    argv: list[str], files: dict[str, str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, out, err = run_hsx([a.replace("{t}", str(tmp_path)) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert code == EXIT_PERMANENT, (out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hsx {argv[0]}: ") and expected.replace("{t}", str(tmp_path)) in lines[0], lines[0]
    assert "errors.pydantic.dev" not in err and "validation error for" not in err
    assert "samples written" not in out


def test_the_error_corpus_is_large_enough() -> None:
    assert len(ERROR_CASES) >= 30 and len({c[0][0] for c in ERROR_CASES}) >= 9


def test_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("runId: [\n")
    for argv in (["extract", "-f", str(tmp_path / "bad.yaml")], ["vocab", "/absent", "--draft-vocab-size", "3"]):
        done = subprocess.run([sys.executable, "-m", "hsx_extractor.tools.cli", *argv], capture_output=True, text=True)
        assert done.returncode == EXIT_PERMANENT and "Traceback" not in done.stderr, done.stderr
    version = subprocess.run([sys.executable, "-m", "hsx_extractor.tools.cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("hsx 0.")


@pytest.mark.slow
def test_a_terminal_gets_a_live_bar_and_a_pipe_gets_log_lines(tmp_path: Path, ref_server: RefServer) -> None:
    import os
    import pty

    dataset = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(8), "not json"])
    base = [sys.executable, "-m", "hsx_extractor.tools.cli", "extract", "--dataset", str(dataset),
            "--model", str(ref_server.model), "--server-url", ref_server.url, "--dump-dir", str(ref_server.dump_dir),
            "--progress-port", "0", "--log-interval", "0.2", "--max-length", "512"]  # fmt: skip
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*base, "--run-id", "tty", "--output", str(tmp_path / "a")], stderr=follower,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == EXIT_OK
    text = seen.decode(errors="replace")
    assert "\r" in text and "9/9 samples" in text and "tok/s" in text and "quarantined 1" in text and "ETA" in text, text
    assert "hsx progress state=" not in text.split("hsx extract: error")[0].replace("\r", "\n").splitlines()[0]
    piped = subprocess.run([*base, "--run-id", "pipe", "--output", str(tmp_path / "b")], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert piped.returncode == EXIT_OK, piped.stderr
    assert "hsx progress state=succeeded samples=9/9" in piped.stderr and "\r" not in piped.stderr
