"""Exact tokens: the model's tokenizer and chat template, rendered once by hsx.

The loss mask comes from the template's ``{% generation %}`` blocks (transformers maps the
rendered character spans to tokens), never from guessing offsets. The rendered text is
tokenized without adding special tokens: the template writes BOS itself, and the server gets
``input_ids`` so it cannot add another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from hsx_extractor.run.dataset import TemplateRefused

# Files that change how text becomes ids; all of them that exist feed the fingerprint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")


class TokenizerError(RuntimeError):
    """The tokenizer cannot produce exact tokens and loss masks (a permanent, start-of-run error)."""


def fingerprint(
    tokenizer_dir: str | os.PathLike[str], chat_template: str | None, special: dict[str, Any]
) -> str:
    """sha256 (hex) over the tokenizer files, the chat template in use and the special-token settings."""
    digest = hashlib.sha256(b"hsx-tokenizer/1\0")
    root = Path(tokenizer_dir)
    for name in TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
    digest.update(b"template\0" + (chat_template or "").encode())
    digest.update(b"special\0" + json.dumps(special, sort_keys=True).encode())
    return digest.hexdigest()


class ChatTokenizer:
    """A model's tokenizer plus the chat template hsx renders with."""

    def __init__(self, tokenizer_dir: str | os.PathLike[str], chat_template: str | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never reach for a hub
        from transformers import AutoTokenizer

        self.path = Path(tokenizer_dir)
        if (
            not (self.path / "tokenizer.json").is_file()
            and not (self.path / "tokenizer_config.json").is_file()
        ):
            raise TokenizerError(f"{self.path} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot load the tokenizer in {self.path}: {exc}") from exc
        if not getattr(self._tok, "is_fast", False):
            raise TokenizerError(f"{self.path}: a fast tokenizer is needed for template loss masks")
        self.chat_template: str | None = chat_template or self._tok.chat_template
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.special = {
            "bos_token": self._tok.bos_token,
            "eos_token": self._tok.eos_token,
            "pad_token": self._tok.pad_token,
            "add_special_tokens": False,
        }
        self.fingerprint = fingerprint(self.path, self.chat_template, self.special)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._tok)

    def require_generation_template(self) -> None:
        if not self.chat_template:
            raise TokenizerError(f"{self.path} has no chat template; set dataset.chatTemplate")
        if not _GENERATION_RE.search(self.chat_template):
            raise TokenizerError(
                "the chat template has no {% generation %} block, so the loss mask cannot come from it; "
                "set dataset.chatTemplate to a template that wraps assistant turns in "
                "{% generation %} ... {% endgeneration %}"
            )

    def render(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32[L], loss_mask uint8[L])`` of one conversation."""
        self.require_generation_template()
        from jinja2.exceptions import TemplateError

        try:
            out: Any = self._tok.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except TemplateError as exc:
            raise TemplateRefused(f"chat template: {exc}") from exc
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        bos = self.bos_token_id
        if bos is not None and ids.shape[0] >= 2 and ids[0] == bos and ids[1] == bos:
            raise TokenizerError("the chat template renders BOS twice; fix the template or tokenizer config")
        return ids, mask
