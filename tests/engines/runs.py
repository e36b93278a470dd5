"""What the real-engine tests run: datasets of token and chat rows, `hsx extract` against a server,
and the check of a finished run against transformers. Shared by test_sglang_real and test_vllm_real.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hsx_extractor import protocol
from hsx_extractor.sglang_hook.launch import SGLANG_VERSION
from hsx_extractor.vllm_hook.launch import VLLM_VERSION
from tests.engines.compare import HSX, assert_matches_transformers, chat_expectation, read_output, verify_json
from tests.engines.sglang_server import SGLangServer

MAX_LENGTH = 511  # a context of 512, and the extractor asks for one new token
EXIT_OK, EXIT_TRANSIENT = 0, 1  # hsx's exit codes (docs: contract)


# ---------------------------------------------------------------------------------------------
# datasets


BOS = 1  # the tiny model's BOS: hsx requires pre-tokenized rows to start with it, as the template does
FIRST_PLAIN_ID = 5  # ids 0..4 are the tiny tokenizer's special tokens


def token_rows(lengths: list[int], seed: int, prefix: str) -> list[dict[str, Any]]:
    """Pre-tokenized rows of exactly these lengths: BOS, then random non-special ids."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = [BOS, *rng.integers(FIRST_PLAIN_ID, 512, n - 1).tolist()]
        mask = (rng.random(n) < 0.5).astype(int).tolist()
        mask[0], mask[-1] = 0, 1
        rows.append({"id": f"{prefix}{i}", "input_ids": ids, "loss_mask": mask})
    return rows


def chat_rows(n: int, prefix: str) -> list[dict[str, Any]]:
    words = ["alpha", "beta", "gamma", "delta", "capital", "plus", "times", "code", "tests", "small", "river"]
    rows = []
    for i in range(n):
        user = " ".join(words[(i * 7 + k) % len(words)] for k in range(3 + 9 * i))
        answer = " ".join(words[(i * 5 + k) % len(words)] for k in range(2 + 6 * i))
        messages = [
            {"role": "user", "content": f"Q{i}: {user}?"},
            {"role": "assistant", "content": f"{answer}."},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": "and then"},
                {"role": "assistant", "content": f"then {i}"},
            ]
        rows.append({"id": f"{prefix}{i}", "messages": messages})
    return rows


def interleave(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected(rows: list[dict[str, Any]], hf_tokenizer: Any) -> dict[int, tuple[list[int], list[int]]]:
    """(ids, loss mask) each dataset index must come out with."""
    out = {}
    for i, row in enumerate(rows):
        if "input_ids" in row:
            out[i] = (row["input_ids"], row["loss_mask"])
        else:
            out[i] = chat_expectation(hf_tokenizer, row["messages"])
    return out


# ---------------------------------------------------------------------------------------------
# running hsx


def config(tmp: Path, server: SGLangServer, dataset: Path, run_id: str, **over: Any) -> Path:
    cfg: dict[str, Any] = {
        "runId": run_id,
        "dataset": {"uri": str(dataset), "maxLength": MAX_LENGTH},
        "output": {"uri": str(tmp / "out"), "shardTargetBytes": 1 << 20},
        "modelPath": str(server.model),
        "serverUrl": server.url,
        "dumpDir": str(server.dump_dir),
        "concurrency": 8,
        "progressPort": 0,
        "logIntervalSeconds": 60,
        "validation": {"dumpTimeoutSeconds": 60, "maxRetries": 2},
        **over,
    }
    if server.layer_ids:
        cfg["auxLayerIds"] = list(server.layer_ids)
    if server.engine != "sglang":
        cfg["engine"] = server.engine
    path = tmp / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_extract(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen([HSX, "extract", "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT)


def run_extract(cfg: Path, log: Path, timeout: float = 600) -> int:
    proc = start_extract(cfg, log)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def check_run(
    run_uri: Path, rows: list[dict[str, Any]], hf_model: Any, hf_tokenizer: Any, capture: list[int],
    final_state: str = protocol.FINAL_POST_NORM, engine_name: str | None = None,
) -> dict[str, float]:  # fmt: skip
    """Verify passes, nothing quarantined, every row stored once and equal to transformers. The engine is
    the one that dumps ``final_state`` by default unless ``engine_name`` says which."""
    report = verify_json(run_uri)
    assert report["ok"] and report["manifest"], report
    assert report["quarantined"] == 0 and report["samples"] == len(rows), report
    manifest = json.loads((run_uri / "manifest.json").read_text())
    versions = {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}
    engine = engine_name or {protocol.FINAL_POST_NORM: "sglang", protocol.FINAL_PRE_NORM: "vllm"}[final_state]
    assert manifest["capture"] == {
        "engine": engine,
        "engineVersion": versions[engine],
        "layerIds": capture,
        "layerConvention": "layer-input",
        "finalState": final_state,
        "dtype": "bfloat16",
    }
    stored = read_output(run_uri)
    want = expected(rows, hf_tokenizer)
    assert sorted(stored) == sorted(want)
    worst = {"aux_max_abs": 0.0, "final_max_abs": 0.0}
    for index, rec in stored.items():
        ids, mask = want[index]
        assert rec.sample_id == rows[index]["id"]
        assert rec.input_ids == ids, f"sample {index}: ids differ from what was sent"
        assert rec.loss_mask == mask, f"sample {index}: loss mask differs"
        assert len(rec.loss_mask) == len(ids) and set(rec.loss_mask) <= {0, 1}
        errs = assert_matches_transformers(f"sample {index} ({rows[index]['id']})", ids, rec.aux, rec.final,
                                           hf_model, capture, final_state)  # fmt: skip
        worst = {k: max(worst[k], v) for k, v in errs.items()}
    return worst


def progress(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=2) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except OSError:
        return None


def wait_for(path: Path, timeout: float = 60) -> Path:
    """A dump may appear shortly after the HTTP answer (the producer writes it from a thread)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no dump at {path}"
        time.sleep(0.05)
    return path
