"""The ``hsx`` command. Thin: parse arguments, call one function, map errors to exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hsx_extractor.config import ExtractConfig, with_overrides
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.storage.backends import StoreError
from hsx_extractor.usage import UsageError, describe_validation_error, user_message

# Packages that add to hsx: hsx's operator package reads ExtractionJob manifests and renders Jobs
# (the extractor never imports the operator; pyproject.toml names the entry point).
PLUGIN_GROUP = "hsx.plugins"

# `hsx extract` flags -> dotted config field names (the ExtractionJob spec's names).
EXTRACT_FLAGS: dict[str, tuple[str, type]] = {
    "run_id": ("runId", str),
    "dataset": ("dataset.uri", str),
    "output": ("output.uri", str),
    "model": ("modelPath", str),
    "tokenizer": ("dataset.tokenizer", str),
    "format": ("dataset.format", str),
    "max_length": ("dataset.maxLength", int),
    "limit": ("dataset.limit", int),
    "expected_fingerprint": ("dataset.expectedTokenizerFingerprint", str),
    "server_url": ("serverUrl", str),
    "dump_dir": ("dumpDir", str),
    "dump_dir_max_bytes": ("dumpDirMaxBytes", int),
    "concurrency": ("concurrency", int),
    "shard_target_bytes": ("output.shardTargetBytes", int),
    "compression": ("output.compression", str),
    "replica_index": ("replicaIndex", int),
    "replica_count": ("replicaCount", int),
    "progress_host": ("progressHost", str),
    "progress_port": ("progressPort", int),
    "log_interval": ("logIntervalSeconds", float),
    "on_mismatch": ("validation.onMismatch", str),
    "max_mismatch_rate": ("validation.maxMismatchRate", float),
    "gate_window": ("validation.gateWindow", int),
    "gate_min_samples": ("validation.gateMinSamples", int),
    "dump_timeout": ("validation.dumpTimeoutSeconds", float),
    "max_retries": ("validation.maxRetries", int),
}


def plugins() -> list[Any]:
    """The modules registered under :data:`PLUGIN_GROUP`, loaded."""
    return [ep.load() for ep in metadata.entry_points(group=PLUGIN_GROUP)]


def _parse_pairs(values: Sequence[str], flag: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} wants {what}, got {item!r}")
        out[key] = raw
    return out


def _parse_set(values: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in _parse_pairs(values, "--set", "FIELD=VALUE").items():
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def read_yaml(path: str | Path, what: str) -> list[Any]:
    """The YAML documents of ``path``; a missing file or bad YAML is a :class:`UsageError`."""
    try:
        return list(yaml.safe_load_all(Path(path).read_text()))
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} {path} is not valid YAML: {' '.join(str(exc).split())[:300]}") from None


def _flattened(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys (``{"output": {"uri": x}}`` -> ``{"output.uri": x}``)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flattened(value, dotted) if isinstance(value, dict) else {dotted: value})
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--override FILE`` (config fields, nested or dotted), then flags, then ``--set``, later wins."""
    overrides: dict[str, Any] = {}
    if args.override:
        docs = read_yaml(args.override, "override file")
        if len(docs) != 1 or not isinstance(docs[0], dict):
            raise UsageError(f"override file {args.override} must hold one mapping of config fields")
        overrides.update(_flattened(docs[0]))
    overrides.update({
        field: getattr(args, flag)
        for flag, (field, _) in EXTRACT_FLAGS.items()
        if getattr(args, flag) is not None
    })
    overrides.update(_parse_set(args.set or []))
    if args.chat_template:
        try:
            overrides["dataset.chatTemplate"] = Path(args.chat_template).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read --chat-template {args.chat_template}: {exc.strerror or exc}") from None
    return overrides


def extract_config(args: argparse.Namespace) -> ExtractConfig:
    """The config of ``-f FILE``: an ExtractionJob manifest (the config its pods get, with pod paths
    mapped by ``--mount``) or the in-pod config file the operator writes; flags on top."""
    overrides = _overrides(args)
    mounts = _parse_pairs(args.mount or [], "--mount", "POD_PATH=LOCAL_PATH")
    if args.config:
        docs = read_yaml(args.config, "file")
        if any(isinstance(d, dict) and "kind" in d for d in docs):
            loaders = [p.config_from_manifest for p in plugins() if hasattr(p, "config_from_manifest")]
            if not loaders:
                raise UsageError(f"{args.config} is a Kubernetes manifest; reading one needs hsx's operator package")
            return loaders[0](args.config, overrides, mounts)  # type: ignore[no-any-return]
        if mounts:
            raise UsageError("--mount maps a manifest's pod paths; this file is an in-pod config")
        if len(docs) != 1 or not isinstance(docs[0], dict | None):
            raise UsageError(f"{args.config} must hold one ExtractionJob manifest or one in-pod config mapping")
        data = docs[0] or {}
        if {"model", "server", "extractor"} & set(data):
            raise UsageError(
                f"{args.config} looks like an ExtractionJob's spec alone: give the whole manifest "
                f"(apiVersion: hsx.dev/v1alpha1, kind: ExtractionJob, metadata.name, spec)"
            )
    else:
        data = {}
    try:
        return ExtractConfig.model_validate(with_overrides(data, overrides))
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None


def _config_or_exit(args: argparse.Namespace) -> ExtractConfig | None:
    try:
        return extract_config(args)
    except UsageError as exc:
        print(f"hsx {args.command}: invalid configuration: {exc}", file=sys.stderr, flush=True)
        return None


def cmd_extract(args: argparse.Namespace) -> int:
    from hsx_extractor.run.runner import run_extract

    cfg = _config_or_exit(args)
    return EXIT_PERMANENT if cfg is None else run_extract(cfg)


def cmd_preflight(args: argparse.Namespace) -> int:
    from hsx_extractor.run.preflight import run_preflight

    cfg = _config_or_exit(args)
    return EXIT_PERMANENT if cfg is None else run_preflight(cfg)


def sample_fraction(text: str) -> float:
    """``--sample F``: a fraction in (0, 1]; anything else (nan, inf, 0, 2) is a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def cmd_verify(args: argparse.Namespace) -> int:
    from hsx_extractor.storage.backends import StoreError
    from hsx_extractor.tools.verify import NoRunError, verify_uri

    try:
        reports = verify_uri(args.output, sample_fraction=args.sample)
    except (NoRunError, StoreError, ValueError) as exc:
        print(f"hsx verify: error: {user_message(exc)}", file=sys.stderr, flush=True)
        return EXIT_PERMANENT
    for report in reports:
        if args.json:
            print(json.dumps(report.to_dict(), separators=(",", ":")), flush=True)
        else:
            print(report.summary_text(), flush=True)
    if len(reports) > 1 and not args.json:
        failed = sum(not r.ok for r in reports)
        print(f"{len(reports)} runs under {args.output}: {len(reports) - failed} OK, {failed} FAILED", flush=True)
    return EXIT_OK if all(r.ok for r in reports) else EXIT_PERMANENT


def cmd_serve_reference(args: argparse.Namespace) -> int:
    from hsx_extractor.tools.reference_faults import FaultPlan
    from hsx_extractor.tools.reference_server import run

    if not Path(args.model, "config.json").is_file():
        raise UsageError(f"--model {args.model} is not a model directory (no config.json there)")
    try:
        fault = FaultPlan(args.fault, args.fault_every, args.fault_first_attempt_only)
    except ValueError as exc:
        print(f"hsx serve-reference: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    return run(
        args.model,
        args.dump_dir,
        args.host,
        args.port,
        args.aux_layer_ids,
        fault,
        args.delay_ms / 1000.0,
        args.enable_test_hooks,
        args.threads,
        args.noise_seed,
        args.delay_us_per_token / 1e6,
    )


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError

    template = Path(args.chat_template).read_text() if args.chat_template else None
    try:
        print(ChatTokenizer(args.dir, template).fingerprint, flush=True)
    except TokenizerError as exc:
        print(f"hsx fingerprint: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from hsx_extractor.storage.backends import StoreError
    from hsx_extractor.tools.export import ExportError, export

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        record = export(
            args.output,
            args.to,
            args.dest,
            model_dir=args.model,
            any_model=args.any_model,
            target_model=args.target_model,
            vocab=args.vocab,
            in_place=args.in_place,
            log=log,
        )
    except (ExportError, StoreError, ValueError, OSError) as exc:
        print(f"hsx export: refused: {user_message(exc)}", file=sys.stderr, flush=True)
        return EXIT_PERMANENT
    applied = record["finalNormApplied"]
    where = f"(read in place from {args.output}: launch files only) " if record["inPlace"] else ""
    print(
        f"hsx export: {record['samples']} samples of {record['runId']} for {record['trainer']} {where}in {args.dest} "
        f"(final state {record['finalState']}" + (f", final norm applied from {applied})" if applied else ")"),
        flush=True,
    )
    launch = record.get("launch")
    if launch:
        for note in launch["notes"]:
            print(f"hsx export: note: {note}", flush=True)
        print(f"hsx export: train with: {launch['command']}", flush=True)
    return EXIT_OK


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden_size, seed=args.seed)
    print(build_tiny_model(args.dir, spec), flush=True)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from hsx_extractor.tools.demo import run_demo

    return run_demo(args.output, keep_model=args.keep_model)


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-f",
        "--filename",
        "--config",
        dest="config",
        help="an ExtractionJob manifest (what you kubectl apply), or the in-pod config the operator writes",
    )
    p.add_argument(
        "--mount",
        action="append",
        metavar="POD_PATH=LOCAL_PATH",
        help="where a manifest's pod path lies here (model.mountPath=/data/models); a hostPath source maps itself",
    )
    p.add_argument("--override", metavar="FILE", help="YAML of config fields (nested or dotted) set on top")
    for flag, (field, kind) in EXTRACT_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=kind, help=field)
    p.add_argument("--chat-template", help="file holding dataset.chatTemplate")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="any config field (dotted name)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hsx", description="Capture LLM hidden states for EAGLE-3 drafters.")
    top.add_argument("--version", action="version", version=f"hsx {_version()}")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "extract",
        help="run an extraction against a running server",
        description="Flags and --set FIELD=VALUE use the ExtractionJob spec's field names "
        "and override --config FILE.",
    )
    _config_flags(p)
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser(
        "preflight",
        help="check tokenizer, model config, dataset, output store and dump directory (no server needed)",
        description="What `hsx extract` would refuse at start, checked before the server loads weights "
        "(the pod's first init container). Same configuration as extract.",
    )
    _config_flags(p)
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("verify", help="re-read a run's output and check every checksum")
    p.add_argument(
        "output",
        help="the run's output: {output.uri}/{runId} (directory or s3://), or an output root: every run under it",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.add_argument(
        "--sample",
        type=sample_fraction,
        default=None,
        metavar="F",
        help="check only this fraction of samples, in (0, 1]",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("serve-reference", help="CPU reference server speaking hsx's subset of SGLang's API")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--dump-dir", required=True, help="where dumps are written (one file per rid)")
    p.add_argument("--port", type=int, default=30000, help="0: any free port (printed on start)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="SGLang's --return-aux-hidden-state-layer-ids (default: EAGLE-3's layers)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    # Test hooks: deliberate misbehaviour.
    p.add_argument(
        "--fault",
        choices=["swap", "drop", "truncate", "add_bos", "nan", "error", "drop_response", "prenorm", "wrong_layer", "partial_sum"],
        help="TEST HOOK: spoil requests on purpose",
    )
    p.add_argument(
        "--fault-every", type=int, default=1, help="TEST HOOK: spoil samples whose index %% N == 0"
    )
    p.add_argument(
        "--fault-first-attempt-only", action="store_true", help="TEST HOOK: serve retries correctly"
    )
    p.add_argument(
        "--delay-ms", type=float, default=0.0, help="TEST HOOK: wait this long before each prefill"
    )
    p.add_argument(
        "--delay-us-per-token", type=float, default=0.0,
        help="TEST HOOK: wait this long per prompt token too (a prefill's time grows with its length)",
    )  # fmt: skip
    p.add_argument("--enable-test-hooks", action="store_true", help="TEST HOOK: allow POST /hsx_test/fault")
    p.add_argument(
        "--noise-seed", type=int, default=None,
        help="TEST HOOK: flip the last bit of random bf16 values, as a GPU's output differs from run to run",
    )  # fmt: skip
    p.set_defaults(func=cmd_serve_reference)

    from hsx_extractor.tools.export import TRAINERS

    p = sub.add_parser(
        "export",
        help="write a committed run in a trainer's offline layout (SpecForge, speculators, Model-Optimizer)",
        description="Streams the run (checksums verified) into DEST in the trainer's own layout; "
        "see docs/training.md. The final-norm convention is converted or refused, never guessed.",
    )
    p.add_argument("output", help="the run: {output.uri}/{runId} (directory or s3://)")
    p.add_argument("dest", help="a new or empty local directory")
    p.add_argument("--to", required=True, choices=TRAINERS, help="the trainer whose layout to write")
    p.add_argument(
        "--model", default=None, help="target model directory: its final RMSNorm turns pre-norm states post-norm"
    )
    p.add_argument(
        "--any-model",
        action="store_true",
        help="apply --model's norm even when its fingerprint is not the run's (the same model saved another way)",
    )
    p.add_argument(
        "--target-model",
        default=None,
        help="the target model's path as the trainer sees it, for the launch file (default: --model, else the run's)",
    )
    p.add_argument("--vocab", default=None, help="an `hsx vocab` folder: the draft vocabulary the launch file names")
    p.add_argument(
        "--in-place",
        action="store_true",
        help="copy no hidden state: DEST gets the launch files, and the trainer reads the run through hsx's loader "
        "(python -m hsx_extractor.in_place; docs/training.md)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("fingerprint", help="print a tokenizer's fingerprint")
    p.add_argument("dir", help="tokenizer (or model) directory")
    p.add_argument("--chat-template", help="file holding the chat template to use instead of the tokenizer's")
    p.set_defaults(func=cmd_fingerprint)

    p = sub.add_parser("make-tiny-model", help="build a tiny random model and tokenizer locally")
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="extract the bundled example dataset with a tiny model on CPU")
    p.add_argument("--output", default="demo-output", help="output directory (default ./demo-output)")
    p.add_argument("--keep-model", action="store_true", help="keep the tiny model's temp directory")
    p.set_defaults(func=cmd_demo)

    from hsx_extractor.tools.estimate_cli import add_estimate_command
    from hsx_extractor.tools.runs import add_run_commands
    from hsx_extractor.tools.vocab import add_vocab_command

    add_estimate_command(sub)
    add_vocab_command(sub)
    add_run_commands(sub)
    for plugin in plugins():
        plugin.add_commands(sub)
    return top


def _version() -> str:
    try:
        return metadata.version("hsx")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UsageError, ValidationError, OSError) as exc:
        # What the user gave is wrong (a path, a field): one line and the permanent code, so a pod's
        # Job does not retry what cannot succeed. extract maps its own run's errors (run/failures).
        print(f"hsx {args.command}: error: {user_message(exc)}", file=sys.stderr, flush=True)
        return EXIT_PERMANENT
    except StoreError as exc:  # the store said no (access denied) or stayed away past its retries
        print(f"hsx {args.command}: error: {user_message(exc)}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
