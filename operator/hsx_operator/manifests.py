"""ExtractionJob manifests on the command line: ``hsx extract|preflight|estimate|render -f job.yaml``.

The extractor never imports the operator, so this module plugs into the ``hsx`` command through the
``hsx.plugins`` entry point (pyproject.toml). It reads the manifest with the one model of the spec
(:mod:`hsx_operator.api`), derives the extractor's config with the operator's own
:func:`~hsx_operator.desired.extract_config`, and renders the Job (or JobSet) with the same :func:`~hsx_operator.group.desired_run`.
Pure functions, apart from reading the file and printing.
"""

from __future__ import annotations

import argparse
import posixpath
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hsx_extractor.config import ExtractConfig, with_overrides
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.usage import UsageError, describe_validation_error
from hsx_operator.api import GROUP, KIND, VERSION, ExtractionJobSpec
from hsx_operator.cluster_defaults import ClusterDefaults, annotate, read_defaults, with_cluster_defaults
from hsx_operator.desired import (
    Owner,
    desired_config_map,
    extract_config,
    initial_suspend,
    with_queue_label,
)
from hsx_operator.group import desired_run, pod_specs
from hsx_operator.policy import NodeAccessPolicy, under, violations

API_VERSION = f"{GROUP}/{VERSION}"
# What a rendered object carries instead of the uid the API server assigns at creation.
RENDERED_UID = "00000000-0000-0000-0000-000000000000"


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people: no anchors for repeated objects, multi-line text as a literal block."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)


def is_manifest(document: Any) -> bool:
    """Whether a parsed YAML document is a Kubernetes object (has ``kind``), not an in-pod config."""
    return isinstance(document, dict) and "kind" in document


def extraction_job(documents: list[Any], source: str) -> tuple[Owner, ExtractionJobSpec]:
    """The one ExtractionJob among ``documents`` (other kinds, such as a Secret, are skipped)."""
    jobs = [d for d in documents if is_manifest(d) and d.get("kind") == KIND]
    if len(jobs) != 1:
        kinds = ", ".join(str(d.get("kind")) for d in documents if isinstance(d, dict)) or "none"
        raise UsageError(f"{source} holds {len(jobs)} ExtractionJobs (kinds: {kinds}); give a file with exactly one")
    doc = jobs[0]
    if doc.get("apiVersion") != API_VERSION:
        raise UsageError(f"{source}: apiVersion is {doc.get('apiVersion')!r}, hsx reads {API_VERSION!r}")
    meta = doc.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        raise UsageError(f"{source}: metadata.name is missing")
    try:
        spec = with_queue_label(ExtractionJobSpec.model_validate(doc.get("spec") or {}), meta.get("labels"))
    except ValidationError as exc:
        raise UsageError(f"{source}: {describe_validation_error(exc, prefix='spec')}") from None
    return Owner(name=name, namespace=str(meta.get("namespace") or "default"), uid=RENDERED_UID), spec


def read_manifest(path: str | Path) -> tuple[Owner, ExtractionJobSpec]:
    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(exc).split())[:300]}") from None
    return extraction_job(documents, str(path))


def pod_to_local(spec: ExtractionJobSpec, mounts: dict[str, str]) -> dict[str, str]:
    """Pod paths -> local paths: the given ``--mount POD=LOCAL`` pairs, and a hostPath model source's
    own mapping (on a single-node cluster the node's directory is this machine's)."""
    found = dict(mounts)
    source = spec.model.source
    if source is not None and source.hostPath is not None:
        found.setdefault(spec.model.mountPath, source.hostPath.path)
    return found


def localize(path: str, mapping: dict[str, str]) -> str:
    """``path`` with the longest pod prefix of ``mapping`` replaced by its local directory."""
    for pod in sorted(mapping, key=len, reverse=True):
        if path.startswith("/") and under(path, pod):
            rest = posixpath.relpath(posixpath.normpath(path), posixpath.normpath(pod))
            return mapping[pod] if rest == "." else posixpath.join(mapping[pod], rest)
    return path


def local_config(
    spec: ExtractionJobSpec, overrides: dict[str, Any], mounts: dict[str, str] | None = None
) -> ExtractConfig:
    """The config ``hsx extract`` runs on this machine: the pod's own (operator's ``extract_config``),
    with pod paths mapped to local ones, one process doing every shard, progress on localhost and no
    termination log; then ``overrides`` (dotted field names, from flags, --set and --override)."""
    mapping = pod_to_local(spec, mounts or {})
    pod = extract_config(spec).model_dump(mode="json", exclude_none=True)
    pod["modelPath"] = localize(pod["modelPath"], mapping)
    pod["dataset"]["tokenizer"] = localize(pod["dataset"]["tokenizer"], mapping)
    uri = pod["dataset"]["uri"]
    if not uri.startswith("s3://"):
        pod["dataset"]["uri"] = localize(uri.removeprefix("file://"), mapping)
    pod.update(replicaCount=1, progressHost="127.0.0.1")
    pod.pop("terminationMessagePath", None)
    try:
        return ExtractConfig.model_validate(with_overrides(pod, overrides))
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None


def config_from_manifest(
    path: str | Path, overrides: dict[str, Any], mounts: dict[str, str] | None = None
) -> ExtractConfig:
    """The ``hsx.plugins`` hook the extractor's CLI calls for ``-f`` files that hold a manifest."""
    _, spec = read_manifest(path)
    config = local_config(spec, overrides, mounts)
    if config.modelPath and not Path(config.modelPath).exists():
        raise UsageError(
            f"model path {config.modelPath} does not exist here (spec.model.path is where the pod mounts it): "
            f"give --mount {spec.model.mountPath}=LOCAL_DIR, or --model DIR"
        )
    return config


def rendered(owner: Owner, spec: ExtractionJobSpec, defaults: ClusterDefaults | None = None) -> list[dict[str, Any]]:
    """What the operator creates for this spec (with the cluster's ``defaults``, as the chart passes them): the
    run's ConfigMap and Job (uid a placeholder). A spec that cannot make a Job raises :class:`UsageError` with the
    operator's own reason."""
    spec, filled = with_cluster_defaults(spec, defaults or ClusterDefaults())
    try:
        job = annotate(desired_run(owner, spec, suspend=initial_suspend(spec)), filled)
        return [desired_config_map(owner, spec), job]
    except ValueError as exc:
        raise UsageError(f"the operator would refuse this spec (InvalidSpec): {exc}") from None


def cmd_render(args: argparse.Namespace) -> int:
    owner, spec = read_manifest(args.filename)
    if args.namespace:
        owner = Owner(name=owner.name, namespace=args.namespace, uid=owner.uid)
    try:
        defaults = read_defaults(args.cluster_defaults) if args.cluster_defaults else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    objects = rendered(owner, spec, defaults)
    # The operator's default node-access policy; an admin's --allow-host-path may permit more.
    refused = [why for pod in pod_specs(objects[1]) for why in violations(pod, NodeAccessPolicy())]
    for why in dict.fromkeys(refused):
        print(f"hsx render: warning: the operator's default policy refuses this {objects[1]['kind']}: {why}", file=sys.stderr)
    sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False))
    return EXIT_OK


def add_commands(subparsers: Any) -> None:
    """The ``hsx.plugins`` hook that registers this package's commands."""
    p = subparsers.add_parser(
        "render",
        help="print the ConfigMap and Job the operator would create for an ExtractionJob (dry run)",
        description="The same pure functions the operator runs: images, resources, volumes and the server's "
        "flags, before any GPU is spent. The uid is a placeholder; an admin's policy may differ from the default.",
    )
    p.add_argument("-f", "--filename", required=True, help="the ExtractionJob manifest (YAML)")
    p.add_argument("-n", "--namespace", help="namespace to render into (default: the manifest's, else default)")
    p.add_argument(
        "--cluster-defaults",
        metavar="JSON|@FILE",
        help="the cluster's defaults as the operator has them (the chart's clusterDefaults: JSON, or @values.yaml)",
    )
    p.set_defaults(func=cmd_render)
