"""Whole runs, in process, against the real reference server and a real store."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hsx_extractor import protocol
from hsx_extractor.config import ExtractConfig, OutputSpec
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, ProgressReport
from hsx_extractor.protocol import dump_bytes_bound
from hsx_extractor.run import collect, engine
from hsx_extractor.run.dataset import Prepared, read_samples
from hsx_extractor.run.extraction import Extraction, RunResult
from hsx_extractor.run.progress import Progress, bound_port, start_progress_server
from hsx_extractor.run.runner import extract
from hsx_extractor.run.sources import iter_rows
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage import native
from hsx_extractor.storage.shard_format import SampleRecord
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.tinymodel import example_dataset_path
from hsx_extractor.tools.verify import run_verify

from .helpers import RefServer, base_config, chat_rows, write_jsonl


def run(cfg: dict[str, Any]) -> tuple[int, RunResult | None, Progress]:
    config = ExtractConfig.model_validate(cfg)
    progress = Progress(config.runId, config.replicaIndex)
    code, result = asyncio.run(extract(config, progress))
    return code, result, progress


def stored(cfg: dict[str, Any]) -> tuple[dict[int, SampleRecord], dict[int, str]]:
    """Every stored sample and quarantine reason of a run, read back; each index at most once."""
    store = open_store(OutputSpec.model_validate(cfg["output"]), cfg["runId"])
    samples: dict[int, SampleRecord] = {}
    quarantined: dict[int, str] = {}
    for k in sorted(store.committed_shards()):
        commit = store.get_commit(k)
        assert commit is not None
        header = store.read_header(k)
        for entry in header.samples:
            assert entry.index not in samples
            samples[entry.index] = store.read_sample(k, header, entry)
        for q in commit.quarantine:
            assert q.index not in quarantined and q.index not in samples
            quarantined[q.index] = q.reason
    return samples, quarantined


def expected_tokens(tokenizer: ChatTokenizer, dataset: Path, max_length: int) -> dict[int, Prepared]:
    return {
        s.index: s
        for s in read_samples(iter_rows(str(dataset)), tokenizer, max_length)
        if isinstance(s, Prepared)
    }


def verified(cfg: dict[str, Any]) -> dict[str, Any]:
    report = run_verify(str(Path(cfg["output"]["uri"]) / cfg["runId"]))
    assert report.ok, report.summary_text()
    return report.to_dict()


def test_bundled_dataset_end_to_end(tmp_path: Path, ref_server: RefServer, tokenizer: ChatTokenizer) -> None:
    cfg = base_config(tmp_path, ref_server, example_dataset_path(), dataset__maxLength=256)
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    samples, quarantined = stored(cfg)
    want = expected_tokens(tokenizer, example_dataset_path(), 256)
    duplicate = next(i for i, r in quarantined.items() if r == "duplicate_id")
    assert set(samples) == set(want) - {duplicate}
    for index, rec in samples.items():
        assert rec.input_ids.tolist() == want[index].input_ids.tolist()
        assert rec.loss_mask.tolist() == want[index].loss_mask.tolist()
        assert rec.sample_id == want[index].sample_id
        assert rec.aux_hidden_states.shape == (rec.seq_len, 3 * 64) and rec.hidden_states.shape == (
            rec.seq_len,
            64,
        )
    assert sorted(quarantined.values()) == sorted(
        [
            "invalid_json",
            "invalid_utf8",
            "empty_messages",
            "unknown_role",
            "missing_role",
            "non_string_content",
            "ids_out_of_vocab",
            "mask_length_mismatch",
            "no_assistant_tokens",
            "too_long",
            "duplicate_id",
        ]
    )
    run_info = result.manifest["run"]
    assert result.manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert result.manifest["capture"]["layerIds"] == [2, 4, 5] and run_info["hiddenSize"] == 64
    assert result.manifest["hsxVersion"] and run_info["model"]
    report = verified(cfg)
    assert report["samples"] == len(samples) and report["quarantined"] == 11 and report["duplicates"] == 0
    assert progress.tokens_done == sum(r.seq_len for r in samples.values())
    # Every dump was consumed and deleted.
    assert not [p for p in ref_server.dump_dir.iterdir() if p.name.startswith("hsx-run-")]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("swap", "id_mismatch"),
        ("drop", "no_dump"),
        ("truncate", "length_mismatch"),
        ("add_bos", "id_mismatch"),
        ("nan", "non_finite"),
        ("error", "server_error"),
    ],
)
def test_misbehaving_server_ends_in_the_right_reason(
    tmp_path: Path, ref_server: RefServer, fault: str, reason: str
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(9))
    ref_server.set_fault(fault, every=3)
    cfg = base_config(
        tmp_path,
        ref_server,
        dataset,
        run_id=f"f-{fault.replace('_', '')}",
        validation__dumpTimeoutSeconds=0.5,
    )
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    samples, quarantined = stored(cfg)
    assert quarantined == {0: reason, 3: reason, 6: reason}
    assert sorted(samples) == [1, 2, 4, 5, 7, 8]
    assert progress.quarantined == {reason: 3}
    verified(cfg)
    if fault == "drop":
        # A dump that never came was retried (maxRetries 1), with a new rid each time.
        faulted = ref_server.stats()["faulted"]
        assert len(faulted) == 6 and len(set(faulted)) == 6
        assert {protocol.parse_rid(r)[2] for r in faulted} == {0, 1}


@pytest.mark.parametrize("compression", ["none", "bf16-zstd", "fp8-e4m3"])
def test_inf_and_nan_are_quarantined_with_every_codec(tmp_path: Path, ref_server: RefServer, compression: str) -> None:
    # The dump's values are counted as the shard builder encodes them (one read of each dump): by the
    # byte-plane split for bf16-zstd, apart for the other codecs.
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(9))
    ref_server.set_fault("nan", every=3)
    cfg = base_config(tmp_path, ref_server, dataset, run_id=f"nan-{compression.split('-')[0]}", output__compression=compression)
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    samples, quarantined = stored(cfg)
    assert quarantined == {0: "non_finite", 3: "non_finite", 6: "non_finite"}
    assert sorted(samples) == [1, 2, 4, 5, 7, 8]
    details = {q["index"]: q["detail"] for q in result.manifest["quarantine"]}
    assert all(details[i].endswith(" Inf/NaN values") for i in (0, 3, 6)), details
    assert progress.quarantined == {"non_finite": 3}
    assert not [p for p in ref_server.dump_dir.iterdir() if p.name.startswith("hsx-")]  # refused dumps removed too
    verified(cfg)


def test_retry_recovers_a_dropped_dump(tmp_path: Path, ref_server: RefServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    ref_server.set_fault("drop", every=2, first_attempt_only=True)
    cfg = base_config(tmp_path, ref_server, dataset, validation__dumpTimeoutSeconds=0.5)
    code, _, _ = run(cfg)
    assert code == EXIT_OK
    samples, quarantined = stored(cfg)
    assert quarantined == {} and sorted(samples) == list(range(6))
    assert ref_server.stats()["requests"] == 6 + 3


def test_a_rate_limited_request_is_asked_again_not_quarantined(tmp_path: Path, ref_server: RefServer) -> None:
    """A 429 (or 408) is a router's word on load, not on the request: retried like a 5xx, under a new rid."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    ref_server.set_fault("rate_limit", every=2, first_attempt_only=True)
    cfg = base_config(tmp_path, ref_server, dataset, run_id="limited")
    code, _, progress = run(cfg)
    assert code == EXIT_OK, progress.last_error
    samples, quarantined = stored(cfg)
    assert quarantined == {} and sorted(samples) == list(range(6))
    stats = ref_server.stats()
    assert sorted(protocol.parse_rid(r)[1:] for r in stats["faulted"]) == [(0, 0), (2, 0), (4, 0)]
    assert stats["requests"] == 6 + 3


def test_a_lost_response_is_retried_under_a_new_rid(tmp_path: Path, ref_server: RefServer) -> None:
    """The server ran the request and wrote its dump, then the answer was lost. The retry must go
    out under a new rid (SGLang rejects a rid it has seen: the sample would be quarantined as
    server_error), and the abandoned rid's dump must not stay in shm."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    ref_server.set_fault("drop_response", every=2, first_attempt_only=True)
    cfg = base_config(tmp_path, ref_server, dataset, run_id="lost")
    code, _, progress = run(cfg)
    assert code == EXIT_OK, progress.last_error
    samples, quarantined = stored(cfg)
    assert quarantined == {} and sorted(samples) == list(range(6))
    stats = ref_server.stats()
    assert sorted(protocol.parse_rid(r)[1:] for r in stats["faulted"]) == [(0, 0), (2, 0), (4, 0)]
    assert stats["requests"] == 6 + 3
    # Consumed dumps went into shards, the cut requests' dumps were swept: nothing of the run is left.
    assert not [p.name for p in ref_server.dump_dir.iterdir() if "lost" in p.name]
    verified(cfg)


def test_mismatch_gate_stops_the_run_early(tmp_path: Path, ref_server: RefServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(80))
    ref_server.set_fault("truncate", every=2)
    cfg = base_config(
        tmp_path,
        ref_server,
        dataset,
        concurrency=2,
        validation__maxMismatchRate=0.2,
        validation__gateWindow=10,
        validation__gateMinSamples=6,
    )
    code, result, progress = run(cfg)
    assert code == EXIT_PERMANENT and result is None
    assert progress.state == "failed"
    assert re.search(r"mismatch gate: \d+ of the last \d+ samples mismatched", progress.last_error or "")
    assert ref_server.stats()["requests"] < 40  # stopped minutes in, not after the whole dataset
    assert not (tmp_path / "out" / "run" / "manifest.json").exists()


def test_on_mismatch_fail_stops_at_the_first(tmp_path: Path, ref_server: RefServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    ref_server.set_fault("nan", every=5)
    cfg = base_config(tmp_path, ref_server, dataset, validation__onMismatch="fail")
    code, _, progress = run(cfg)
    assert code == EXIT_PERMANENT
    assert "onMismatch=fail" in (progress.last_error or "") and "non_finite" in (progress.last_error or "")


def test_requests_are_concurrent_at_the_server(tmp_path: Path, ref_server: RefServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(16))
    ref_server.set_fault(None, delay_ms=100)
    cfg = base_config(tmp_path, ref_server, dataset, concurrency=4)
    assert run(cfg)[0] == EXIT_OK
    stats = ref_server.stats()
    assert stats["requests"] == 16
    assert 1 < stats["maxInFlight"] <= 4


def test_progress_and_metrics_serve_the_run_numbers(tmp_path: Path, ref_server: RefServer) -> None:
    rows: list[Any] = [*chat_rows(10), '{"id": "broken', {"id": "e", "messages": []}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    ref_server.set_fault("nan", every=4, delay_ms=50)
    cfg = ExtractConfig.model_validate(base_config(tmp_path, ref_server, dataset, concurrency=2))

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], str, RunResult]:
        progress = Progress(cfg.runId, cfg.replicaIndex)
        runner = await start_progress_server(progress, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{bound_port(runner)}"
        try:
            async with aiohttp.ClientSession() as http:
                task = asyncio.create_task(Extraction(cfg, progress).run())
                while progress.samples_done < 3 and not task.done():
                    await asyncio.sleep(0.02)
                async with http.get(f"{base}/progress") as r:
                    during = await r.json()
                result = await task
                async with http.get(f"{base}/progress") as r:
                    after = await r.json()
                async with http.get(f"{base}/metrics") as r:
                    metrics = await r.text()
        finally:
            await runner.cleanup()
        return during, after, metrics, result

    during, after, metrics, result = asyncio.run(scenario())
    assert during["state"] == "running" and 3 <= during["samplesDone"] < 12
    # A fresh run plans while it extracts: until the plan is stored the total is what was read so far.
    if during["planning"]:
        assert during["samplesDone"] <= during["samplesTotal"] <= 12 and during["etaSeconds"] is None
    else:
        assert during["samplesTotal"] == 12
    assert not after["planning"]
    assert set(after) == set(ProgressReport.model_fields)
    samples, _ = stored(base_config(tmp_path, ref_server, dataset))
    tokens = sum(r.seq_len for r in samples.values())
    bytes_stored = sum(c.bytes_stored for c in result.commits)
    assert after["state"] == "succeeded" and after["runId"] == "run" and after["replicaIndex"] == 0
    assert after["samplesTotal"] == after["samplesDone"] == 12
    assert after["samplesQuarantined"] == 5 and after["samplesWritten"] == 7  # apart: 7 + 5 = 12 done
    assert during["samplesWritten"] + during["samplesQuarantined"] == during["samplesDone"]
    assert after["quarantinedByReason"] == {"empty_messages": 1, "invalid_json": 1, "non_finite": 3}
    assert after["tokensDone"] == tokens and after["tokensPerSecond"] > 0
    assert after["shardsCommitted"] == after["shardsTotal"] == 1
    assert after["bytesCommitted"] == bytes_stored > 0
    assert after["requestsInFlight"] == 0 and after["etaSeconds"] == 0
    assert "non_finite" in after["lastError"]
    assert "hsx_samples_done_total 7.0" in metrics
    assert 'hsx_samples_quarantined_total{reason="non_finite"} 3.0' in metrics
    assert 'hsx_samples_quarantined_total{reason="invalid_json"} 1.0' in metrics
    assert f"hsx_tokens_done_total {float(tokens)}" in metrics
    assert f"hsx_bytes_committed_total {float(bytes_stored)}" in metrics
    assert "hsx_shards_committed_total 1.0" in metrics
    assert "hsx_shard_seal_seconds_count 1.0" in metrics and 'hsx_shard_seal_seconds_bucket{le="+Inf"} 1.0' in metrics
    assert "hsx_requests_in_flight 0.0" in metrics


def test_tokenizer_fingerprint_mismatch_fails_at_start(tmp_path: Path, ref_server: RefServer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    cfg = base_config(tmp_path, ref_server, dataset, dataset__expectedTokenizerFingerprint="0" * 64)
    code, _, progress = run(cfg)
    assert code == EXIT_PERMANENT
    assert "tokenizer fingerprint mismatch" in (progress.last_error or "")
    assert ref_server.stats()["requests"] == 0


def test_final_progress_is_left_as_the_termination_message(tmp_path: Path, ref_server: RefServer) -> None:
    """What the operator reads after the pod is gone; written on success and on failure."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(4), "not json"])
    message = tmp_path / "termination-log"
    code, _, _ = run(base_config(tmp_path, ref_server, dataset, terminationMessagePath=str(message)))
    final = json.loads(message.read_text())
    assert code == EXIT_OK and final["state"] == "succeeded"
    assert final["samplesDone"] == final["samplesTotal"] == 5 and final["samplesQuarantined"] == 1
    assert final["samplesWritten"] == 4
    assert final["shardsCommitted"] == final["shardsTotal"] and final["bytesCommitted"] > 0

    failed = base_config(
        tmp_path,
        ref_server,
        dataset,
        "other",
        terminationMessagePath=str(message),
        dataset__expectedTokenizerFingerprint="0" * 64,
    )
    assert run(failed)[0] == EXIT_PERMANENT
    final = json.loads(message.read_text())
    assert final["state"] == "failed" and "tokenizer fingerprint mismatch" in final["lastError"]
    assert len(message.read_bytes()) <= 4096


def test_a_resumed_run_counts_written_and_quarantined_apart(tmp_path: Path, ref_server: RefServer) -> None:
    """Shards committed before a restart count as done, split as their commit records say."""
    cfg = base_config(tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", [*chat_rows(4), "not json"]))
    assert run(cfg)[0] == EXIT_OK
    code, _, progress = run(cfg)  # everything is committed: all of it is resumed
    assert code == EXIT_OK and progress.samples_resumed == progress.samples_done == 5
    report = progress.report()
    assert (report.samplesWritten, report.samplesQuarantined) == (4, 1)
    assert "written=4 quarantined=1" in progress.log_line()
    assert progress.quarantine_summary() == "written 4, quarantined 1: invalid_json 1"


def test_server_with_another_vocab_fails_at_start(tmp_path: Path, ref_server: RefServer) -> None:
    model = tmp_path / "model"
    shutil.copytree(ref_server.model, model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 1000
    (model / "config.json").write_text(json.dumps(config))
    cfg = base_config(
        tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", chat_rows(3)), modelPath=str(model)
    )
    code, _, progress = run(cfg)
    assert code == EXIT_PERMANENT and "vocab size 512" in (progress.last_error or "")
    assert ref_server.stats()["requests"] == 0


def test_rerun_is_a_no_op_and_other_settings_are_refused(tmp_path: Path, ref_server: RefServer) -> None:
    cfg = base_config(tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", chat_rows(4)))
    assert run(cfg)[0] == EXIT_OK
    manifest = (tmp_path / "out" / "run" / "manifest.json").read_bytes()
    ref_server.set_fault(None)  # resets the request count
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.shards_done == []
    assert ref_server.stats()["requests"] == 0 and progress.samples_done == progress.samples_resumed == 4
    assert (tmp_path / "out" / "run" / "manifest.json").read_bytes() == manifest
    code, _, progress = run({**cfg, "dataset": {**cfg["dataset"], "maxLength": 100}})
    assert code == EXIT_PERMANENT and "maxLength: stored 512, now 100" in (progress.last_error or "")


def test_a_replica_alone_leases_every_shard(tmp_path: Path, ref_server: RefServer) -> None:
    """Issue 34 item 1: shards are leased, not assigned: replica 3 of a run started with 2 (a pod that joined
    when parallelism went to 4), with no one else there, does every shard and writes the manifest; the lease
    objects are gone once it is written."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(30, words=40))
    first = base_config(tmp_path, ref_server, dataset, replicaCount=2, replicaIndex=3)
    code, result, progress = run(first)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    plan = json.loads((tmp_path / "out" / "run" / "plan.json").read_text())
    assert len(plan["shards"]) >= 2 and result.shards_done == list(range(len(plan["shards"])))
    assert progress.samples_done == progress.samples_total == 30
    leftover = [p for p in (tmp_path / "out" / "run" / "leases").rglob("*") if p.is_file()]
    assert not leftover, f"lease objects outlived the manifest: {leftover}"
    verified(first)


def test_two_replicas_lease_disjoint_work_and_both_report_the_run(tmp_path: Path, ref_server: RefServer) -> None:
    """Two replicas at once on one run: each sample is stored once, and each replica's progress is the
    run's (it counts the shards the other commits), so the operator takes the largest, not the sum."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(80, words=40))
    cfgs = [base_config(tmp_path, ref_server, dataset, replicaCount=2, replicaIndex=r, concurrency=2,
                        leaseSeconds=2) for r in (0, 1)]  # fmt: skip
    progresses = [Progress("run", r) for r in (0, 1)]

    async def both() -> list[tuple[int, RunResult | None]]:
        return await asyncio.gather(*(extract(ExtractConfig.model_validate(c), p)
                                      for c, p in zip(cfgs, progresses, strict=True)))  # fmt: skip

    outcomes = asyncio.run(both())
    assert [code for code, _ in outcomes] == [EXIT_OK, EXIT_OK]
    shards = len(json.loads((tmp_path / "out" / "run" / "plan.json").read_text())["shards"])
    done = [set(result.shards_done) for _, result in outcomes if result is not None]
    assert done[0] | done[1] == set(range(shards)) and shards >= 4, (done, shards)
    assert all(done), f"one replica did nothing: {done}"  # leases are taken as each reaches a shard
    assert all(p.samples_done == p.samples_total == 80 for p in progresses), [p.report() for p in progresses]
    samples, quarantined = stored(cfgs[0])
    assert sorted(samples) == list(range(80)) and not quarantined
    verified(cfgs[0])


def test_a_run_leaves_the_dumps_of_a_run_whose_id_extends_its_own(tmp_path: Path, ref_server: RefServer) -> None:
    """runId job replica 1 sweeps dead processes of (job, 1) only; a dump of runId job-r1 (whose rids
    start with the same text) belongs to a live run sharing the server and stays."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(30, words=40))
    other = protocol.make_rid(protocol.RunKey("job-r1", 0, "c0ffee"), 3, 0)
    dead = protocol.make_rid(protocol.RunKey("job", 1, "dead00"), 3, 0)
    for rid in (other, dead):
        (ref_server.dump_dir / f"{rid}.safetensors").write_bytes(b"\0" * 64)
    cfg = base_config(tmp_path, ref_server, dataset, run_id="job", replicaCount=2, replicaIndex=1)
    try:
        code, result, _ = run(cfg)
        assert code == EXIT_OK and result is not None and result.shards_done
        assert (ref_server.dump_dir / f"{other}.safetensors").exists()
        assert not (ref_server.dump_dir / f"{dead}.safetensors").exists()
    finally:
        (ref_server.dump_dir / f"{other}.safetensors").unlink(missing_ok=True)


def test_job_completion_index_picks_the_replica(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = ExtractConfig.model_validate(
        {"runId": "r", "dataset": {"uri": "d"}, "output": {"uri": str(tmp_path)}, "replicaCount": 3}
    )
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert Extraction(cfg).cfg.replicaIndex == 2
    explicit = ExtractConfig.model_validate({**cfg.model_dump(), "replicaIndex": 1})
    assert Extraction(explicit).cfg.replicaIndex == 1


@pytest.mark.s3
def test_extracts_to_real_s3(tmp_path: Path, ref_server: RefServer, s3_env: Any, s3_bucket: str) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(5))
    output = {
        "uri": f"s3://{s3_bucket}/runs",
        "endpoint": s3_env.endpoint,
        "pathStyle": True,
        "shardTargetBytes": 1 << 20,
    }
    cfg = {**base_config(tmp_path, ref_server, dataset), "output": output}
    code, result, _ = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert result.manifest["samples"] == 5
    report = run_verify(f"s3://{s3_bucket}/runs/run", output=OutputSpec.model_validate(output))
    assert report.ok, report.summary_text()
    samples, _ = stored(cfg)
    assert sorted(samples) == list(range(5))


def test_backpressure_holds_requests_while_the_dump_dir_is_full(
    tmp_path: Path, ref_server: RefServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This replica's own files hold the room (here a live writer's partial dump); the wait is
    reported as a stall in progress.lastError, and sending resumes once the room is free."""
    monkeypatch.setattr(engine, "STALL_REPORT_SECONDS", 0.3)
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(5))
    cfg = ExtractConfig.model_validate(base_config(tmp_path, ref_server, dataset, dumpDirMaxBytes=1 << 20))
    mine = protocol.make_rid(protocol.RunKey("run", 0, "abcdef"), 0, 0)
    blocker = ref_server.dump_dir / f".{mine}.safetensors.4242.partial"
    blocker.write_bytes(b"\0" * ((1 << 20) + 1))

    async def scenario() -> tuple[int, int, str | None, RunResult]:
        progress = Progress(cfg.runId, cfg.replicaIndex)
        task = asyncio.create_task(Extraction(cfg, progress).run())
        while progress.state != "running":
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)
        held = (ref_server.stats()["requests"], progress.samples_done, progress.last_error)
        blocker.unlink()  # shm drained: sending resumes
        return *held, await task

    try:
        requests_while_full, done_while_full, error, result = asyncio.run(scenario())
    finally:
        blocker.unlink(missing_ok=True)
    assert (requests_while_full, done_while_full) == (0, 0)
    assert error is not None and error.startswith("back-pressure stalled for ")
    assert f"hold {(1 << 20) + 1} bytes" in error and "dumpDirMaxBytes 1048576" in error
    assert result.manifest is not None and result.manifest["samples"] == 5


def test_backpressure_counts_only_this_runs_files_and_sweeps_dead_runs_orphans(
    tmp_path: Path, ref_server: RefServer
) -> None:
    """Files of other runs and names outside the protocol never hold this run back (nothing here
    would ever remove them: the wait was endless). Dumps of a run dead for an hour and partials of a
    dead writer are swept; a live run's fresh dump and foreign names are left alone."""
    limit = 1 << 20
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(5))
    cfg = ExtractConfig.model_validate(base_config(tmp_path, ref_server, dataset, dumpDirMaxBytes=limit))
    d = ref_server.dump_dir
    live_other = d / f"{protocol.make_rid(protocol.RunKey('other', 0, 'abcdef'), 0, 0)}.safetensors"
    foreign = d / "someone-elses-file.bin"
    orphan = d / f"{protocol.make_rid(protocol.RunKey('gone', 0, '123456'), 7, 0)}.safetensors"
    dead_partial = d / f".{protocol.make_rid(protocol.RunKey('gone', 1, '654321'), 8, 0)}.safetensors.9.partial"
    for path in (live_other, foreign, orphan, dead_partial):
        path.write_bytes(b"\0" * (limit + 1))
    hour_ago = time.time() - collect.ORPHAN_DUMP_SECONDS - 60
    for path in (orphan, dead_partial):
        os.utime(path, (hour_ago, hour_ago))

    async def scenario() -> RunResult:
        progress = Progress(cfg.runId, cfg.replicaIndex)
        return await asyncio.wait_for(Extraction(cfg, progress).run(), timeout=120)

    try:
        result = asyncio.run(scenario())
        assert result.manifest is not None and result.manifest["samples"] == 5
        assert live_other.exists() and foreign.exists()
        assert not orphan.exists() and not dead_partial.exists()
    finally:
        for path in (live_other, foreign, orphan, dead_partial):
            path.unlink(missing_ok=True)


def test_backpressure_counts_dumps_of_requests_in_flight_before_they_exist(
    tmp_path: Path, ref_server: RefServer, tokenizer: Any
) -> None:
    """Room for the dumps of every request at the server is reserved up front, so the dump dir can
    never pass dumpDirMaxBytes even when all of them finish at once."""
    rows = chat_rows(12, words=120)
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    limit = 1 << 20
    cfg = ExtractConfig.model_validate(
        base_config(tmp_path, ref_server, dataset, dumpDirMaxBytes=limit, concurrency=16)
    )
    lengths = [len(tokenizer.render(row["messages"])[0]) for row in rows]
    smallest = dump_bytes_bound(min(lengths), 64, 3)
    assert 1 < limit // smallest < cfg.concurrency  # the limit, not the concurrency, must bind
    ref_server.set_fault(None, delay_ms=150)
    code, result, _ = run(cfg.model_dump())
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert result.manifest["samples"] == 12
    assert 1 < ref_server.stats()["maxInFlight"] <= limit // smallest


def test_a_configuration_error_found_at_a_row_is_permanent_with_format_auto(
    tmp_path: Path, ref_server: RefServer
) -> None:
    bare = tmp_path / "tok"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ref_server.model / name).is_file():
            shutil.copy(ref_server.model / name, bare / name)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    code, _, progress = run(base_config(tmp_path, ref_server, dataset, dataset__tokenizer=str(bare)))
    assert code == EXIT_PERMANENT and "no chat template" in (progress.last_error or "")


def test_native_kernels_named_but_not_loadable_stop_the_run_permanently(
    tmp_path: Path, ref_server: RefServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.LIBRARY_ENV, str(tmp_path / "missing" / native.LIBRARY_NAME))
    native.kernels.cache_clear()
    try:
        code, _, progress = run(base_config(tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", chat_rows(2))))
    finally:
        monkeypatch.undo()
        native.kernels.cache_clear()
    assert code == EXIT_PERMANENT
    assert f"{native.LIBRARY_ENV}=" in (progress.last_error or "") and "cannot load" in (progress.last_error or "")


def test_lines_expanded_turns_and_the_quarantine_summary(
    tmp_path: Path, ref_server: RefServer, capsys: pytest.CaptureFixture[str]
) -> None:
    two_turns = {
        "id": "two",
        "messages": [
            {"role": "user", "content": "Say alpha."},
            {"role": "assistant", "content": "alpha"},
            {"role": "user", "content": "Say beta."},
            {"role": "assistant", "content": "beta"},
        ],
    }
    lines = ["", json.dumps(two_turns), "{broken", "", json.dumps(chat_rows(1)[0]), '{"id": "e", "messages": []}']
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    cfg = base_config(tmp_path, ref_server, dataset, dataset__expandTurns=True)
    code, result, _ = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    samples, quarantined = stored(cfg)
    assert sorted(samples) == [0, 1, 3] and quarantined == {2: "invalid_json", 4: "empty_messages"}
    assert [samples[i].sample_id for i in (0, 1, 3)] == ["two/turn1", "two/turn2", "s0/turn1"]
    assert {q["index"]: q["line"] for q in result.manifest["quarantine"]} == {2: 3, 4: 6}
    assert result.manifest["run"]["expandTurns"] is True
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "hsx extract: samples written 3, quarantined 2: empty_messages 1, invalid_json 1"
    verified(cfg)
