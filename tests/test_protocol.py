"""The dump protocol: names, round trip, atomicity and damage detection."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import deserialize

from hsx_extractor import protocol as p


def _meta(rid: str = "hsx-run1-7-a0", seq_len: int = 5, hidden: int = 4) -> p.DumpMeta:
    return p.DumpMeta(rid=rid, seq_len=seq_len, hidden_size=hidden, capture_layers=(2, 3, 5), producer="test")


def _tensors(seq_len: int = 5, hidden: int = 4, k: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, seq_len, dtype=np.int32)
    aux = rng.integers(0, 1 << 16, (seq_len, k * hidden), dtype=np.uint16)
    fin = rng.integers(0, 1 << 16, (seq_len, hidden), dtype=np.uint16)
    return ids, aux, fin


def test_rid_round_trip_and_retry_gets_new_rid() -> None:
    rid = p.make_rid("run1-r0", 42, 0)
    assert p.parse_rid(rid) == ("run1-r0", 42, 0)
    assert p.make_rid("run1-r0", 42, 1) != rid


@pytest.mark.parametrize(
    ("run_id", "replica"), [("job", 1), ("job-r1", 0), ("job-r1-abcdef", 3), ("r1", 10), ("a-r0-r0", 0)]
)
def test_run_key_parses_back_exactly_even_when_the_run_id_looks_like_one(run_id: str, replica: int) -> None:
    key = p.RunKey(run_id, replica, "0a1b2c")
    rid = p.make_rid(key, 7, 2)
    assert p.owner_of(rid) == key and p.RunKey.parse(key.text) == key
    assert p.parse_rid(rid) == (key.text, 7, 2)


def test_owner_of_foreign_rids_is_none() -> None:
    for rid in ("mine", "hsx-run1-r0-42-a0", "hsx-x-r1-zz-1-a0", "hsx--1-a0"):
        assert p.owner_of(rid) is None
    assert not p.RunKey("job", 1, "aa").same_slot(p.RunKey("job-r1", 0, "aa"))
    assert p.RunKey("job", 1, "aa").same_slot(p.RunKey("job", 1, "bb"))


def test_workers_of_one_pod_are_slots_of_their_own() -> None:
    """Sibling workers of one replica share a dump directory: a worker must neither count nor sweep another's
    dumps, and worker 0's rids are those of a pod without workers."""
    w0, w2 = p.RunKey("job", 1, "aa"), p.RunKey("job", 1, "bb", worker=2)
    assert (w0.text, w2.text) == ("job-r1-aa", "job-r1w2-bb")
    assert p.owner_of(p.make_rid(w2, 5, 0)) == w2 and p.RunKey.parse("job-r1w2-bb") == w2
    assert not w0.same_slot(w2) and w2.same_slot(p.RunKey("job", 1, "cc", worker=2))


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "a b", "x" * 201, "a..b"])
def test_unsafe_rids_are_rejected(bad: str) -> None:
    with pytest.raises(p.ProtocolError):
        p.validate_rid(bad)


def test_dump_round_trip_is_byte_exact(tmp_path) -> None:
    ids, aux, fin = _tensors()
    path = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    assert path == p.dump_path(tmp_path, "hsx-run1-7-a0")
    dump = p.read_dump(path)
    assert dump.meta == _meta()
    assert np.array_equal(dump.input_ids, ids)
    assert np.array_equal(dump.aux_hidden_states, aux)
    assert np.array_equal(dump.hidden_states, fin)
    assert [f for f in os.listdir(tmp_path)] == [path.name]  # no temporary left behind


def test_dump_is_a_valid_safetensors_file(tmp_path) -> None:
    ids, aux, fin = _tensors()
    path = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    # The real safetensors parser (numpy has no bf16, so read raw entries).
    loaded = {name: entry for name, entry in deserialize(path.read_bytes())}
    assert loaded["input_ids"]["dtype"] == "I32"
    assert loaded["aux_hidden_states"]["shape"] == [5, 12]
    assert bytes(loaded["hidden_states"]["data"]) == fin.tobytes()


def test_dump_with_wrong_row_count_is_written_as_given(tmp_path) -> None:
    # The consumer compares rows with what it sent; the producer must not hide a mismatch.
    ids, aux, fin = _tensors(seq_len=5)
    path = p.write_dump(tmp_path, _meta(seq_len=5), ids, aux[:3], fin)
    assert p.read_dump(path).aux_hidden_states.shape == (3, 12)


def test_torn_buffers_are_refused(tmp_path) -> None:
    ids, aux, fin = _tensors()
    with pytest.raises(p.ProtocolError):
        p.write_dump(tmp_path, _meta(), ids, aux.tobytes()[:-2], fin)
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_detected(tmp_path) -> None:
    ids, aux, fin = _tensors()
    path = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(p.ProtocolError, match="truncated"):
        p.read_dump(path)


def test_foreign_protocol_version_is_refused(tmp_path) -> None:
    ids, aux, fin = _tensors()
    path = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(p.PROTOCOL_VERSION.encode(), b"hsx-dump/9"))
    with pytest.raises(p.ProtocolError, match="protocol"):
        p.read_dump(path)


def test_error_marker_round_trip(tmp_path) -> None:
    path = p.write_error(tmp_path, "hsx-run1-3-a1", "row_count_mismatch", "rows 7 != tokens 8")
    assert p.rid_of(path.name) == "hsx-run1-3-a1"
    body = p.read_error(path)
    assert body["reason"] == "row_count_mismatch"
    assert json.loads(path.read_text())["protocol"] == p.PROTOCOL_VERSION


def test_partial_files_are_invisible_by_name() -> None:
    assert p.rid_of(".hsx-run1-3-a1.safetensors.123.partial") is None
    assert p.rid_of("hsx-run1-3-a1.safetensors") == "hsx-run1-3-a1"
    assert p.rid_of("notes.txt") is None


def _with_header(path, header: object) -> None:
    raw = path.read_bytes()
    (hlen,) = __import__("struct").unpack("<Q", raw[:8])
    body = raw[8 + hlen :]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


@pytest.mark.parametrize(
    "damage",
    [
        lambda h: [1, 2],  # not an object
        lambda h: {**h, "input_ids": "x"},  # an entry that is not an object
        lambda h: {**h, "input_ids": {**h["input_ids"], "data_offsets": [0]}},  # one offset
        lambda h: {**h, "input_ids": {**h["input_ids"], "shape": None}},
        lambda h: {**h, "input_ids": {**h["input_ids"], "shape": [-5]}},
        lambda h: {**h, "input_ids": {**h["input_ids"], "data_offsets": [20, 0]}},
        lambda h: {**h, "__metadata__": "not an object"},
        lambda h: {**h, "__metadata__": {**h["__metadata__"], "capture_layers": "[[["}},
        lambda h: {k: v for k, v in h.items() if k != "input_ids"},
    ],
)
def test_a_malformed_header_is_a_protocol_error(tmp_path, damage) -> None:
    # Issue 32, item 3: each of these ended the run with a KeyError/TypeError/AttributeError.
    ids, aux, fin = _tensors()
    path = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    raw = path.read_bytes()
    (hlen,) = __import__("struct").unpack("<Q", raw[:8])
    _with_header(path, damage(json.loads(raw[8 : 8 + hlen])))
    with pytest.raises(p.ProtocolError):
        p.read_dump(path)


def test_any_header_bytes_give_a_dump_or_a_protocol_error(tmp_path) -> None:
    """Fuzz (Hypothesis): whatever the header JSON, read_dump returns or raises ProtocolError, nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ids, aux, fin = _tensors()
    good = p.write_dump(tmp_path, _meta(), ids, aux, fin)
    raw = good.read_bytes()
    (hlen,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=6), inner, max_size=3), max_leaves=10)  # fmt: skip
    keys = st.sampled_from([*header, "__metadata__"])
    target = tmp_path / "fuzzed.safetensors"

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(keys, values, max_size=4), st.booleans())
    def check(replacements: dict, merge: bool) -> None:
        target.write_bytes(raw)
        _with_header(target, {**header, **replacements} if merge else replacements)
        try:
            p.read_dump(target)
        except p.ProtocolError:
            pass

    check()
