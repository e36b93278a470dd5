"""A tiny, seeded, random-initialised Llama-style model with a locally trained tokenizer.

Tests and the demo need a real model directory (config, weights, tokenizer, chat template)
without downloading anything. Everything here is built from the bundled example dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
TURN_START = "<|start|>"
TURN_END = "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, TURN_START, TURN_END]

# Assistant turns are wrapped in {% generation %} so the loss mask comes from the template itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults keep a forward pass to milliseconds on one CPU core."""

    num_layers: int = 8
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    max_positions: int = 4096
    seed: int = 0
    # Generation tests (responses: regenerate): the head speaks only this many whole words (a
    # leading-space token each, which the tokenizer encodes back to itself) and the end-of-turn token,
    # so what the model generates re-renders to the generated ids. 0: every token, as initialised.
    spoken_words: int = 0


def example_dataset_path() -> Path:
    """The bundled example dataset (a few dozen chats plus deliberately malformed rows)."""
    return Path(str(resources.files("hsx_extractor") / "data" / "example.jsonl"))


def _training_text(path: Path) -> Iterator[str]:
    # Learn merges from the conversations' text; undecodable or malformed lines are skipped.
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw.decode("utf-8"))
        except ValueError:
            continue
        for message in row.get("messages") or []:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                yield message["content"]


def build_tokenizer(
    out_dir: Path,
    vocab_size: int,
    corpus: Path | None = None,
    *,
    special_tokens: list[str] | None = None,
    bos: str | None = BOS,
    eos: str = EOS,
    pad: str | None = PAD,
    chat_template: str = CHAT_TEMPLATE,
    plain_added_tokens: tuple[str, ...] = (),
) -> None:
    """Train a byte-level BPE tokenizer and save it with its chat template as a HF tokenizer dir.

    The keyword arguments give other models' special tokens and template (tests of real templates);
    ``plain_added_tokens`` are added tokens that are not special (as Qwen's ``<think>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens or SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(corpus or example_dataset_path()), trainer=trainer)
    if plain_added_tokens:
        tok.add_tokens(list(plain_added_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        # The template writes BOS itself; the tokenizer must not add a second one.
        add_bos_token=False,
        add_eos_token=False,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, corpus: Path | None = None
) -> Path:
    """Write a complete model directory (config, safetensors weights, tokenizer) to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per save is noise in the demo's output
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size, corpus)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    config = LlamaConfig(
        vocab_size=max(vocab, len(SPECIAL_TOKENS)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    if spec.spoken_words:
        _speak_words(model, out, spec.spoken_words)
    model.save_pretrained(str(out), safe_serialization=True)
    _readable_as_umask_allows(out)
    return out


def _speak_words(model: object, out: Path, count: int) -> None:
    """Give the head rows for ``count`` whole words and TURN_END only (every other logit is 0). Every
    embedding gets a constant first component, which the residual stream carries to every final state;
    the kept rows read it, so those tokens take nearly all the mass in any context (small random parts
    choose among them). TURN_END, a little likelier than a word (about one step in seven), ends
    generation (generation_config.json)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    words = sorted(t for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 3
                   and tok.encode(tok.decode([vocab[t]]), add_special_tokens=False).ids == [vocab[t]])  # fmt: skip
    keep = [vocab[t] for t in words[:count]] + [SPECIAL_TOKENS.index(TURN_END)]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # type: ignore[attr-defined]
        head = model.lm_head.weight  # type: ignore[attr-defined]
        head.zero_()
        head[keep] = 0.15 * torch.randn(len(keep), head.shape[1])
        head[keep, 0] = 3.0
        head[keep[-1], 0] += 0.09
    model.generation_config.eos_token_id = [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(TURN_END)]  # type: ignore[attr-defined]


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for every thread, for a moment)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _readable_as_umask_allows(directory: Path) -> None:
    """The weights file is written through a private temporary file (0600): give every file the mode a
    plain write would have had, so a pod's non-root user (uid 65532) can read a model made as root."""
    mode = 0o666 & ~_umask()
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(mode)
