"""The consistency check against the real SGLang server (pinned release, CPU, tiny random Llama).

A correct capture passes: every checked request's captured final state, through the model's lm_head
read by the extractor with numpy, gives SGLang's own top-5 next-token logprobs. A wrong capture is
made by a relay between SGLang's dump directory and the extractor's that rewrites each dump's final
state (everything else, shapes and ids included, stays valid, so only this check can notice):

* ``aux_as_final``: the last captured aux layer (a pre-norm residual state of another layer) as the
  final state: a wrong layer, not normed;
* ``shifted``: final rows moved up by one position (row p holds p + 1's state): an off-by-one slice.

Both must fail the run with CaptureInconsistent before its end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor import protocol
from tests.engines.sglang_server import SGLangServer
from tests.engines.test_sglang_real import config, run_extract, token_rows, write_jsonl

pytestmark = pytest.mark.slow

EXIT_OK, EXIT_PERMANENT = 0, 3  # hsx's exit codes (contract)


def spoil(fault: str, dump: protocol.Dump) -> np.ndarray:
    final = np.array(dump.hidden_states)
    h = dump.meta.hidden_size
    if fault == "aux_as_final":
        return np.ascontiguousarray(np.array(dump.aux_hidden_states)[:, -h:])
    if fault == "shifted":
        return np.ascontiguousarray(np.concatenate([final[1:], final[-1:]]))
    raise ValueError(fault)


class Relay:
    """Moves every complete file from SGLang's dump directory to the extractor's, spoiling dumps."""

    def __init__(self, source: Path, target: Path, fault: str) -> None:
        self.source, self.target, self.fault = source, target, fault
        self.moved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Relay:
        self.target.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for f in sorted(self.source.iterdir()):
                if protocol.rid_of(f.name) is None:
                    continue  # a partial file: not complete yet
                if f.name.endswith(".safetensors"):
                    dump = protocol.read_dump(f)
                    final = spoil(self.fault, dump)
                    protocol.write_dump(self.target, dump.meta, np.array(dump.input_ids), np.array(dump.aux_hidden_states), final)
                    f.unlink()
                else:
                    os.replace(f, self.target / f.name)
                self.moved += 1
            time.sleep(0.02)


def final_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def rows(n: int) -> list[dict[str, Any]]:
    lengths = [int(x) for x in np.random.default_rng(7).integers(20, 300, n)]
    return token_rows(lengths, seed=8, prefix="k")


def test_a_correct_capture_agrees_with_sglangs_logprobs(tmp_path: Path, sglang_server: SGLangServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(24))
    term = tmp_path / "term.json"
    check = {"samplesPerShard": 24}  # every request: the widest measurement of the error
    cfg = config(tmp_path, sglang_server, dataset, "ok", terminationMessagePath=str(term),
                 validation={"dumpTimeoutSeconds": 60, "maxRetries": 2, "consistency": check})  # fmt: skip
    assert run_extract(cfg, tmp_path / "extract.log") == EXIT_OK, (tmp_path / "extract.log").read_text()[-3000:]
    report = final_report(term)
    assert report["consistencyChecked"] == 24 and report["consistencyFailed"] == 0, report
    manifest = json.loads((tmp_path / "out" / "ok" / "manifest.json").read_text())
    worst = max(s["consistency"]["maxLogprobError"] for s in manifest["shards"])
    # SGLang runs fp32 on CPU; the capture is bf16: the error is the capture's rounding alone.
    assert worst < 0.005, worst
    print(f"\nconsistency on real SGLang: 24 requests x 4 positions, max |logprob error| {worst:.2e}")
    assert all(len(s["layerNorms"]["aux"]) == 3 for s in manifest["shards"])


@pytest.mark.parametrize("fault", ["aux_as_final", "shifted"])
def test_a_spoiled_capture_fails_the_run_with_capture_inconsistent(
    tmp_path: Path, sglang_server: SGLangServer, fault: str
) -> None:
    assert sglang_server.dump_dir is not None
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(48))
    term = tmp_path / "term.json"
    relayed = tmp_path / "relayed"
    check = {"samplesPerShard": 8, "minChecks": 4}
    cfg = config(tmp_path, sglang_server, dataset, f"bad-{fault.replace('_', '-')}", terminationMessagePath=str(term),
                 dumpDir=str(relayed), validation={"dumpTimeoutSeconds": 60, "maxRetries": 2, "consistency": check})  # fmt: skip
    with Relay(sglang_server.dump_dir, relayed, fault) as relay:
        code = run_extract(cfg, tmp_path / "extract.log")
    log = (tmp_path / "extract.log").read_text()
    assert code == EXIT_PERMANENT, log[-3000:]
    report = final_report(term)
    assert (report["lastError"] or "").startswith("CaptureInconsistent:"), report
    assert report["consistencyFailed"] >= 4 and report["consistencyFailed"] == report["consistencyChecked"]
    assert report["samplesDone"] < report["samplesTotal"] and relay.moved > 0  # early, and through the relay
    assert "CaptureInconsistent" in log
