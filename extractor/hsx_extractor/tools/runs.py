"""``hsx ls`` (the runs under an output root) and ``hsx show`` (one run: what it holds, what it set
aside and why, per-layer statistics). Read-only; nothing is verified here (``hsx verify`` does that)."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from hsx_extractor.config import OutputSpec, check_uri
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.run.plan import PLAN_NAME, planned_shards
from hsx_extractor.storage.layout import MANIFEST_NAME, split_run_uri
from hsx_extractor.storage.store import Store, open_store
from hsx_extractor.tools.verify import find_runs
from hsx_extractor.usage import UsageError

EXAMPLES_PER_REASON = 3


@dataclass(frozen=True)
class RunSummary:
    """One run as ``hsx ls`` lists it."""

    uri: str
    state: str  # finished (manifest written), running (shards committed, no manifest) or planned
    samples: int
    quarantined: int
    bytes_stored: int
    shards_committed: int
    shards_planned: int | None


def _store(uri: str) -> Store:
    try:
        check_uri(uri)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    root, run_id = split_run_uri(uri)
    return open_store(OutputSpec.model_validate({"uri": root}), run_id, writing=False)


def summarize(uri: str) -> RunSummary:
    """The summary of the run at ``uri``: from its manifest when finished, else its commit records."""
    store = _store(uri)
    try:
        manifest = store.get_json(MANIFEST_NAME)
        plan = store.get_json(PLAN_NAME)
        planned = len(planned_shards(plan)) if plan else None
        if manifest is not None:
            shards = manifest.get("shards") or []
            return RunSummary(uri, "finished", int(manifest.get("samples", 0)), int(manifest.get("quarantined", 0)),
                              sum(int(s.get("bytesStored", 0)) for s in shards), len(shards), planned)  # fmt: skip
        commits = [c for k in sorted(store.committed_shards()) if (c := store.get_commit(k)) is not None]
        return RunSummary(uri, "running" if commits else "planned", sum(c.samples for c in commits),
                          sum(c.quarantined for c in commits), sum(c.bytes_stored for c in commits), len(commits),
                          planned)  # fmt: skip
    finally:
        store.close()


def _pooled(entries: list[dict[str, Any]]) -> dict[str, float] | None:
    """Token-weighted mean and std, min and max over shards' per-layer norm statistics."""
    entries = [e for e in entries if e and e.get("tokens")]
    tokens = sum(e["tokens"] for e in entries)
    if not tokens:
        return None
    mean = sum(e["tokens"] * e["mean"] for e in entries) / tokens
    square = sum(e["tokens"] * (e["std"] ** 2 + e["mean"] ** 2) for e in entries) / tokens
    return {"tokens": tokens, "mean": mean, "std": math.sqrt(max(square - mean * mean, 0.0)),
            "min": min(e["min"] for e in entries), "max": max(e["max"] for e in entries)}  # fmt: skip


def describe(uri: str) -> dict[str, Any]:
    """What ``hsx show`` prints: the manifest's facts, quarantine reasons with example lines, and the
    per-layer token-norm statistics of every shard pooled."""
    store = _store(uri)
    try:
        manifest = store.get_json(MANIFEST_NAME)
    finally:
        store.close()
    if manifest is None:
        s = summarize(uri)
        if s.state == "planned" and s.shards_planned is None:
            raise UsageError(f"{uri}: no hsx run there (no plan.json, commit record or manifest.json)")
        raise UsageError(
            f"{uri} is not finished (no manifest.json; {s.shards_committed} shards committed): "
            "hsx ls shows its progress; hsx show reads a finished run"
        )
    reasons: Counter[str] = Counter()
    examples: dict[str, list[dict[str, Any]]] = {}
    for entry in manifest.get("quarantine") or []:  # the first rows (all of them before quarantineByReason)
        reasons[entry["reason"]] += 1
        if len(examples.setdefault(entry["reason"], [])) < EXAMPLES_PER_REASON:
            examples[entry["reason"]].append({k: entry.get(k) for k in ("line", "sampleId", "detail")})
    by_reason = manifest.get("quarantineByReason")
    if isinstance(by_reason, dict):  # every quarantined row, counted (the list holds the first only)
        reasons = Counter({str(r): int(n) for r, n in by_reason.items()})
    shards = manifest.get("shards") or []
    norms = [s.get("layerNorms") or {} for s in shards]
    layer_ids = (manifest.get("capture") or {}).get("layerIds") or []
    aux = [_pooled([n["aux"][i] for n in norms if len(n.get("aux") or []) > i]) for i in range(len(layer_ids))]
    return {
        "uri": uri,
        "runId": manifest.get("runId"),
        "samples": manifest.get("samples"),
        "quarantined": manifest.get("quarantined"),
        "rows": (manifest.get("run") or {}).get("rows"),
        "shards": len(shards),
        "compression": manifest.get("compression"),
        "capture": manifest.get("capture"),
        "model": {k: (manifest.get("run") or {}).get(k) for k in ("model", "architecture", "hiddenSize", "vocabSize")},
        "dataset": manifest.get("dataset"),
        "maskedTokens": (manifest.get("tokenCounts") or {}).get("total"),
        "quarantineReasons": [{"reason": r, "count": n, "examples": examples.get(r, [])} for r, n in reasons.most_common()],
        "layerNorms": [{"layer": str(layer), **(stats or {})} for layer, stats in zip(layer_ids, aux, strict=True)]
        + [{"layer": "final", **(_pooled([n.get("final") or {} for n in norms]) or {})}],
    }


def show_text(info: dict[str, Any]) -> str:
    c, cap = info["compression"] or {}, info["capture"] or {}
    lines = [
        f"run       {info['runId']} ({info['uri']})",
        f"samples   {info['samples']} written, {info['quarantined']} quarantined, {info['rows']} rows read; "
        f"{info['maskedTokens']} loss-masked tokens",
        f"stored    {c.get('bytesStored')} bytes in {info['shards']} shards ({c.get('setting')}, "
        f"{c.get('ratio')}x of {c.get('bytesRaw')} raw)",
        f"model     {info['model']['model']} ({info['model']['architecture']}, hidden {info['model']['hiddenSize']}, "
        f"vocab {info['model']['vocabSize']})",
        f"capture   {cap.get('engine')} {cap.get('engineVersion')}: layers {cap.get('layerIds')} ({cap.get('layerConvention')})"
        f" + final ({cap.get('finalState')}), {cap.get('dtype')}",
        f"dataset   {(info['dataset'] or {}).get('uri')} ({(info['dataset'] or {}).get('digest')})",
        "quarantined:" if info["quarantineReasons"] else "quarantined: none",
    ]
    for r in info["quarantineReasons"]:
        lines.append(f"  {r['reason']:<28} {r['count']}")
        lines += [f"      line {e['line']} (id {e['sampleId']!r}): {e['detail']}" for e in r["examples"]]
    lines.append("token norms per captured layer (mean, std, min, max over tokens):")
    for n in info["layerNorms"]:
        if "mean" in n:
            lines.append(f"  {n['layer']:<8} {n['mean']:.4g}  {n['std']:.4g}  {n['min']:.4g}  {n['max']:.4g}  ({n['tokens']} tokens)")
    return "\n".join(lines)


def cmd_ls(args: argparse.Namespace) -> int:
    runs = find_runs(args.root)
    if not runs:
        raise UsageError(f"{args.root}: no hsx runs there")
    summaries = [summarize(uri) for uri in runs]
    if args.json:
        print(json.dumps([asdict(s) for s in summaries], indent=2), flush=True)
        return EXIT_OK
    print(f"{'RUN':<32} {'STATE':<9} {'SAMPLES':>9} {'QUARANTINED':>11} {'SHARDS':>9} {'BYTES':>14}")
    for s in summaries:
        shards = f"{s.shards_committed}/{s.shards_planned}" if s.shards_planned is not None else str(s.shards_committed)
        run_id = s.uri.rsplit("/", 1)[-1]
        print(f"{run_id:<32} {s.state:<9} {s.samples:>9} {s.quarantined:>11} {shards:>9} {s.bytes_stored:>14,}")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    info = describe(args.run)
    print(json.dumps(info, indent=2) if args.json else show_text(info), flush=True)
    return EXIT_OK


def add_run_commands(sub: Any) -> None:
    p = sub.add_parser("ls", help="the runs under an output root: state, samples, quarantined, shards, bytes")
    p.add_argument("root", help="an output root: output.uri (directory or s3://)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("show", help="one finished run: what it holds, quarantine reasons with example lines, layer norms")
    p.add_argument("run", help="the run: {output.uri}/{runId} (directory or s3://)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)
