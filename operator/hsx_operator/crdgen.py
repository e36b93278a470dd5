"""Generate the ExtractionJob CRD from the pydantic models in :mod:`hsx_operator.api`.

``python -m hsx_operator.crdgen --write crds/`` regenerates crds/; ``--check crds/`` fails when the
checked-in files differ from what the models say. Pydantic emits JSON Schema 2020-12; the API
server wants a structural OpenAPI v3.0 schema, so refs are inlined, ``Optional`` unions collapse
to their type, and keywords OpenAPI 3.0 spells differently are rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from hsx_operator import api
from hsx_operator.status import ExtractionJobStatus

CRD_FILE = f"{api.PLURAL}.{api.GROUP}.yaml"
PEERING_FILE = "kopf-peering.yaml"
# Strings the models leave unbounded get this cap, so CEL rules can be priced by the API server.
DEFAULT_MAX_LENGTH = 65536

_DROP = {"title", "additionalProperties_false"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite one pydantic JSON-schema node into a structural OpenAPI v3.0 node."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        if "enum" in target:
            # An Enum field reads like a Literal one: the field's own keys first, its docstring dropped.
            node = {**node, **{k: v for k, v in target.items() if k not in node and k != "description"}}
        else:
            merged = dict(target)
            merged.update(node)  # the field's description and default win over the class's
            node = merged
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express union {variants} structurally")
        inner = dict(variants[0])
        inner.update(node)
        node = inner
        if "$ref" in node:
            return _structural(node, defs)
    if node.get("default", 0) is None:
        del node["default"]
    node.pop("title", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(key), int | float) and not isinstance(node.get(key), bool):
            node[key.replace("exclusiveM", "m")] = node[key]
            node[key] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node.pop("additionalProperties", None)
    elif node.get("additionalProperties") is False or node.get("additionalProperties") is True:
        # Unknown fields are pruned (and rejected by kubectl's strict field validation).
        del node["additionalProperties"]
    if (
        node.get("type") == "string"
        and "maxLength" not in node
        and "enum" not in node
        and "format" not in node
    ):
        node["maxLength"] = DEFAULT_MAX_LENGTH
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if out.get("type") == "array" and "items" not in out:
        raise ValueError(f"array without items: {out}")
    return out


def with_defaults_described(node: dict[str, Any]) -> dict[str, Any]:
    """``kubectl explain`` prints descriptions, not defaults: each scalar default of a spec is stated
    in its field's text (recursively)."""
    out = dict(node)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: with_defaults_described(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = with_defaults_described(out["items"])
    default, text = out.get("default"), out.get("description")
    if default is None or isinstance(default, dict) or not text or "default" in text.lower():
        return out
    if isinstance(default, list) and (
        len(default) > 8 or not all(isinstance(v, str | int | float) for v in default)
    ):
        return out
    shown = default if isinstance(default, str) and default else json.dumps(default)
    out["description"] = f"{text.rstrip()} Default: {shown}."
    return out


def schema_of(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI schema of one pydantic model."""
    raw = model.model_json_schema(mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)  # type: ignore[no-any-return]


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Phase of the current run.",
    },
    {
        # Shown by default: Pending alone does not say whether the run waits for a GPU or can never start.
        "name": "Reason",
        "type": "string",
        "jsonPath": ".status.reason",
        "description": "Why the run is in its phase.",
    },
    {
        "name": "Progress",
        "type": "integer",
        "jsonPath": ".status.progress.percent",
        "description": "Samples processed, %.",
    },
    {
        "name": "Written",
        "type": "integer",
        "jsonPath": ".status.progress.samplesWritten",
        "description": "Samples written to a shard.",
    },
    {
        "name": "Quarantined",
        "type": "integer",
        "jsonPath": ".status.progress.samplesQuarantined",
        "description": "Samples set aside with a reason (hsx show RUN lists the reasons with example lines).",
    },
    {
        "name": "Tok/s",
        "type": "number",
        "jsonPath": ".status.progress.tokensPerSecond",
        "description": "Tokens per second.",
    },
    {
        "name": "ETA",
        "type": "string",
        "jsonPath": ".status.progress.eta",
        "description": "Estimated time left.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Run",
        "type": "string",
        "jsonPath": ".spec.runId",
        "priority": 1,
        "description": "runId of the spec.",
    },
    {
        "name": "Attempt",
        "type": "integer",
        "jsonPath": ".status.attempt",
        "priority": 1,
        "description": "Pod attempt.",
    },
    {
        "name": "Pods",
        "type": "integer",
        "jsonPath": ".spec.parallelism",
        "priority": 1,
        "description": "Replicas the run is asked to have (spec.parallelism; it may change mid-run).",
    },
    {
        "name": "Nodes",
        "type": "integer",
        "jsonPath": ".spec.server.nodes",
        "priority": 1,
        "description": "Pods (nodes) per replica: more than 1 when the server spans nodes (a JobSet).",
    },
    {
        "name": "Shards",
        "type": "string",
        "jsonPath": ".status.progress.shards",
        "priority": 1,
        "description": "Shards committed/total, and of the rest how many are leased and how many free.",
    },
]


def extractionjob_crd() -> dict[str, Any]:
    spec_schema = with_defaults_described(schema_of(api.ExtractionJobSpec))
    status_schema = schema_of(ExtractionJobStatus)
    root = {
        "type": "object",
        "description": "ExtractionJob captures a model's hidden states over a chat dataset into verifiable "
        "shards, for training EAGLE-3 drafters. The operator runs it as a batch/v1 Job.",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                # Indexed Job pods get the hostname "<job name>-<index>": a DNS label, so no dots.
                "rule": "!self.metadata.name.contains('.')",
                "message": "metadata.name may not contain dots: the run's pods take their hostnames from it",
            }
        ],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object (hsx.dev/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (ExtractionJob)."},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "hsx", "app.kubernetes.io/component": "operator"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["hsx"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    # kopf's peering objects: only kopf reads them, so their content is left free-form.
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "Presence of operator replicas (kopf peering).",
                            "properties": {"status": free},
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def rendered() -> dict[str, str]:
    """File name -> YAML text of everything crds/ should hold."""
    header = (
        "# Generated by `python -m hsx_operator.crdgen --write crds/` from hsx_operator.api. Do not edit.\n"
    )
    peering = [
        _peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
        _peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
    ]
    return {
        CRD_FILE: header + yaml.safe_dump(extractionjob_crd(), sort_keys=False, width=110),
        PEERING_FILE: header + yaml.safe_dump_all(peering, sort_keys=False, width=110),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx_operator.crdgen", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="DIR", help="write the CRDs into DIR")
    group.add_argument("--check", metavar="DIR", help="exit 1 if DIR differs from the models")
    group.add_argument("--print", action="store_true", help="print the ExtractionJob CRD")
    args = parser.parse_args(argv)
    files = rendered()
    if args.print:
        sys.stdout.write(files[CRD_FILE])
        return 0
    directory = Path(args.write or args.check)
    if args.write:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
        return 0
    stale = [
        name
        for name, text in files.items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]
    if stale:
        print(f"stale CRDs in {directory}: {', '.join(stale)}; run `make crds`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
