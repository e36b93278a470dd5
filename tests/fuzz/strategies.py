"""Hostile values for the fuzz properties: JSON of any shape, and chat-shaped JSON with wrong types, deep
nesting, odd text and numbers in the places hsx reads."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Text with what templates and tokenizers trip on: NULs, BOMs, bidi controls, special tokens, Jinja syntax.
TEXT = st.lists(
    st.text(st.characters(codec="utf-8"), max_size=12)
    | st.sampled_from(["\x00", "\ufeff", "\u202e", "<|eot_id|>", "<s>", "{{ x }}", "{% if %}", "\\u12"]),
    max_size=4,
).map("".join)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
# What stored JSON can hold: its reader (storage/stored_json.load_json) refuses NaN and Infinity.
FINITE_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | TEXT


def json_values(max_leaves: int = 25, finite: bool = False) -> st.SearchStrategy[Any]:
    """Any JSON value; floats include NaN and the infinities (as Python's json writes them) unless ``finite``."""
    return st.recursive(
        FINITE_SCALARS if finite else SCALARS,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
        max_leaves=max_leaves,
    )


ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "", "ASSISTANT"]) | TEXT
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES | json_values(3)},
    optional={
        "content": TEXT | json_values(4) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})),
        "tool_calls": json_values(6) | st.just("[[[[[[]]]]]]"),
        "name": TEXT,
    },
)


def chat_rows() -> st.SearchStrategy[dict[str, Any]]:
    """Rows shaped like the formats hsx reads (messages, ShareGPT, pre-tokenized), each field possibly wrong."""
    ids = st.integers(-5, 2**40) | TEXT | json_values(2)
    messages = st.lists(MESSAGE, max_size=6) | json_values(5)
    sharegpt = st.lists(st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "x"]) | TEXT,
                                               "value": TEXT | json_values(2)}), max_size=5)  # fmt: skip
    tokens = st.lists(st.integers(-3, 40_000) | SCALARS, max_size=40)
    return st.one_of(
        st.fixed_dictionaries({"id": ids, "messages": messages}, optional={"tools": json_values(6) | TEXT}),
        st.fixed_dictionaries({"id": ids, "conversations": sharegpt}, optional={"system": TEXT | json_values(2)}),
        st.fixed_dictionaries({"id": ids, "input_ids": tokens}, optional={"loss_mask": tokens | json_values(2)}),
        st.dictionaries(TEXT, json_values(8), max_size=5),
    )
