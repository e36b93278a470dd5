"""`hsx extract` against the real SGLang server (the pinned release, on CPU, tiny random Llama).

The server is started with exactly the operator launcher's argv and environment (plus CPU flags)
and the hook installed by the Dockerfile's own steps (conftest.py). Every stored sample is compared
with a transformers forward of the same ids: ids and lengths exact, aux and final states within
bf16 rounding. The sgl_kernel stand-in SGLang imports on CPU must never have been called.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor import protocol
from tests.engines.compare import (
    HSX,
    assert_matches_transformers,
    bf16_to_float,
)
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
from tests.engines.sglang_server import PATCHED_LINE, STARTED, SGLangServer, free_port
from tests.engines.sglang_venv import venv_dir

pytestmark = pytest.mark.slow

# Capture layers of the 8-layer tiny Llama (docs/sglang.md): no ids -> EAGLE-3's [2, N//2, N-3];
# ids [a, b, c] -> [a+1, b+1, c+1].
DEFAULT_CAPTURE = [2, 4, 5]
CHUNKED_LAYER_IDS = [0, 3, 5]
CHUNKED_CAPTURE = [1, 4, 6]


# ---------------------------------------------------------------------------------------------
# tests


def test_hook_installed_as_the_image_installs_it(sglang_server: SGLangServer, hsx_for_sglang: Path) -> None:
    pth = next(venv_dir().glob("lib/python3*/site-packages/hsx_sglang_hook.pth"))
    assert pth.read_bytes() == (hsx_for_sglang / "hsx_extractor" / "sglang_hook" / pth.name).read_bytes()
    assert PATCHED_LINE in sglang_server.log_text(), "the server's scheduler was not patched"
    assert sglang_server.argv()[1:4] == ["-m", "sglang.launch_server", "--model-path"]
    # Overlap scheduling on, as in production (SGLang prints its resolved arguments).
    assert "'disable_overlap_schedule': False" in sglang_server.log_text()


def test_extract_mixed_lengths_concurrently(
    tmp_path: Path, sglang_server: SGLangServer, hf_model: Any, hf_tokenizer: Any
) -> None:
    """8 requests in flight, 1..400 tokens, token and chat rows, while other clients send plain
    requests (no hidden states; some decoding) to the same server, so batches mix both kinds."""
    lengths = [1, 2, 3, 5, 17, 31, 63, 64, 65, 99, 130, 150, 200, 257, 333, 400]
    rows = interleave(token_rows(lengths, seed=1, prefix="t") + chat_rows(6, prefix="c"), seed=2)
    dataset = write_jsonl(tmp_path / "mixed.jsonl", rows)
    before = len(sglang_server.prefill_batch_sizes())
    stop = threading.Event()
    plain_answers: list[int] = []

    def plain_traffic(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = rng.integers(0, 512, int(rng.integers(5, 300))).tolist()
            params = {"max_new_tokens": int(rng.choice([1, 4])), "temperature": 0}
            answer = sglang_server.generate({"input_ids": ids, "sampling_params": params})
            plain_answers.append(len(answer["meta_info"].get("hidden_states") or []))

    threads = [threading.Thread(target=plain_traffic, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        code = run_extract(config(tmp_path, sglang_server, dataset, "mixed"), tmp_path / "extract.log")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert code == EXIT_OK, (tmp_path / "extract.log").read_text()[-3000:]
    assert plain_answers and not any(plain_answers), "plain requests must get no hidden states"
    worst = check_run(tmp_path / "out" / "mixed", rows, hf_model, hf_tokenizer, DEFAULT_CAPTURE)
    print(
        f"real SGLang vs transformers, max abs error: {worst}; {len(plain_answers)} plain requests alongside"
    )
    # Requests of very different lengths were in flight together: SGLang batched several at once.
    batches = sglang_server.prefill_batch_sizes()[before:]
    assert max(batches) >= 2, f"SGLang never batched two requests: {batches}"
    # Nothing of this run waits in the dump directory: every dump was taken by the extractor. (The server is
    # the session's: a run of another test that failed on purpose may have left dumps that arrived after it
    # exited; its own next start would sweep them.)
    assert not [p.name for p in sglang_server.dump_dir.iterdir() if p.name.startswith("hsx-mixed-")]  # type: ignore[union-attr]


def test_repeated_prompts_get_whole_dumps(sglang_server: SGLangServer, hf_model: Any) -> None:
    """The same prompt twice and a prompt extending it: with --disable-radix-cache (server_args) no
    prefix is reused, so each dump has every row (a cache hit would leave rows out)."""
    base = np.random.default_rng(11).integers(0, 512, 150).tolist()
    prompts = {"rep-a": base, "rep-b": base, "rep-c": [*base, 1, 2, 3]}
    for rid, ids in prompts.items():
        sglang_server.generate(_body(ids, rid))
    for rid, ids in prompts.items():
        dump = protocol.read_dump(wait_for(protocol.dump_path(sglang_server.dump_dir, rid)))  # type: ignore[arg-type]
        assert dump.input_ids.tolist() == ids and dump.meta.seq_len == len(ids)
        assert_matches_transformers(
            rid, ids, dump.aux_hidden_states, dump.hidden_states, hf_model, DEFAULT_CAPTURE
        )
    cached = [int(c) for c in re.findall(r"#cached-token: (\d+)", sglang_server.log_text())]
    assert cached and not any(cached), "SGLang reused a cached prefix"


def test_reference_server_and_sglang_write_the_same_dump(tmp_path: Path, sglang_server: SGLangServer) -> None:
    ref_dumps = tmp_path / "ref-dumps"
    ref_dumps.mkdir()
    port = free_port()
    log = open(tmp_path / "reference.log", "wb")  # noqa: SIM115 - closed below
    ref = subprocess.Popen(
        [HSX, "serve-reference", "--model", str(sglang_server.model), "--dump-dir", str(ref_dumps),
         "--host", "127.0.0.1", "--port", str(port), "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ref_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while not _healthy(ref_url):
            assert ref.poll() is None, (tmp_path / "reference.log").read_text()
            assert time.monotonic() < deadline, "reference server did not start"
            time.sleep(0.5)
        rng = np.random.default_rng(7)
        for n, length in enumerate([1, 37, 300]):
            ids = rng.integers(0, 512, length).tolist()
            rid = f"cmp-{n}-{length}"
            # The body the extractor sends (docs/sglang.md): one new token, hidden states asked for.
            body = _body(ids, rid)
            answer = sglang_server.generate(body)
            assert answer["meta_info"]["hidden_states"] == [], "the hook must keep states off HTTP"
            _post(ref_url, body)
            got = protocol.read_dump(wait_for(protocol.dump_path(sglang_server.dump_dir, rid)))  # type: ignore[arg-type]
            ref_dump = protocol.read_dump(wait_for(protocol.dump_path(ref_dumps, rid)))
            assert got.meta.producer.startswith("hsx-sglang-hook/sglang-0.5.23"), got.meta.producer
            for name in ("rid", "seq_len", "hidden_size", "capture_layers"):
                assert getattr(got.meta, name) == getattr(ref_dump.meta, name), name
            assert list(got.meta.capture_layers) == DEFAULT_CAPTURE and got.meta.seq_len == length
            assert got.input_ids.tolist() == ref_dump.input_ids.tolist() == ids
            for name in ("aux_hidden_states", "hidden_states"):
                a, b = getattr(got, name), getattr(ref_dump, name)
                assert a.shape == b.shape, name
                # Two bf16 roundings of nearly equal float32 values: at most one bf16 step apart.
                fa, fb = bf16_to_float(a), bf16_to_float(b)
                excess = float(((fa - fb).abs() - 2.0**-7 * fb.abs()).max())
                assert excess <= 1e-4, (
                    f"{rid} {name}: SGLang and the reference server differ by more than bf16"
                )
    finally:
        ref.terminate()
        try:
            ref.wait(30)
        except subprocess.TimeoutExpired:
            ref.kill()
        log.close()


def test_chunked_prefill_server_killed_and_restarted(
    tmp_path: Path,
    sglang_server_factory: Callable[..., SGLangServer],
    hf_model: Any,
    hf_tokenizer: Any,
) -> None:
    """Chunked prefill (64-token chunks, samples up to 400 tokens), explicit layer ids; SIGKILL the
    whole server mid-run, restart it with the same argv, rerun `hsx extract`: it resumes from the
    committed shards and every sample matches transformers."""
    phases: dict[str, float] = {}
    t = time.monotonic()
    server = sglang_server_factory("chunked", chunked_prefill_size=64, layer_ids=CHUNKED_LAYER_IDS)
    phases["server start"], t = time.monotonic() - t, time.monotonic()
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
        phases["extract until a shard is committed"], t = time.monotonic() - t, time.monotonic()
        server.kill()
        killed_at = seen
        # Its requests fail; after its connection retries the extractor stops with a transient error.
        code = proc.wait(180)
        phases["extractor gives up"], t = time.monotonic() - t, time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == EXIT_TRANSIENT, f"extractor exit {code} after the server died:\n{log.read_text()[-3000:]}"
    commits_before = {p.name: p.read_bytes() for p in (run_uri / "commits").iterdir()}
    assert commits_before and not (run_uri / "manifest.json").exists()

    server.start()  # same argv, environment, port and dump directory (with whatever the kill left)
    phases["server restart"], t = time.monotonic() - t, time.monotonic()
    code = run_extract(cfg, log)
    phases["resumed extract"], t = time.monotonic() - t, time.monotonic()
    assert code == EXIT_OK, log.read_text()[-3000:]
    for name, data in commits_before.items():
        assert (run_uri / "commits" / name).read_bytes() == data, f"committed shard {name} was redone"
    worst = check_run(run_uri, rows, hf_model, hf_tokenizer, CHUNKED_CAPTURE)
    phases["verify and compare"] = time.monotonic() - t
    print(f"killed at {killed_at['samplesDone']}/{killed_at['samplesTotal']}; max abs error {worst}")
    print("phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))

    # Chunked prefill really ran: no prefill batch took more than a chunk, samples were longer.
    tokens = []
    for start in range(1, server.starts + 1):
        tokens += [int(t) for t in _new_tokens(server.log_text(start))]
    assert tokens and max(tokens) <= 64, f"a prefill batch exceeded the 64-token chunk: {max(tokens)}"
    assert max(lengths) > 64


def test_sgl_kernel_standin_was_never_called() -> None:
    """Every server of this session imported the stand-in and called none of its functions."""
    servers = [s for s in STARTED if s.engine == "sglang"]
    if not servers:
        pytest.skip("no SGLang server ran in this session")
    for server in servers:
        assert server.standin_calls() == [], (
            f"SGLang called the sgl_kernel stand-in: {server.standin_calls()}"
        )
        assert "HSX-SGL-KERNEL-STANDIN-CALLED" not in server.log_text()
    assert any(server.standin_accesses() for server in servers), "the stand-in was never even imported"


# ---------------------------------------------------------------------------------------------


def _body(ids: list[int], rid: str) -> dict[str, Any]:
    """The body the extractor sends (docs/sglang.md): one new token, hidden states asked for."""
    return {
        "input_ids": ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
    }


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _new_tokens(log: str) -> list[str]:
    return re.findall(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)", log)
