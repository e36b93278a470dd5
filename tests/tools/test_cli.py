"""The `hsx` command: config from flags and files, exit codes, verify, demo."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.run.progress import Progress, report_loop
from hsx_extractor.tools.cli import extract_config, main, parser
from hsx_extractor.tools.demo import summary_lines
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl


def test_flags_map_to_spec_field_names(tmp_path: Path) -> None:
    args = parser().parse_args(
        [
            "extract",
            "--run-id",
            "r1",
            "--dataset",
            "d.jsonl",
            "--output",
            str(tmp_path),
            "--model",
            "m",
            "--concurrency",
            "7",
            "--max-length",
            "99",
            "--set",
            "validation.maxRetries=4",
            "--set",
            "output.compression=none",
        ]
    )
    cfg = extract_config(args)
    assert (cfg.runId, cfg.dataset.uri, cfg.output.uri, cfg.modelPath) == (
        "r1",
        "d.jsonl",
        str(tmp_path),
        "m",
    )
    assert cfg.concurrency == 7 and cfg.dataset.maxLength == 99
    assert cfg.validation.maxRetries == 4 and cfg.output.compression == "none"


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"runId": "a", "dataset": {"uri": "x"}, "output": {"uri": "o"}, "concurrency": 2})
    )
    cfg = extract_config(parser().parse_args(["extract", "--config", str(path), "--concurrency", "9"]))
    assert cfg.runId == "a" and cfg.concurrency == 9


def test_invalid_config_exits_permanent_with_the_field(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"runId": "a", "dataset": {"uri": "x"}, "output": {"uri": "o"}, "concurency": 2})
    )
    assert main(["extract", "--config", str(path)]) == EXIT_PERMANENT
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "concurency" in err


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("output.uri", "s3:/bucket/out", "unsupported URI 's3:/bucket/out'"),
        ("dataset.uri", "gs://bucket/chat.jsonl", "unsupported URI 'gs://bucket/chat.jsonl'"),
        ("output.endpoint", "minio:9000", "endpoint 'minio:9000' must be an http:// or https:// URL"),
    ],
)
def test_a_uri_hsx_cannot_read_exits_permanent_and_writes_nothing(
    tmp_path: Path, capsys: Any, monkeypatch: Any, field: str, value: str, words: str
) -> None:
    monkeypatch.chdir(tmp_path)  # where "s3:/bucket/out" as a relative path would have landed
    section, key = field.split(".")
    doc: dict[str, Any] = {"runId": "a", "dataset": {"uri": "/x.jsonl"}, "output": {"uri": "/o"}}
    doc[section][key] = value
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    assert main(["extract", "--config", str(tmp_path / "c.yaml")]) == EXIT_PERMANENT
    assert words in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_missing_dataset_exits_permanent(tmp_path: Path, ref_server: RefServer, capsys: Any) -> None:
    cfg = base_config(tmp_path, ref_server, tmp_path / "absent.jsonl")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["extract", "--config", str(path)]) == EXIT_PERMANENT
    assert "does not exist" in capsys.readouterr().err


def test_extract_then_verify_and_damage_is_caught(tmp_path: Path, ref_server: RefServer, capsys: Any) -> None:
    cfg = base_config(tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", chat_rows(4)))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    assert main(["extract", "--config", str(path)]) == EXIT_OK
    run_dir = tmp_path / "out" / "run"
    capsys.readouterr()
    assert main(["verify", str(run_dir), "--json"]) == EXIT_OK
    line = capsys.readouterr().out.strip()
    summary = json.loads(line)
    assert "\n" not in line and summary["ok"] is True and summary["samples"] == 4
    shard = next((run_dir / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # flip a byte of the last sample's stored states
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    assert main(["verify", str(run_dir)]) != EXIT_OK


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "0", "-0.5", "1.5", "half"])
def test_verify_sample_outside_0_1_is_a_usage_error(tmp_path: Path, capsys: Any, value: str) -> None:
    """argparse's usage error (exit 2, the flag named), never a traceback from inside verify."""
    with pytest.raises(SystemExit) as info:
        main(["verify", str(tmp_path / "out" / "run"), "--sample", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--sample" in err and "Traceback" not in err


def test_verify_sample_in_range_is_accepted() -> None:
    args = parser().parse_args(["verify", "out/run", "--sample", "1"])
    assert args.sample == 1.0
    assert parser().parse_args(["verify", "out/run", "--sample", "0.25"]).sample == 0.25


def test_report_loop_writes_flushed_lines() -> None:
    class Stream(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            Stream.flushes += 1

    import asyncio

    progress = Progress("r", 0)
    progress.samples_total = 10
    progress.sample_done(5)
    progress.sample_quarantined("too_long")
    stream = Stream()

    async def briefly() -> None:
        task = asyncio.create_task(report_loop(progress, 0.05, stream))
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(briefly())
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2 and Stream.flushes >= len(lines)
    assert "samples=2/10 written=1 quarantined=1 tokens=5" in lines[0]


def test_summary_lines() -> None:
    manifest = {
        "samples": 3,
        "quarantined": 2,
        "shards": [{}],
        "quarantine": [{"reason": "too_long"}, {"reason": "invalid_json"}],
        "compression": {"bytesRaw": 4096, "bytesStored": 2048, "ratio": 2.0},
    }
    text = "\n".join(summary_lines(manifest, 100, 2.0, "/x/demo", "ok"))
    for part in (
        "samples extracted : 3",
        "too_long",
        "invalid_json",
        "tokens            : 100",
        "50 tok/s",
        "4.0 KiB / 2.0 KiB (compression 2.00x)",
        "verify            : ok",
        "hsx verify /x/demo",
    ):
        assert part in text


@pytest.mark.slow
def test_hsx_demo_prints_summary_and_output_verifies(tmp_path: Path) -> None:
    out = tmp_path / "demo-output"
    done = subprocess.run(
        [sys.executable, "-m", "hsx_extractor.tools.cli", "demo", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hsx demo: done" in done.stdout and "verify            : ok" in done.stdout
    assert "too_long" in done.stdout and f"output            : {out / 'demo'}" in done.stdout
    check = subprocess.run(
        [sys.executable, "-m", "hsx_extractor.tools.cli", "verify", str(out / "demo"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0 and json.loads(check.stdout)["ok"] is True
    # A second demo replaces its own earlier run and succeeds again.
    again = subprocess.run(
        [sys.executable, "-m", "hsx_extractor.tools.cli", "demo", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout + again.stderr


def test_verify_a_missing_path_is_an_error(tmp_path: Path, capsys: Any) -> None:
    assert main(["verify", str(tmp_path / "nowhere" / "run")]) == EXIT_PERMANENT
    err = capsys.readouterr().err
    assert "no hsx run there" in err and "Traceback" not in err
    assert main(["verify", str(tmp_path / "not_a_run_id")]) == EXIT_PERMANENT
    assert "no hsx run there" in capsys.readouterr().err


def test_verify_an_output_root_verifies_each_run(tmp_path: Path, ref_server: RefServer, capsys: Any) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    for run_id in ("first", "second"):
        path = tmp_path / f"{run_id}.json"
        path.write_text(json.dumps(base_config(tmp_path, ref_server, dataset, run_id=run_id)))
        assert main(["extract", "--config", str(path)]) == EXIT_OK
    root = tmp_path / "out"
    capsys.readouterr()
    assert main(["verify", str(root)]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"OK: {root}/first" in out and f"OK: {root}/second" in out
    assert out.strip().endswith(f"2 runs under {root}: 2 OK, 0 FAILED")
    assert main(["verify", str(root), "--json"]) == EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["uri"] for line in lines] == [f"{root}/first", f"{root}/second"]
    (root / "second" / "manifest.json").chmod(0o644)
    (root / "second" / "manifest.json").write_text("{}")
    assert main(["verify", str(root)]) == EXIT_PERMANENT
    assert capsys.readouterr().out.strip().endswith("1 OK, 1 FAILED")


def test_make_tiny_model_leaves_files_a_pods_user_can_read(tmp_path: Path) -> None:
    # safetensors writes the weights through a private (0600) temporary file; made as root, the
    # dev cluster's pods (uid 65532) could not read them (issue 38).
    out = tmp_path / "tiny"
    done = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.umask(0o022); from hsx_extractor.tools.cli import main; "
         f"sys.exit(main(['make-tiny-model', {str(out)!r}]))"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
