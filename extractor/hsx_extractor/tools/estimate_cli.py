"""``hsx estimate``'s command line: arguments in, the estimate (tools/estimate.py) printed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hsx_extractor.contract import EXIT_PERMANENT
from hsx_extractor.model import ModelConfigError, ModelDims, capture_layers, model_dims, read_model_config
from hsx_extractor.storage.shard_format import COMPRESSION_CODECS
from hsx_extractor.tools.estimate import (
    DEFAULT_RATIOS,
    EstimateError,
    Rows,
    count_dataset,
    estimate_storage,
    estimate_to_json,
    format_estimate,
    trial_ratio,
)
from hsx_extractor.usage import user_message


def add_estimate_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hsx estimate`` on an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "estimate",
        help="estimate the storage a run writes",
        description="Estimate what a run writes: tokens x (aux layers + 1) x hidden x 2 bytes / compression "
        "ratio, plus ids, loss mask and index. Give a dataset (tokenized exactly as hsx extract does) or "
        "--tokens; give --model (config.json) or --hidden-size and --num-layers.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dataset", help="dataset as dataset.uri: JSONL (.gz, .zst) or Parquet, local path or file:// URI"
    )
    src.add_argument("--tokens", type=int, help="total tokens, when you already know them")
    p.add_argument("--samples", type=int, help="number of samples, with --tokens (default: tokens / 2048)")
    p.add_argument(
        "--model", type=Path, help="model directory: config.json, and the tokenizer unless --tokenizer"
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (dataset.tokenizer; default: --model)")
    p.add_argument("--chat-template", type=Path, help="file holding dataset.chatTemplate")
    p.add_argument("--format", choices=["auto", "messages", "tokens"], default="auto", help="dataset.format")
    p.add_argument(
        "--max-length", type=int, default=8192, help="dataset.maxLength (longer rows are quarantined)"
    )
    p.add_argument("--limit", type=int, help="dataset.limit")
    p.add_argument("--expand-turns", action="store_true", help="dataset.expandTurns")
    p.add_argument(
        "--special-tokens-in-content",
        choices=["text", "allow", "quarantine"],
        default="text",
        help="dataset.specialTokensInContent",
    )
    p.add_argument("--responses", choices=["dataset", "regenerate"], default="dataset",
                   help="responses (regenerate: the target writes the answers first; docs/training.md)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=2048, help="generation.maxNewTokens (with --responses regenerate)")
    p.add_argument("--turns", choices=["last", "each"], default="last", help="generation.turns")
    p.add_argument("--mean-new-tokens", type=int,
                   help="tokens a generated turn takes on average (a trial run's; default: --max-new-tokens, the most)")  # fmt: skip
    p.add_argument("--hidden-size", type=int, help="hidden size (overrides config.json)")
    p.add_argument("--num-layers", type=int, help="decoder layers (overrides config.json)")
    p.add_argument(
        "--aux-layer-ids", type=int, nargs="+", help="model.auxLayerIds (default: EAGLE-3's 3 layers)"
    )
    p.add_argument(
        "--compression", choices=sorted(COMPRESSION_CODECS), default="bf16-zstd", help="output.compression"
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--trial",
        metavar="RUN",
        help="a trial run of the same model ({output.uri}/{runId}, local or s3://): its hidden-state ratio, read "
        "from its shard headers, is applied to the hidden states",
    )
    given.add_argument(
        "--compression-ratio",
        type=float,
        help="the ratio a trial run measured: its manifest.json compression.ratio (hsx verify prints it), raw "
        "tensor bytes over stored shard bytes; applied to the same bytes of this estimate (default: "
        f"{DEFAULT_RATIOS['bf16-zstd']} on hidden states alone)",
    )
    p.add_argument(
        "--ratio-measured-on",
        choices=["shards", "hidden"],
        default="shards",
        help="what --compression-ratio was measured on: whole shards (a trial's manifest, the default) or "
        "hidden-state tensors alone",
    )
    p.add_argument("--shard-target-bytes", type=int, default=1 << 30, help="output.shardTargetBytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run_estimate)
    return p


def _dims(args: argparse.Namespace) -> ModelDims:
    config = read_model_config(args.model) if args.model else {}
    if config:
        found = model_dims(config)
        return ModelDims(
            args.hidden_size or found.hidden_size, args.num_layers or found.num_layers, found.architecture
        )
    if args.hidden_size and args.num_layers:
        return ModelDims(args.hidden_size, args.num_layers, "")
    raise EstimateError("give --model DIR, or both --hidden-size and --num-layers")


def run_estimate(args: argparse.Namespace) -> int:
    """``hsx estimate``: read the inputs, print the estimate. Returns the exit code."""
    from hsx_extractor.run.sources import DatasetError
    from hsx_extractor.run.tokens import TokenizerError
    from hsx_extractor.storage.backends import StoreError
    from hsx_extractor.storage.layout import InvalidKeyError

    try:
        dims = _dims(args)
        try:
            num_aux = len(capture_layers(dims.architecture, dims.num_layers, args.aux_layer_ids))
        except ValueError as exc:
            raise EstimateError(str(exc)) from exc
        decode = None
        if args.responses == "regenerate" and not args.dataset:
            raise EstimateError("--responses regenerate needs --dataset: the prompts are counted from it")
        if args.dataset:
            tokenizer_dir = args.tokenizer or args.model
            if tokenizer_dir is None:
                raise EstimateError("counting a dataset's tokens needs --tokenizer or --model")
            from hsx_extractor.config import GenerationSpec

            generation = None
            if args.responses == "regenerate":
                try:
                    generation = GenerationSpec(maxNewTokens=args.max_new_tokens, turns=args.turns)
                except ValueError as exc:
                    raise EstimateError(f"--max-new-tokens {args.max_new_tokens}: {exc}") from exc
            rows, decode = count_dataset(
                args.dataset,
                tokenizer_dir,
                args.chat_template,
                args.max_length,
                args.limit,
                args.format,
                args.expand_turns,
                args.special_tokens_in_content,
                generation,
                args.mean_new_tokens,
            )
        else:
            samples = args.samples if args.samples is not None else max(1, args.tokens // 2048)
            rows = Rows.uniform(samples, args.tokens)
        ratio, basis = args.compression_ratio, args.ratio_measured_on
        if args.trial:
            ratio, measured = trial_ratio(args.trial)
            basis = "hidden"
            if not args.json:
                print(f"trial     {args.trial}: hidden states {ratio:.4f}x over {measured:,} samples")
        est = estimate_storage(
            rows,
            dims.hidden_size,
            num_aux,
            args.compression,
            args.shard_target_bytes,
            ratio,
            basis if ratio is not None else "hidden",
        )
    except (
        EstimateError,
        ModelConfigError,
        DatasetError,
        TokenizerError,
        StoreError,
        InvalidKeyError,
        OSError,
    ) as exc:
        # What the user gave is wrong (a path, a tokenizer, a dataset): say so, no traceback, the
        # permanent exit code as every hsx command; JSON on stderr with --json.
        message = user_message(exc)
        print(json.dumps({"error": message}) if args.json else f"hsx estimate: error: {message}", file=sys.stderr)
        return EXIT_PERMANENT
    if args.json:
        print(json.dumps({**estimate_to_json(est), **({"generation": decode.to_json()} if decode else {})}, indent=2))
    else:
        print(format_estimate(est) + (f"\n{decode.text()}" if decode else ""))
    return 0
