"""The CRD in crds/ is what the models say, and reads well in `kubectl explain`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator import crdgen
from hsx_operator.api import ExtractionJobSpec

ROOT = Path(__file__).resolve().parents[2]


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    return out


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / crdgen.CRD_FILE).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_checked_in_crds_match_the_models() -> None:
    assert crdgen.main(["--check", str(ROOT / "crds")]) == 0, (
        "crds/ drifted from hsx_operator.api: run `make crds`"
    )


def test_check_detects_drift(tmp_path: Path) -> None:
    crdgen.main(["--write", str(tmp_path)])
    path = tmp_path / crdgen.CRD_FILE
    path.write_text(path.read_text().replace("Target size of one shard", "Target size of a shard"))
    assert crdgen.main(["--check", str(tmp_path)]) == 1


def test_every_spec_and_status_field_is_documented() -> None:
    root = _crd_schema()
    missing = [
        p
        for p, node in _walk(root["properties"]["spec"], "spec")
        + _walk(root["properties"]["status"], "status")
        if not p.endswith("[]") and not node.get("description")
    ]
    assert missing == []


def test_every_scalar_default_of_the_spec_is_in_its_description() -> None:
    # kubectl explain prints the description, not the schema's default.
    unsaid = [
        (p, node["default"])
        for p, node in _walk(_crd_schema()["properties"]["spec"], "spec")
        if "default" in node
        and not isinstance(node["default"], dict)
        and "default" not in node.get("description", "").lower()
    ]
    assert unsaid == []
    port = _crd_schema()["properties"]["spec"]["properties"]["server"]["properties"]["port"]
    assert port["description"].endswith("Default: 30000.")


def test_schema_is_structural() -> None:
    for path, node in _walk(_crd_schema()["properties"]["spec"], "spec"):
        assert not {"anyOf", "oneOf", "allOf", "$ref", "title", "const"} & node.keys(), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if node.get("type") == "string":
            assert "maxLength" in node or "enum" in node or "format" in node, path


@pytest.mark.parametrize(
    "path, default",
    [
        ("spec.server.gpus", 8),
        ("spec.server.engine", "sglang"),
        ("spec.output.compression", "bf16-zstd"),
        ("spec.validation.onMismatch", "quarantine"),
        ("spec.parallelism", 1),
        ("spec.backoffLimit", 3),
        ("spec.suspend", False),
        ("spec.server", {}),
    ],
)
def test_defaults_match_the_models(path: str, default: Any) -> None:
    nodes = dict(_walk(_crd_schema()["properties"]["spec"], "spec"))
    assert nodes[path]["default"] == default
    model = ExtractionJobSpec.model_validate(
        {
            "runId": "r",
            "model": {"path": "/m"},
            "dataset": {"uri": "d", "tokenizer": "/t"},
            "output": {"uri": "o"},
        }
    )
    value: Any = model.model_dump()
    for part in path.split(".")[1:]:
        value = value[part]
    if default != {}:
        assert value == default


def test_printer_columns() -> None:
    crd = yaml.safe_load((ROOT / "crds" / crdgen.CRD_FILE).read_text())
    version = crd["spec"]["versions"][0]
    cols = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(cols) == [
        "Phase", "Reason", "Progress", "Written", "Quarantined", "Tok/s", "ETA", "Age", "Run", "Attempt", "Pods",
        "Nodes", "Shards",
    ]
    assert all(cols[n].get("priority") == 1 for n in ("Run", "Attempt", "Pods", "Nodes", "Shards"))
    assert "priority" not in cols["Reason"]  # shown by default: Pending alone does not say why
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["xj"]
