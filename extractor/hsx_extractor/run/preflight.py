"""``hsx preflight``: every check that needs no inference server, before the server loads weights.

In the pod this is the first init container: a wrong tokenizer path, an unreadable dataset, a bucket
the credentials cannot write or a store that ignores conditional writes fails the run in seconds,
not after an hour of weights loading on 8 GPUs. The checks are the extraction's own start-up steps
(same functions), so preflight and the run cannot disagree about what is valid.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import islice

from hsx_extractor import protocol
from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.model import check_vocab, model_shape, read_model_config, text_config
from hsx_extractor.run.dataset import Rejected, dataset_rows
from hsx_extractor.run.extraction import Extraction
from hsx_extractor.run.failures import describe_failure, permanent
from hsx_extractor.run.regenerate import row_samples
from hsx_extractor.run.runner import write_termination_message
from hsx_extractor.storage.store import open_store

# Rows read to prove the dataset opens, parses and renders with the chat template: if every one of them
# would be set aside, the settings (format, template) are wrong, not the data.
ROWS_READ = 20


def preflight(cfg: ExtractConfig, say: Callable[[str], None]) -> None:
    """Run the checks in the order a run needs them; the first failure raises (see failures.py)."""
    tok = Extraction(cfg).open_tokenizer()
    say(f"tokenizer ok: {cfg.dataset.tokenizer or cfg.modelPath} (fingerprint {tok.fingerprint})")
    if cfg.modelPath:
        shape = model_shape({}, cfg.modelPath, cfg.auxLayerIds)
        check_vocab(shape, tok.vocab_size, cfg.modelPath)
        say(
            f"model ok: {cfg.modelPath} (hidden {shape.hidden_size}, captured layers {list(shape.capture_layers)})"
        )
        context = text_config(read_model_config(cfg.modelPath)).get("max_position_embeddings")
        if isinstance(context, int) and cfg.dataset.maxLength > context:
            say(
                f"warning: dataset.maxLength {cfg.dataset.maxLength} exceeds the model's max_position_embeddings "
                f"{context}: longer samples fail unless the server's context length is raised"
            )
    rows = list(
        islice(
            dataset_rows(cfg),
            ROWS_READ,
        )
    )
    if not rows:
        raise permanent(f"dataset {cfg.dataset.uri} has no rows")
    samples = list(row_samples(cfg, rows, tok))  # a regenerating run's rows as its prompts
    rejected = [s for s in samples if isinstance(s, Rejected)]
    reasons = ", ".join(f"line {r.line}: {r.reason}: {r.detail[:200]}" for r in rejected[:3])
    if rejected and len(rejected) == len(samples):
        raise permanent(
            f"DatasetRejected: all {len(samples)} of the first rows of {cfg.dataset.uri} would be set aside ({reasons}); "
            "check dataset.format, chatTemplate and maxLength"
        )
    if rejected:
        say(f"dataset ok: {cfg.dataset.uri} opens; {len(rejected)} of its first {len(samples)} rows will be quarantined: {reasons}")
    else:
        say(f"dataset ok: {cfg.dataset.uri} (its first {len(samples)} rows render)")
    try:  # reachability, credentials, conditional writes
        store = open_store(cfg.output, cfg.runId)
    except ValueError as exc:
        raise permanent(f"output {cfg.output.uri}: {exc}") from exc
    try:
        say(f"output ok: {store.description}")
    finally:
        store.close()
    protocol.make_dump_dir(cfg.dumpDir)  # made by the extractor's user before the server starts
    say(f"dump directory ok: {cfg.dumpDir}")


def run_preflight(cfg: ExtractConfig) -> int:
    """``hsx preflight``: the checks, a line each; exit code and termination message as ``hsx extract``'s."""

    def say(line: str) -> None:
        print(f"hsx preflight: {line}", flush=True)

    try:
        preflight(cfg, say)
    except Exception as exc:
        message, code = describe_failure(exc)
        print(f"hsx preflight: error: {message}", file=sys.stderr, flush=True)
        if cfg.terminationMessagePath:
            write_termination_message(cfg.terminationMessagePath, f"preflight failed: {message}")
        return code
    return EXIT_OK
