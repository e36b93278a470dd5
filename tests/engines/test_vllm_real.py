"""`hsx extract` against the real vLLM server (the pinned release's CPU build, tiny random Llama).

The server is started with exactly the operator launcher's argv and environment (plus CPU flags),
with hsx's KV connector loaded by module path from this checkout's wheel. Every stored sample is
compared with a transformers forward of the same ids: ids and lengths exact, aux states and the
pre-norm final state within bf16 rounding.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor import protocol
from hsx_extractor.reader import OutputReader
from tests.engines.compare import assert_matches_transformers
from tests.engines.runs import (
    EXIT_OK,
    EXIT_TRANSIENT,
    chat_rows,
    check_run,
    config,
    interleave,
    progress,
    run_extract,
    start_extract,
    token_rows,
    wait_for,
    write_jsonl,
)
from tests.engines.sglang_server import free_port
from tests.engines.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PRE = protocol.FINAL_PRE_NORM
# The same capture layers as SGLang's for the same spec (model.capture_layers): no ids -> [2, 4, 5];
# ids [0, 3, 5] -> [1, 4, 6]. vLLM is started with these plus 8 (the final state).
DEFAULT_CAPTURE = [2, 4, 5]
CHUNKED_LAYER_IDS = [0, 3, 5]
CHUNKED_CAPTURE = [1, 4, 6]


def completion(server: VLLMServer, ids: list[int], rid: str | None, header: str | None = None) -> dict[str, Any]:
    """POST /v1/completions (one token) with hsx's rid in kv_transfer_params (None: a plain request)."""
    body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    if rid is not None:
        body["kv_transfer_params"] = {protocol.VLLM_RID_PARAM: rid}
    headers = {"Content-Type": "application/json", **({"X-Request-Id": header} if header else {})}
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_dump_is_named_by_the_rid_hsx_sent(vllm_server: VLLMServer, vllm_hf_model: Any) -> None:
    """vLLM rewrites request ids; the dump's name and meta are hsx's rid from kv_transfer_params,
    whatever X-Request-Id says. A plain request (no rid) leaves no dump."""
    assert vllm_server.argv()[1:4] == ["-m", "hsx_extractor.vllm_hook", "serve"]
    exec_line = f"exec {' '.join(vllm_server.vllm_argv())}"
    assert exec_line in vllm_server.log_text(), "the launcher did not exec the expected vLLM command"
    dump_dir = vllm_server.dump_dir
    assert dump_dir is not None
    ids = np.random.default_rng(21).integers(5, 512, 77).tolist()
    answer = completion(vllm_server, ids, "hsx-rid-test-0-a0", header="some-router-id")
    # vLLM's own id is built from the header; the connector never uses it.
    assert answer["id"].startswith("cmpl-some-router-id"), answer["id"]
    dump = protocol.read_dump(wait_for(protocol.dump_path(dump_dir, "hsx-rid-test-0-a0")))
    assert dump.meta.rid == "hsx-rid-test-0-a0"
    assert dump.meta.producer == "hsx-vllm-connector/vllm-0.32.0"
    assert dump.meta.final_state == PRE and list(dump.meta.capture_layers) == DEFAULT_CAPTURE
    assert dump.input_ids.tolist() == ids
    assert_matches_transformers("rid-test", ids, dump.aux_hidden_states, dump.hidden_states, vllm_hf_model,
                                DEFAULT_CAPTURE, PRE)  # fmt: skip
    before = sorted(p.name for p in dump_dir.iterdir())
    completion(vllm_server, ids, None, header="plain")
    time.sleep(2)
    assert sorted(p.name for p in dump_dir.iterdir()) == before, "a plain request left a file"
    protocol.dump_path(dump_dir, "hsx-rid-test-0-a0").unlink()


def test_repeated_prompts_get_whole_dumps(vllm_server: VLLMServer, vllm_hf_model: Any) -> None:
    """The same prompt twice and one extending it: prefix caching is off (server_args), so every dump
    has every row."""
    base = np.random.default_rng(11).integers(5, 512, 150).tolist()
    prompts = {"rep-a": base, "rep-b": base, "rep-c": [*base, 6, 7, 8]}
    for rid, ids in prompts.items():
        completion(vllm_server, ids, rid)
    for rid, ids in prompts.items():
        path = wait_for(protocol.dump_path(vllm_server.dump_dir, rid))  # type: ignore[arg-type]
        dump = protocol.read_dump(path)
        assert dump.input_ids.tolist() == ids and dump.meta.seq_len == len(ids)
        assert_matches_transformers(rid, ids, dump.aux_hidden_states, dump.hidden_states, vllm_hf_model,
                                    DEFAULT_CAPTURE, PRE)  # fmt: skip
        path.unlink()


def test_extract_mixed_lengths_concurrently(
    tmp_path: Path, vllm_server: VLLMServer, vllm_hf_model: Any, vllm_hf_tokenizer: Any
) -> None:
    """8 requests in flight, 1..400 tokens, token and chat rows, while other clients send plain
    requests to the same server, so batches mix both kinds."""
    lengths = [1, 2, 3, 5, 17, 31, 63, 64, 65, 99, 130, 150, 200, 257, 333, 400]
    rows = interleave(token_rows(lengths, seed=1, prefix="t") + chat_rows(6, prefix="c"), seed=2)
    dataset = write_jsonl(tmp_path / "mixed.jsonl", rows)
    stop = threading.Event()
    plain: list[int] = []

    def plain_traffic(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            completion(vllm_server, rng.integers(5, 512, int(rng.integers(5, 300))).tolist(), None)
            plain.append(1)

    threads = [threading.Thread(target=plain_traffic, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        code = run_extract(config(tmp_path, vllm_server, dataset, "mixed"), tmp_path / "extract.log")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert code == EXIT_OK, (tmp_path / "extract.log").read_text()[-3000:]
    run_uri = tmp_path / "out" / "mixed"
    worst = check_run(run_uri, rows, vllm_hf_model, vllm_hf_tokenizer, DEFAULT_CAPTURE, PRE)
    assert OutputReader(str(run_uri)).final_state == PRE
    print(f"real vLLM vs transformers, max abs error: {worst}; {len(plain)} plain requests alongside")
    assert not [p.name for p in vllm_server.dump_dir.iterdir() if p.name.startswith("hsx-")]  # type: ignore[union-attr]


def test_chunked_prefill_server_killed_and_restarted(
    tmp_path: Path,
    vllm_server_factory: Callable[..., VLLMServer],
    vllm_hf_model: Any,
    vllm_hf_tokenizer: Any,
) -> None:
    """Chunked prefill (64-token budget per step, samples up to 400 tokens), explicit layer ids;
    SIGKILL the whole server mid-run, restart it with the same argv, rerun `hsx extract`: it resumes
    from the committed shards and every sample matches transformers."""
    server = vllm_server_factory("chunked", chunked_prefill_size=64, layer_ids=CHUNKED_LAYER_IDS)
    assert '"eagle_aux_hidden_state_layer_ids":[1,4,6,8]' in " ".join(server.vllm_argv())
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in rng.integers(1, 401, 64)] + [1, 64, 65, 128, 129, 400]
    rows = interleave(token_rows(lengths, seed=4, prefix="k") + chat_rows(4, prefix="kc"), seed=5)
    dataset = write_jsonl(tmp_path / "chunked.jsonl", rows)
    port = free_port()
    cfg = config(tmp_path, server, dataset, "chunked", progressPort=port, progressHost="127.0.0.1")
    log = tmp_path / "extract.log"
    run_uri = tmp_path / "out" / "chunked"

    proc = start_extract(cfg, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"extractor ended before the kill point:\n{log.read_text()[-3000:]}"
            seen = progress(port)
            if seen and seen["shardsCommitted"] >= 1:
                assert seen["samplesDone"] < seen["samplesTotal"], f"run finished before the kill: {seen}"
                break
            assert time.monotonic() < deadline, "no shard committed within 300 s"
            time.sleep(0.02)
        server.kill()
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == EXIT_TRANSIENT, f"extractor exit {code} after the server died:\n{log.read_text()[-3000:]}"
    commits_before = {p.name: p.read_bytes() for p in (run_uri / "commits").iterdir()}
    assert commits_before and not (run_uri / "manifest.json").exists()

    server.start()
    assert run_extract(cfg, log) == EXIT_OK, log.read_text()[-3000:]
    for name, data in commits_before.items():
        assert (run_uri / "commits" / name).read_bytes() == data, f"committed shard {name} was redone"
    worst = check_run(run_uri, rows, vllm_hf_model, vllm_hf_tokenizer, CHUNKED_CAPTURE, PRE)
    print(f"killed at {seen['samplesDone']}/{seen['samplesTotal']}; max abs error {worst}")
    # Chunked prefill ran: vLLM takes at most --max-num-batched-tokens (64) tokens a step, and
    # samples were longer, so their rows came from several forwards.
    argv = server.vllm_argv()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "64" and "--enable-chunked-prefill" in argv
    assert max(lengths) > 64
