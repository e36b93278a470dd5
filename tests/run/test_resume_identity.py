"""Resume trusts content, not names: a dataset edited in place or a swapped model refuses to resume,
saying what changed; an untouched dataset (even with a new mtime) resumes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.run.plan import ShardPlan, build_plan, identity_digest, row_digest
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.runner import extract
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl


def _run(cfg: dict[str, Any]) -> tuple[int, Progress]:
    config = ExtractConfig.model_validate(cfg)
    progress = Progress(config.runId, 0)
    code, _ = asyncio.run(extract(config, progress))
    return code, progress


def _unfinish(run_dir: Path, shard: int) -> None:
    """As if the run had been killed before ``shard`` committed: its record and the manifest gone."""
    (run_dir / "commits" / f"shard-{shard:06d}.json").unlink()
    (run_dir / "manifest.json").unlink()


def _started(tmp_path: Path, ref_server: RefServer, **over: Any) -> tuple[dict[str, Any], Path, Path]:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(90, words=40))
    cfg = base_config(tmp_path, ref_server, dataset, run_id="resume", **over)
    code, _ = _run(cfg)
    assert code == EXIT_OK
    run_dir = tmp_path / "out" / "resume"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len(plan["shards"]) >= 3 and all("digest" in s for s in plan["shards"]), plan
    return cfg, dataset, run_dir


def test_a_dataset_edited_in_place_refuses_to_resume_naming_the_shard(
    tmp_path: Path, ref_server: RefServer
) -> None:
    cfg, dataset, run_dir = _started(tmp_path, ref_server)
    plan = json.loads((run_dir / "plan.json").read_text())
    _unfinish(run_dir, len(plan["shards"]) - 1)
    lines = dataset.read_text().splitlines()
    second = plan["shards"][1]
    row = second["start"]
    lines[row] = json.dumps(
        {
            "id": f"s{row}",
            "messages": [{"role": "user", "content": "edited"}, {"role": "assistant", "content": "new"}],
        }
    )
    dataset.write_text("\n".join(lines) + "\n")
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT
    error = progress.last_error or ""
    assert f"shard 1 (samples {second['start']}-{second['stop'] - 1}, lines" in error, error
    assert "shard 0 " not in error and "new runId" in error


def test_an_untouched_dataset_with_a_new_mtime_resumes(tmp_path: Path, ref_server: RefServer) -> None:
    cfg, dataset, run_dir = _started(tmp_path, ref_server)
    _unfinish(run_dir, 0)
    st = dataset.stat()
    os.utime(dataset, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    code, progress = _run(cfg)
    assert code == EXIT_OK, progress.last_error
    assert (run_dir / "manifest.json").is_file()


def test_a_swapped_model_refuses_to_resume_saying_which_file(tmp_path: Path, ref_server: RefServer) -> None:
    model = tmp_path / "model"
    shutil.copytree(ref_server.model, model)
    cfg, _, run_dir = _started(tmp_path, ref_server, modelPath=str(model))
    _unfinish(run_dir, 0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT
    assert "model: stored" in (progress.last_error or "") and "configJson" in (progress.last_error or "")


def test_changed_shards_names_changed_and_missing_rows() -> None:
    lines = {n: row_digest(f"row {n}".encode()) for n in range(1, 11)}  # one sample per line
    target = 3 * 5 * (4 * 8 * 2 + 5)
    plan = build_plan({}, [5] * 10, [str(i) for i in range(10)], 3, 8, target, list(range(1, 11)), lines)
    assert plan.shards == [(0, 3), (3, 6), (6, 9), (9, 10)]
    again = ShardPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.lines == ((1, 3), (4, 6), (7, 9), (10, 10))
    assert again.changed_shards(lines) == []
    assert again.changed_shards({**lines, 5: row_digest(b"other")}) == [
        "shard 1 (samples 3-5, lines 4-6) changed"
    ]
    assert again.changed_shards({n: d for n, d in lines.items() if n <= 8}) == [
        "the dataset now ends at line 8, the plan reaches line 10",
        "shard 2 (samples 6-8, lines 7-9) changed",
        "shard 3 (samples 9-9, lines 10-10) changed",
    ]


def _before_the_plan(run_dir: Path, shard: int) -> dict[str, Any]:
    """As if killed while the plan was still being made: ``shard`` not committed, no plan.json yet
    (extraction starts before the plan is stored); returns the plan that was there."""
    plan = json.loads((run_dir / "plan.json").read_text())
    _unfinish(run_dir, shard)
    (run_dir / "plan.json").unlink()
    return plan


def test_shards_committed_before_the_plan_was_stored_are_kept(tmp_path: Path, ref_server: RefServer) -> None:
    cfg, _, run_dir = _started(tmp_path, ref_server)
    commits = {p.name: p.read_bytes() for p in (run_dir / "commits").iterdir()}
    stored = _before_the_plan(run_dir, 1)
    record = json.loads(commits["shard-000000.json"])
    assert record["source"] == {
        "lines": stored["shards"][0]["lines"],
        "digest": stored["shards"][0]["digest"],
        "plan": identity_digest(stored["identity"]),
    }
    code, progress = _run(cfg)
    assert code == EXIT_OK, progress.last_error
    assert json.loads((run_dir / "plan.json").read_text()) == stored  # the same plan, made again
    after = {p.name: p.read_bytes() for p in (run_dir / "commits").iterdir()}
    assert {k: v for k, v in after.items() if k != "shard-000001.json"} == {
        k: v for k, v in commits.items() if k != "shard-000001.json"
    }  # resumed: the other shards' records untouched
    assert progress.samples_resumed == sum(
        s["stop"] - s["start"] for s in stored["shards"] if s["index"] != 1
    )
    assert not progress.planning and progress.samples_total == stored["rows"]


def test_a_row_edited_under_a_shard_committed_before_the_plan_refuses_to_resume(
    tmp_path: Path, ref_server: RefServer
) -> None:
    cfg, dataset, run_dir = _started(tmp_path, ref_server)
    stored = _before_the_plan(run_dir, len(json.loads((run_dir / "plan.json").read_text())["shards"]) - 1)
    first = stored["shards"][0]
    lines = dataset.read_text().splitlines()
    edited = json.loads(lines[first["start"]])
    answer = edited["messages"][-1]["content"].split(" ")
    edited["messages"][-1]["content"] = " ".join(reversed(answer))  # the same tokens: the same cut
    lines[first["start"]] = json.dumps(edited)
    dataset.write_text("\n".join(lines) + "\n")
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT
    error = progress.last_error or ""
    assert f"shard 0 was committed from lines {first['lines'][0]}-{first['lines'][1]}" in error, error
    assert "new runId" in error and not (run_dir / "plan.json").exists()


def test_other_settings_after_a_crash_before_the_plan_refuse_to_resume(tmp_path: Path, ref_server: RefServer) -> None:
    """The same cut from the same rows, but a setting the plan depends on changed (maxLength, which no row
    reaches): the committed shards were made under other settings."""
    cfg, _, run_dir = _started(tmp_path, ref_server)
    _before_the_plan(run_dir, 2)
    cfg["dataset"]["maxLength"] = 600
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT
    error = progress.last_error or ""
    assert "shard 0 was committed with other settings" in error and "new runId" in error, error


def test_a_dataset_that_lost_rows_under_committed_shards_refuses_to_resume(
    tmp_path: Path, ref_server: RefServer
) -> None:
    cfg, dataset, run_dir = _started(tmp_path, ref_server)
    stored = _before_the_plan(run_dir, 0)
    last = stored["shards"][-1]
    lines = dataset.read_text().splitlines()
    dataset.write_text("\n".join(lines[: stored["shards"][-2]["start"]]) + "\n")  # the last two shards gone
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT
    error = progress.last_error or ""
    assert f"shards [{last['index'] - 1}, {last['index']}] were committed" in error and "lost rows" in error, error
    assert not (run_dir / "plan.json").exists()


def test_an_edit_that_keeps_size_and_mtime_is_caught_while_extracting(tmp_path: Path, ref_server: RefServer) -> None:
    """The resume check trusts an unchanged stat; the rows the extraction then reads are hashed against
    the plan's digests (issue 32, item 6), so an edit that kept size and mtime still stops the run."""
    cfg, dataset, run_dir = _started(tmp_path, ref_server)
    plan = json.loads((run_dir / "plan.json").read_text())
    last = plan["shards"][-1]
    _unfinish(run_dir, len(plan["shards"]) - 1)
    st = dataset.stat()
    lines = dataset.read_text().splitlines()
    row = last["start"]
    edited = lines[row].replace("alpha", "ALPHA") if "alpha" in lines[row] else lines[row].replace("beta", "BETA")
    assert edited != lines[row] and len(edited) == len(lines[row])
    lines[row] = edited
    dataset.write_text("\n".join(lines) + "\n")
    os.utime(dataset, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (dataset.stat().st_size, dataset.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    code, progress = _run(cfg)
    assert code == EXIT_PERMANENT, progress.last_error
    error = progress.last_error or ""
    assert f"shard {len(plan['shards']) - 1} (samples {last['start']}-{last['stop'] - 1}" in error, error
    assert "is not what the plan was made from" in error
    assert not (run_dir / "manifest.json").exists()


def test_the_row_witness_checks_each_shard_once_its_last_line_is_read() -> None:
    from dataclasses import dataclass

    import pytest

    from hsx_extractor.run.plan import DatasetChanged, RowWitness, ShardCut, shard_digests

    @dataclass
    class Line:
        line: int
        data: bytes

    rows = [Line(n, f"row {n}".encode()) for n in range(1, 7)]
    digests = {r.line: row_digest(r.data) for r in rows}
    cuts = [ShardCut(k, 3 * k, 3 * k + 3, (3 * k + 1, 3 * k + 3), shard_digests([(3 * k + 1, 3 * k + 3)], digests)[0])
            for k in range(2)]  # fmt: skip
    witness = RowWitness()
    for cut in cuts:
        witness.expect(cut)
    assert [r.line for r in witness.rows(rows)] == list(range(1, 7))
    changed = [*rows[:4], Line(5, b"other"), rows[5]]
    witness = RowWitness()
    read: list[int] = []
    with pytest.raises(DatasetChanged, match="shard 1 "):
        for cut in cuts:
            witness.expect(cut)
        for r in witness.rows(changed):
            read.append(r.line)
    assert read == [1, 2, 3, 4, 5]  # shard 0 passed; shard 1 refused when its last line was read
