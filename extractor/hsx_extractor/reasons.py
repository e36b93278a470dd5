"""Quarantine reasons: the one place that names them. Each string appears in shard commits and
manifests, /progress and /metrics, so they are part of the output format."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # Dataset side: the row cannot become a sample.
    INVALID_JSON = "invalid_json"
    INVALID_UTF8 = "invalid_utf8"
    # Valid JSON of the wrong shape: not an object, no messages/input_ids, an id that is not str/int.
    INVALID_ROW = "invalid_row"
    EMPTY_MESSAGES = "empty_messages"
    UNKNOWN_ROLE = "unknown_role"
    MISSING_ROLE = "missing_role"
    NON_STRING_CONTENT = "non_string_content"
    # The chat template itself refused the conversation (raise_exception in the template).
    TEMPLATE_ERROR = "template_error"
    IDS_OUT_OF_VOCAB = "ids_out_of_vocab"
    MASK_LENGTH_MISMATCH = "mask_length_mismatch"
    NO_ASSISTANT_TOKENS = "no_assistant_tokens"
    TOO_LONG = "too_long"
    DUPLICATE_ID = "duplicate_id"
    # Server side: the dump for the sample's rid is missing or does not match what was sent.
    ID_MISMATCH = "id_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    NON_FINITE = "non_finite"
    NO_DUMP = "no_dump"
    SERVER_ERROR = "server_error"

