"""Exact tokens: the model's tokenizer and chat template, rendered once by hsx.

The template renders each conversation (transformers' own renderer, so the text is what
``apply_chat_template`` gives); the text is tokenized without adding special tokens (the template
writes BOS itself, and the server gets ``input_ids`` so it cannot add another). Loss masks come
from the template too (masks.py). Content is text: a special-token string inside a message
(``<|eot_id|>``, ``<think>``, the BOS text) is tokenized as ordinary text unless
``specialTokensInContent`` says otherwise; only the template's own special tokens become their ids.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hsx_extractor.reasons import Reason
from hsx_extractor.run import masks
from hsx_extractor.run.dataset import ConfigurationError, RowRefused, Sample

SpecialMode = Literal["text", "allow", "quarantine"]
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
# A row whose content holds more special-token strings than this, rendered in a way that a single
# marked render cannot explain, is quarantined rather than rendered once per string.
MAX_EXAMINED = 64
PROBE = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi, how can I help?"}]


class TokenizerError(ConfigurationError):
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


def alternation(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, the longest at a position first (a trie, so it stays fast
    for the thousand-odd added tokens of large vocabularies)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie) or "(?!)"


def _strings(value: Any) -> Iterator[str]:
    """Every string a row gives the template (message values and tools; not keys, not roles)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "role":
                yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


class ChatTokenizer:
    """A model's tokenizer plus the chat template hsx renders with."""

    def __init__(
        self,
        tokenizer_dir: str | os.PathLike[str],
        chat_template: str | None = None,
        special_tokens_in_content: SpecialMode = "text",
    ) -> None:
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
            raise TokenizerError(f"{self.path}: a fast tokenizer is needed for exact tokens")
        self.mode: SpecialMode = special_tokens_in_content
        self.chat_template: str | None = chat_template or self._tok.chat_template
        self.has_generation = bool(self.chat_template and _GENERATION_RE.search(self.chat_template))
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.special = {
            "bos_token": self._tok.bos_token,
            "eos_token": self._tok.eos_token,
            "pad_token": self._tok.pad_token,
            "add_special_tokens": False,
        }
        self.fingerprint = fingerprint(self.path, self.chat_template, self.special)
        self._backend = self._tok.backend_tokenizer
        # Control tokens: every added token but the whitespace-only ones (some vocabularies add runs
        # of spaces as tokens; those are text).
        added = self._backend.get_added_tokens_decoder()
        self.control = {t.content: i for i, t in added.items() if t.content.strip()}
        self.control_ids = frozenset(self.control.values())
        # Added tokens the tokenizer cuts the raw text at before anything else (not normalized, nothing
        # absorbed around them): what precedes one is encoded as if nothing followed (see _reuse_prefix).
        self._cuts = {
            i: t.content
            for i, t in added.items()
            if t.content.strip() and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        }
        self._longest_added = max((len(t.content) for t in added.values()), default=0)
        self._reuse = False
        self._control_re = re.compile(alternation(self.control))
        self._template_vars = {k: v for k, v in self._tok.special_tokens_map.items() if v is not None}
        self._plain: Any = None  # the tokenizer without control tokens (built on first use)
        self._piece_prefix: str | None = None
        self._bos: int | None = self._probe_bos()
        self._reuse = self._reuse_holds()

    # ---- what the dataset needs ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._tok)

    @property
    def bos_id(self) -> int | None:
        """The BOS every sample must start with, once: the template's (or, without a template, the
        tokenizer's own) when it writes one."""
        return self._bos

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens: a generated turn's last one is its end of turn, not its text."""
        added = (i for i, t in self._tok.added_tokens_decoder.items() if t.special)
        return frozenset(self._tok.all_special_ids).union(added)

    def decode(self, ids: list[int]) -> str:
        """Generated ids as text, special tokens spelled out, nothing cleaned up (it is re-rendered)."""
        return str(self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def description(self) -> dict[str, Any]:
        """What the manifest records of the tokenizer (its ``tokenizer`` section)."""
        return {
            "fingerprint": self.fingerprint,
            "chatTemplate": self.chat_template,
            # Every sample starts with this BOS once, written by the template (or, for pre-tokenized
            # rows without a template, expected as the tokenizer writes it); never added twice.
            "bosTokenId": self._bos,
            "bosHandling": "none" if self._bos is None else "template" if self.chat_template else "tokenizer",
            "addSpecialTokens": False,
            "specialTokensInContent": self.mode,
            "vocabSize": self.vocab_size,
        }

    def chat_samples(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, expand: bool
    ) -> list[Sample | RowRefused]:
        if self.mode == "quarantine":
            found = self.special_text(messages, tools)
            if found is not None:
                refused = RowRefused(
                    Reason.SPECIAL_TOKENS_IN_CONTENT,
                    f"content holds the special-token string {found!r} (dataset.specialTokensInContent: quarantine)",
                )
                return [refused] * (len(masks.assistant_positions(messages)) if expand else 1)
        return masks.chat_samples(self, messages, tools, expand)

    def render(self, messages: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, loss_mask)`` of one conversation, or RowRefused (tests and tools)."""
        sample = self.chat_samples(messages, None, False)[0]
        if isinstance(sample, RowRefused):
            raise sample
        return sample

    def special_text(self, messages: Any, tools: Any = None) -> str | None:
        """The first special-token string inside the row's content, if any."""
        for text in _strings([messages, tools]):
            found = self._control_re.search(text)
            if found:
                return found.group(0)
        return None

    # ---- rendering --------------------------------------------------------------------------
    def render_text(
        self, messages: Any, tools: Any, add_generation_prompt: bool, track: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for a conversation, and its {% generation %} character spans."""
        if not self.chat_template:
            raise TokenizerError(f"{self.path} has no chat template; set dataset.chatTemplate")
        from jinja2.exceptions import TemplateSyntaxError
        from transformers.utils import chat_template_utils

        render_jinja: Any = chat_template_utils.render_jinja_template
        try:
            texts, spans = render_jinja(
                conversations=[messages],
                tools=tools,
                chat_template=self.chat_template,
                return_assistant_tokens_mask=track and self.has_generation,
                add_generation_prompt=add_generation_prompt,
                **self._template_vars,
            )
        except TemplateSyntaxError as exc:
            raise TokenizerError(f"the chat template does not parse: {exc}") from exc
        except Exception as exc:  # the template is code; whatever it raises is about this conversation
            raise RowRefused(Reason.TEMPLATE_ERROR, f"chat template: {exc}") from exc
        return texts[0], ([(int(s[0]), int(s[1])) for s in spans[0]] if spans else [])

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        add_generation_prompt: bool,
        track: bool = False,
        reference: masks.Encoded | None = None,
    ) -> masks.Encoded:
        """The rendered, tokenized conversation. With ``reference`` (a tracked, plain encoding of a
        longer rendering) the tokens it shares are reused where that is exact (``_reuse_prefix``)."""
        text, spans = self.render_text(messages, tools, add_generation_prompt, track)
        as_text = self._content_positions(messages, tools, add_generation_prompt, text) if self.mode == "text" else set()
        if not as_text:
            reused = self._reuse_prefix(text, reference, track) if reference is not None and self._reuse else None
            if reused is not None:
                return masks.Encoded(reused[0], reused[1], spans, text, True)
            enc = self._backend.encode(text, add_special_tokens=False)
            return masks.Encoded(list(enc.ids), list(enc.offsets) if track else [], spans, text, True)
        ids, offsets = self._encode_keeping_text(text, as_text)
        return masks.Encoded(ids, offsets, spans, text)

    # ---- prefix renders reuse the whole conversation's tokens -------------------------------
    def _reuse_prefix(
        self, text: str, ref: masks.Encoded, track: bool
    ) -> tuple[list[int], list[tuple[int, int]]] | None:
        """``text``'s tokens as ``ref``'s up to a cut token both texts share, then ``text`` from that
        token on encoded alone; None where no such token is found (the caller encodes all of it).

        Exact because the tokenizer splits the raw text at such a token (``self._cuts``) before it
        normalizes or pre-tokenizes, and encodes each piece on its own: the pieces before it are the
        same strings in both texts, matched the same way (where ``text`` departs from ``ref.text``, the
        token starts at least the longest added token's length before the departure, so no added
        token of ``text`` can reach back over it). The rest is encoded from the cut token on, so the
        piece after it is still a piece that follows a token (SentencePiece's prefix space)."""
        if not ref.plain or not ref.offsets or len(ref.offsets) != len(ref.ids):
            return None
        if ref.text.startswith(text):
            limit = len(text)
        else:
            lo, hi = 0, min(len(text), len(ref.text))  # longest common prefix, by halving
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if text[:mid] == ref.text[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            limit = lo - self._longest_added
        i = bisect.bisect_right(ref.offsets, limit, key=lambda o: o[1]) - 1
        while i >= 0 and ref.ids[i] not in self._cuts:
            i -= 1
        if i < 1:
            return None
        start, end = ref.offsets[i]
        if end > limit or ref.text[start:end] != self._cuts[ref.ids[i]]:
            return None
        tail = self._backend.encode(text[start:], add_special_tokens=False)
        if not tail.ids or tail.ids[0] != ref.ids[i] or tail.offsets[0] != (0, end - start):
            return None
        ids = ref.ids[:i] + list(tail.ids)
        offsets = ref.offsets[:i] + [(a + start, b + start) for a, b in tail.offsets] if track else []
        return ids, offsets

    def _reuse_holds(self) -> bool:
        """Whether reused prefixes agree with whole encodes on a probe (a tokenizer unlike the ones
        ``_reuse_prefix`` reasons about encodes every render in full)."""
        if not self.chat_template or not self._cuts:
            return False
        try:
            whole = self.encode_chat(PROBE, None, False, track=True)
            for probe, agp in ((PROBE[:1], True), (PROBE, False)):
                self._reuse = True
                fast = self.encode_chat(probe, None, agp, track=True, reference=whole)
                self._reuse = False
                slow = self.encode_chat(probe, None, agp, track=True)
                if (fast.ids, fast.offsets) != (slow.ids, slow.offsets):
                    return False
        except RowRefused:
            return False
        finally:
            self._reuse = False
        return True

    # ---- content stays text ------------------------------------------------------------------
    def _content_positions(self, messages: Any, tools: Any, agp: bool, text: str) -> set[int]:
        """Where in ``text`` a special-token string begins that came from the row's content.

        Renders once more with every such string in the content wrapped in two private markers; when
        the markers come out around it and removing them gives ``text`` back, the string was copied
        from content. A template that reacts to the markers (it splits or strips around a special
        string) is examined one string at a time; a string whose marked render changes the text was
        consumed by the template, and what the template wrote instead is the template's own."""
        if self.special_text(messages, tools) is None:
            return set()
        used = text + "".join(_strings([messages, tools]))
        free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
        a, b = next(free), next(free)
        found = self._marked_positions(messages, tools, agp, text, a, b, None)
        if found is not None:
            return found
        total = self._mark([messages, tools], a, b, None)[1]
        if total > MAX_EXAMINED:
            raise RowRefused(
                Reason.SPECIAL_TOKENS_IN_CONTENT,
                f"content holds {total} special-token strings the chat template transforms; hsx examines at "
                f"most {MAX_EXAMINED} (dataset.specialTokensInContent: allow takes them as special tokens)",
            )
        positions: set[int] = set()
        for k in range(total):
            positions |= self._marked_positions(messages, tools, agp, text, a, b, k) or set()
        return positions

    def _marked_positions(
        self, messages: Any, tools: Any, agp: bool, text: str, a: str, b: str, only: int | None
    ) -> set[int] | None:
        (marked_messages, marked_tools), _ = self._mark([messages, tools], a, b, only)
        try:
            marked, _ = self.render_text(marked_messages, marked_tools, agp)
        except RowRefused:
            return None
        if marked.replace(a, "").replace(b, "") != text:
            return None
        positions, removed = set(), 0
        pattern = re.compile(f"{re.escape(a)}({self._control_re.pattern}){re.escape(b)}|[{a}{b}]")
        for m in pattern.finditer(marked):
            if m.group(1) is not None:
                positions.add(m.start() - removed)
                removed += 2
            else:
                removed += 1
        return positions

    def _mark(self, value: Any, a: str, b: str, only: int | None) -> tuple[Any, int]:
        """``value`` with special-token strings in its strings wrapped in ``a``/``b`` (all, or the
        ``only``-th), and how many there are."""
        count = 0

        def wrap(m: re.Match[str]) -> str:
            nonlocal count
            count += 1
            return f"{a}{m.group(0)}{b}" if only is None or only == count - 1 else m.group(0)

        def walk(x: Any) -> Any:
            if isinstance(x, str):
                return self._control_re.sub(wrap, x)
            if isinstance(x, dict):
                return {k: (v if k == "role" else walk(v)) for k, v in x.items()}
            if isinstance(x, list):
                return [walk(v) for v in x]
            return x

        return walk(value), count

    def _encode_keeping_text(self, text: str, as_text: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokens of ``text`` where the special-token strings starting at ``as_text`` are plain text.

        The text between the template's special tokens is encoded piece by piece without any special
        tokens; that this reproduces the tokenizer's own encoding is checked on the same text with
        nothing kept as text, so a tokenizer for which it does not hold quarantines the row."""
        starts = {m.start() for m in self._control_re.finditer(text)}
        if not as_text <= starts:
            raise RowRefused(Reason.SPECIAL_TOKENS_IN_CONTENT, "special-token text in content overlaps the template's")
        reference = self._backend.encode(text, add_special_tokens=False)
        if self._pieces(text, set())[0] != list(reference.ids):
            raise RowRefused(
                Reason.SPECIAL_TOKENS_IN_CONTENT,
                "this tokenizer cannot encode special-token text in content as plain text exactly "
                "(dataset.specialTokensInContent: allow or quarantine)",
            )
        return self._pieces(text, as_text)

    def _pieces(self, text: str, as_text: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        run = 0
        for m in self._control_re.finditer(text):
            if m.start() in as_text:
                continue
            if m.start() > run:
                self._encode_piece(text[run : m.start()], run, ids, offsets)
            ids.append(self.control[m.group(0)])
            offsets.append((m.start(), m.end()))
            run = m.end()
        if run < len(text):
            self._encode_piece(text[run:], run, ids, offsets)
        return ids, offsets

    def _encode_piece(self, piece: str, start: int, ids: list[int], offsets: list[tuple[int, int]]) -> None:
        plain = self._plain_tokenizer()
        prefix = (self._piece_prefix or "") if start else ""
        enc = plain.encode(prefix + piece, add_special_tokens=False)
        got, at, cut = list(enc.ids), list(enc.offsets), 0
        if prefix:
            head = plain.encode(prefix, add_special_tokens=False).ids
            if got[: len(head)] == head:
                got, at, cut = got[len(head) :], at[len(head) :], len(prefix)
            else:
                enc = plain.encode(piece, add_special_tokens=False)
                got, at = list(enc.ids), list(enc.offsets)
        bad = self.control_ids.intersection(got)
        if bad:
            raise RowRefused(
                Reason.SPECIAL_TOKENS_IN_CONTENT, f"the tokenizer produces special id {min(bad)} from plain text"
            )
        shift = start - cut
        ids += got
        offsets += [(max(s + shift, start), max(e + shift, start)) for s, e in at]

    def _plain_tokenizer(self) -> Any:
        if self._plain is None:
            from tokenizers import Tokenizer

            data = json.loads(self._backend.to_str())
            data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["content"] not in self.control]
            self._plain = Tokenizer.from_str(json.dumps(data))
            self._piece_prefix = self._choose_piece_prefix()
        return self._plain

    def _choose_piece_prefix(self) -> str:
        """How a piece after a special token is encoded alone: as is, or after a newline that is then
        dropped (SentencePiece-style tokenizers add a prefix space at the start of a string)."""
        if not self.control:
            return ""
        token = next(iter(sorted(self.control)))
        sample = f"{token}Hello world{token} and more\n{token}x"
        want = list(self._backend.encode(sample, add_special_tokens=False).ids)
        for prefix in ("", "\n"):
            self._piece_prefix = prefix
            if self._pieces(sample, set())[0] == want:
                return prefix
        return ""

    def _probe_bos(self) -> int | None:
        bos = self.bos_token_id
        if bos is None:
            return None
        if not self.chat_template:
            # Pre-tokenized data only: whether the tokenizer itself starts a text with BOS.
            ids = self._tok("x")["input_ids"]
            return bos if ids and ids[0] == bos else None
        try:
            text, _ = self.render_text(PROBE, None, False)
        except RowRefused:
            return bos if "bos_token" in self.chat_template else None
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            raise TokenizerError("the chat template renders BOS twice; fix the template or tokenizer config")
        return bos if ids and ids[0] == bos else None
