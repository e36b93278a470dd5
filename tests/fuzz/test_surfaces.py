"""One property per surface that takes outside input (issue 32, "a fuzzer per surface"): whatever arrives, the
answer is a value or the surface's own typed error, never a traceback of another kind, and a dataset row is a
sample or a named rejection that no other row's fate depends on. Dump headers have theirs in tests/test_protocol.py.
"""

from __future__ import annotations

import copy
import json
import tempfile
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from hsx_extractor.config import OutputSpec
from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected, read_samples
from hsx_extractor.run.plan import PlanMismatch, ShardPlan
from hsx_extractor.run.sources import SourceRow
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.manifest import Capture, ManifestError
from hsx_extractor.storage.shard_format import ShardFormatError
from hsx_extractor.storage.store import open_store
from hsx_operator.api import ExtractionJobSpec
from hsx_operator.desired import Owner, desired_config_map
from hsx_operator.group import desired_run, pod_specs
from hsx_operator.pods import parse_report
from hsx_operator.policy import NodeAccessPolicy, violations
from tests.fuzz.strategies import TEXT, chat_rows, json_values
from tests.operator.helpers import spec_dict
from tests.storage.samples import plan_for, write_run


def line_of(value: Any) -> bytes:
    return json.dumps(value).encode()


def check_samples(rows: list[Any], tokenizer: Any) -> None:
    out = list(read_samples(rows, tokenizer, 256))
    assert [x.index for x in out] == list(range(len(rows)))  # one sample per row, in order, none lost
    for x in out:
        assert isinstance(x, Prepared | Rejected)
        if isinstance(x, Rejected):
            # row_check_failed is the net under every check: no row of data should fall into it.
            assert x.reason in set(Reason) and x.reason != Reason.ROW_CHECK_FAILED, (x.reason, x.detail)


@given(st.lists(chat_rows().map(line_of) | json_values().map(line_of) | st.binary(max_size=120), min_size=1, max_size=4))
@example([b'{"id": 1, "messages": "[[[[]]]]"}', b"\xff\xfe", b'{"id": "x", "input_ids": [1e400]}'])
def test_any_jsonl_line_is_a_sample_or_a_named_rejection(tokenizer: Any, lines: list[bytes]) -> None:
    check_samples(lines, tokenizer)


@given(st.lists(chat_rows(), min_size=1, max_size=4))
def test_any_decoded_parquet_row_is_a_sample_or_a_named_rejection(tokenizer: Any, rows: list[dict[str, Any]]) -> None:
    check_samples([SourceRow(n + 1, row) for n, row in enumerate(rows)], tokenizer)


def real_commit_record() -> dict[str, Any]:
    """A commit record as the store writes it (two samples stored, one quarantined)."""
    with tempfile.TemporaryDirectory() as out:
        store = open_store(OutputSpec.model_validate({"uri": out}), "run-1")
        write_run(store, plan_for(9, 4))
        commit = store.get_commit(0)
        assert commit is not None
        return commit.to_json()


VALID_COMMIT = real_commit_record()


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some of its fields replaced by any JSON a store can hold, or removed."""
    def apply(changes: dict[str, Any], removed: list[str]) -> dict[str, Any]:
        out = copy.deepcopy(base)
        out.update(changes)
        for key in removed:
            out.pop(key, None)
        return out

    keys = st.sampled_from(sorted(base))
    return st.builds(apply, st.dictionaries(keys, json_values(6, finite=True), max_size=3), st.lists(keys, max_size=2))


@given(json_values(finite=True) | mutated(VALID_COMMIT))
def test_any_commit_record_is_read_or_refused_as_a_shard_format_error(record: Any) -> None:
    try:
        ShardCommit.from_json(record)
    except ShardFormatError:
        pass


VALID_PLAN = ShardPlan(
    identity={"a": 1}, rows=4, shards=[(0, 2), (2, 4)], duplicates=frozenset({2}), lines=((1, 2), (3, 4)),
    digests=("1", "2"), source={"size": 10},
).to_json()


def test_the_fuzzed_bases_are_valid() -> None:
    # Mutations of a valid base reach the checks past the format and version tests.
    assert ShardCommit.from_json(VALID_COMMIT).shard_index == 0
    assert ShardPlan.from_json(VALID_PLAN).rows == 4


@given(st.dictionaries(TEXT, json_values(6, finite=True), max_size=5) | mutated(VALID_PLAN))
@example({**VALID_PLAN, "rows": 1e300, "shards": [{"index": "0"}]})
def test_any_plan_json_is_read_or_refused_as_the_extractor_catches(plan: dict[str, Any]) -> None:
    # run/extraction.py turns exactly these into a permanent "plan.json: ..." failure.
    try:
        ShardPlan.from_json(plan).check_identity({"a": 1})
    except (PlanMismatch, KeyError, TypeError, ValueError):
        pass


@given(json_values(finite=True))
def test_any_manifest_capture_is_read_or_refused_as_a_manifest_error(capture: Any) -> None:
    try:
        Capture.from_json(capture)
    except ManifestError:
        pass


@given(json_values().map(line_of) | st.binary(max_size=200))
def test_any_progress_body_is_a_report_or_none(body: bytes) -> None:
    report = parse_report(body)
    assert report is None or report.samplesDone >= 0


SPEC_FIELDS = [
    ("runId",), ("parallelism",), ("backoffLimit",), ("model", "path"), ("model", "auxLayerIds"), ("model", "mountPath"),
    ("server", "gpus"), ("server", "tensorParallel"), ("server", "extraArgs"), ("server", "shmSize"),
    ("server", "port"), ("server", "env"), ("server", "engine"), ("extractor", "progressPort"),
    ("dataset", "uri"), ("dataset", "maxLength"), ("output", "uri"), ("output", "shardTargetBytes"),
    ("scheduling", "tolerations"), ("scheduling", "nodeSelector"), ("scheduling", "affinity"),
    ("pod", "labels"), ("pod", "caBundleConfigMap"), ("concurrency",), ("continueFrom",), ("server", "nodes"),
    ("scheduling", "topology"),
]  # fmt: skip


def spec_with(changes: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    spec = spec_dict()
    for path, value in changes:
        target = spec
        for key in path[:-1]:
            target = target.setdefault(key, {}) if isinstance(target.get(key, {}), dict) else {}
        target[path[-1]] = value
    return spec


@given(st.lists(st.tuples(st.sampled_from(SPEC_FIELDS), json_values(5) | st.integers(0, 2**40) | TEXT), max_size=4))
def test_any_spec_makes_a_job_or_a_typed_refusal(changes: list[tuple[tuple[str, ...], Any]]) -> None:
    try:
        spec = ExtractionJobSpec.model_validate(spec_with(changes))
    except ValidationError:
        return
    owner = Owner(name="xj", namespace="ml", uid="u")
    try:
        job = desired_run(owner, spec)  # a Job, or a JobSet when server.nodes > 1
        desired_config_map(owner, spec)
    except ValueError:  # the launchers' refusals: the operator's InvalidSpec
        return
    for pod in pod_specs(job):
        violations(pod, NodeAccessPolicy())
    json.dumps(job, allow_nan=False)  # what the API server gets is plain JSON
