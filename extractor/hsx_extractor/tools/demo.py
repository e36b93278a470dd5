"""``hsx demo`` (what ``make demo`` runs): the whole data plane on this machine, on CPU.

Builds the tiny model, starts the reference server on 127.0.0.1, extracts the bundled example
dataset (malformed rows included), verifies the output and prints a summary.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.run.plan import PLAN_NAME
from hsx_extractor.run.progress import Progress
from hsx_extractor.tools.estimate import human_bytes
from hsx_extractor.tools.tinymodel import build_tiny_model, example_dataset_path

DEMO_RUN_ID = "demo"
SERVER_START_TIMEOUT_S = 300.0


class ServerStartError(RuntimeError):
    """The reference server did not come up."""


@contextmanager
def reference_server(model_dir: Path, dump_dir: Path, extra: list[str] | None = None) -> Iterator[str]:
    """Start ``hsx serve-reference`` on a free 127.0.0.1 port; yield its URL; stop it on exit."""
    cmd = [
        sys.executable,
        "-m",
        "hsx_extractor.tools.cli",
        "serve-reference",
        "--model",
        str(model_dir),
        "--dump-dir",
        str(dump_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *(extra or []),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_listening(proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_listening(proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    seen: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise ServerStartError("reference server exited during start:\n" + "".join(seen[-30:]))
        seen.append(line)
        marker = "hsx reference server listening on "
        if line.startswith(marker):
            return line[len(marker) :].strip()
    raise ServerStartError("reference server did not start in time:\n" + "".join(seen[-30:]))


def summary_lines(
    manifest: dict[str, Any], tokens: int, seconds: float, out: str, verified: str
) -> list[str]:
    """The readable summary (pure, so it is tested)."""
    reasons = Counter(manifest.get("quarantineByReason") or [q["reason"] for q in manifest.get("quarantine", [])])
    comp = manifest.get("compression", {})
    lines = [
        "hsx demo: done",
        f"  samples extracted : {manifest.get('samples')}",
        f"  quarantined       : {manifest.get('quarantined')}",
    ]
    lines += [f"      {reason:<22}{n}" for reason, n in sorted(reasons.items())]
    ratio = comp.get("ratio")
    lines += [
        f"  tokens            : {tokens}",
        f"  throughput        : {tokens / max(seconds, 1e-9):.0f} tok/s over {seconds:.1f}s",
        f"  shards            : {len(manifest.get('shards', []))}",
        f"  bytes raw/stored  : {human_bytes(comp.get('bytesRaw', 0), 1)} / {human_bytes(comp.get('bytesStored', 0), 1)}"
        + (f" (compression {ratio:.2f}x)" if ratio else ""),
        f"  verify            : {verified}",
        f"  output            : {out}",
        f"  check it yourself : hsx verify {out}",
    ]
    return lines


def _clear_previous(run_dir: Path) -> None:
    # Only ever delete a previous demo run (it has a plan.json); anything else is the user's.
    if not run_dir.exists():
        return
    if not (run_dir / PLAN_NAME).is_file():
        raise FileExistsError(f"{run_dir} exists and is not an hsx run; pick another --output")
    shutil.rmtree(run_dir)


def run_demo(output: str | Path = "demo-output", keep_model: bool = False) -> int:
    from hsx_extractor.run.runner import extract
    from hsx_extractor.tools.verify import run_verify

    out_root = Path(output).absolute()
    run_dir = out_root / DEMO_RUN_ID
    try:
        _clear_previous(run_dir)
    except FileExistsError as exc:
        print(f"hsx demo: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    work = Path(tempfile.mkdtemp(prefix="hsx-demo-"))
    try:
        print(f"hsx demo: building a tiny random model in {work / 'model'}", flush=True)
        model = build_tiny_model(work / "model")
        dumps = work / "dumps"
        with reference_server(model, dumps, ["--threads", "2"]) as url:
            print(f"hsx demo: reference server on {url}; extracting {example_dataset_path()}", flush=True)
            cfg = ExtractConfig.model_validate(
                {
                    "runId": DEMO_RUN_ID,
                    "dataset": {"uri": str(example_dataset_path()), "maxLength": 256},
                    "output": {"uri": str(out_root), "shardTargetBytes": 1 << 20},
                    "modelPath": str(model),
                    "serverUrl": url,
                    "dumpDir": str(dumps),
                    "concurrency": 8,
                    "progressPort": 0,
                    "logIntervalSeconds": 2.0,
                    "validation": {"dumpTimeoutSeconds": 30},
                }
            )
            progress = Progress(cfg.runId, cfg.replicaIndex)
            code, result = asyncio.run(extract(cfg, progress))
            seconds = progress.elapsed
        if code != EXIT_OK or result is None or result.manifest is None:
            print(f"hsx demo: extraction failed (exit {code})", file=sys.stderr)
            return code or EXIT_PERMANENT
        report = run_verify(str(run_dir))
        tokens = progress.tokens_done
        verified = "ok" if report.ok else "FAILED"
        print("\n".join(summary_lines(result.manifest, tokens, seconds, str(run_dir), verified)), flush=True)
        if not report.ok:
            print(report.summary_text(), file=sys.stderr)
            return EXIT_PERMANENT
        return EXIT_OK
    finally:
        if keep_model:
            print(f"hsx demo: kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
