"""Quarantine reasons: the one place that names them. Each string appears in shard commits and
manifests, /progress and /metrics, so they are part of the output format."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # Dataset side: the row cannot become a sample.
    INVALID_JSON = "invalid_json"
    # Bytes that are not UTF-8, or text that cannot be (a lone surrogate escape such as \ud800).
    INVALID_UTF8 = "invalid_utf8"
    # Valid JSON of the wrong shape: not an object, no messages/input_ids, an id that is not str/int.
    INVALID_ROW = "invalid_row"
    EMPTY_MESSAGES = "empty_messages"
    UNKNOWN_ROLE = "unknown_role"
    MISSING_ROLE = "missing_role"
    NON_STRING_CONTENT = "non_string_content"
    # A row with two readings: messages and input_ids, or messages and conversations.
    AMBIGUOUS_ROW = "ambiguous_row"
    # An assistant turn with no content, tool call or reasoning: its loss would be the end-of-turn token alone.
    EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
    # dataset.specialTokensInContent: quarantine, or text when the tokenizer cannot keep such text as text.
    SPECIAL_TOKENS_IN_CONTENT = "special_tokens_in_content"
    # The chat template itself refused the conversation (raise_exception in the template).
    TEMPLATE_ERROR = "template_error"
    # A stock template (no {% generation %}) renders this conversation's prefix differently from the
    # whole (e.g. it drops earlier turns' reasoning): the loss mask cannot come from prefix renders.
    TEMPLATE_NOT_PREFIX_STABLE = "template_not_prefix_stable"
    # The sample does not start with exactly one BOS where the chat template writes one.
    BOS_MISMATCH = "bos_mismatch"
    IDS_OUT_OF_VOCAB = "ids_out_of_vocab"
    MASK_LENGTH_MISMATCH = "mask_length_mismatch"
    NO_ASSISTANT_TOKENS = "no_assistant_tokens"
    TOO_LONG = "too_long"
    DUPLICATE_ID = "duplicate_id"
    # Checking the row raised an error nothing else names (a bug or an input no check foresaw): the
    # row is set aside with the error, the run goes on.
    ROW_CHECK_FAILED = "row_check_failed"
    # Server side: the dump for the sample's rid is missing or does not match what was sent.
    ID_MISMATCH = "id_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    NON_FINITE = "non_finite"
    NO_DUMP = "no_dump"
    SERVER_ERROR = "server_error"
    # responses: regenerate (run/regenerate.py): what the target generated cannot be the sample.
    # A turn reached generation.maxNewTokens without stopping (generation.onTruncated: quarantine).
    TRUNCATED_GENERATION = "truncated_generation"
    # A turn generated nothing but its end-of-turn token (or only whitespace).
    EMPTY_GENERATION = "empty_generation"
    # The conversation with the generated text re-rendered by the chat template does not hold the
    # generated ids where the generation prompt ends (non-canonical tokens, a template that rewrites turns).
    GENERATION_NOT_RERENDERABLE = "generation_not_rerenderable"


# What the server did wrong; every other reason is the dataset's (validation.maxRejectedRowRate).
SERVER_REASONS = frozenset(
    {Reason.ID_MISMATCH, Reason.LENGTH_MISMATCH, Reason.NON_FINITE, Reason.NO_DUMP, Reason.SERVER_ERROR}
)


# What the target generated (responses: regenerate). Like the dataset's reasons, they set rows aside and
# count toward validation.maxRejectedRowRate: a run whose rows mostly cannot be samples must not succeed.
GENERATION_REASONS = frozenset(
    {Reason.TRUNCATED_GENERATION, Reason.EMPTY_GENERATION, Reason.GENERATION_NOT_RERENDERABLE}
)


def is_dataset_reason(reason: str) -> bool:
    """Whether the reason sets a row aside (validation.maxRejectedRowRate), not the server's mismatch."""
    return reason not in SERVER_REASONS

