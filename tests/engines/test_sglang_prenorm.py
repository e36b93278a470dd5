"""The pre-norm final state from the real SGLang server (sglang_hook/prenorm.py, issue 35 item 4).

The server runs with the environment the operator gives it for ``model.finalState: pre-norm``
(launch.server_env); the extractor runs with ``finalState: pre-norm``. Every stored final state is
compared with the input of transformers' final norm of the same ids, and the manifest says pre-norm,
with chunked prefill (the norm's input of each chunk's forward) and plain requests decoding alongside.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor import protocol
from hsx_extractor.tools.export import export
from tests.engines.runs import (
    EXIT_OK,
    chat_rows,
    check_run,
    config,
    interleave,
    run_extract,
    token_rows,
    write_jsonl,
)
from tests.engines.sglang_server import SGLangServer

pytestmark = pytest.mark.slow

DEFAULT_CAPTURE = [2, 4, 5]  # the 8-layer tiny Llama with EAGLE-3's default layer ids


def test_prenorm_final_state_matches_the_norms_input(
    tmp_path: Path, sglang_server_factory: Callable[..., SGLangServer], hf_model: Any, hf_tokenizer: Any
) -> None:
    server = sglang_server_factory("prenorm", final_state=protocol.FINAL_PRE_NORM, chunked_prefill_size=64)
    lengths = [1, 2, 17, 63, 64, 65, 129, 200, 301]
    rows = interleave(token_rows(lengths, seed=21, prefix="p") + chat_rows(3, prefix="pc"), seed=22)
    dataset = write_jsonl(tmp_path / "prenorm.jsonl", rows)
    stop = threading.Event()
    decoded: list[int] = []

    def plain_traffic() -> None:
        rng = np.random.default_rng(23)
        while not stop.is_set():
            ids = rng.integers(0, 512, int(rng.integers(5, 100))).tolist()
            answer = server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            decoded.append(int(answer["meta_info"]["completion_tokens"]))

    thread = threading.Thread(target=plain_traffic, daemon=True)
    thread.start()
    try:
        cfg = config(tmp_path, server, dataset, "prenorm", finalState=protocol.FINAL_PRE_NORM)
        code = run_extract(cfg, tmp_path / "extract.log")
    finally:
        stop.set()
        thread.join(120)
    assert code == EXIT_OK, (tmp_path / "extract.log").read_text()[-3000:]
    assert decoded and max(decoded) > 1, "plain requests decoded alongside"
    worst = check_run(
        tmp_path / "out" / "prenorm", rows, hf_model, hf_tokenizer, DEFAULT_CAPTURE,
        final_state=protocol.FINAL_PRE_NORM, engine_name="sglang",
    )  # fmt: skip
    print(f"real SGLang pre-norm vs transformers' final-norm input, max abs error: {worst}")
    # What this buys an SGLang user: speculators' layout (pre-norm only) is written as stored.
    record = export(str(tmp_path / "out" / "prenorm"), "speculators", tmp_path / "speculators")
    assert record["sourceFinalState"] == protocol.FINAL_PRE_NORM and record["finalNormApplied"] is None, record
    assert record["samples"] == len(rows), record
