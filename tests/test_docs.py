"""The docs say what hsx does: every `hsx ...` command line they show is accepted by hsx's own parser, and
every spec field they name is in the CRD (issue 31, item 6)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_extractor.tools.cli import parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts" / "hsx" / "templates" / "NOTES.txt"]
# Pages that speak of the ExtractionJob's fields by their dotted names without the "spec." prefix.
SPEC_PAGES = {"README.md", "guide.md", "operator-design.md", "security.md", "rbac.md", "sglang.md", "NOTES.txt"}
GROUPS = {"model", "server", "dataset", "output", "validation", "extractor", "scheduling"}
FIELD = re.compile(r"(?<![\w./-])(spec\.)?([A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)*)")


# OUTPUT, N, DIR, ...: a value the reader fills in (a number is accepted wherever a string is).
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|\.\.\.)$")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_lines() -> list[tuple[str, str, bool]]:
    """(page, command line, whole) for each `hsx ...`: whole lines of code blocks, and inline code spans."""
    found = []
    for page in DOCS:
        text = page.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.splitlines():
                if line.startswith("hsx "):
                    found.append((page.name, line.split("  #")[0].strip(), True))
        for span in re.findall(r"`(hsx [^`\n]+)`", text):
            found.append((page.name, span, False))
        found += [(page.name, line.strip(), True) for line in text.splitlines() if line.strip().startswith("hsx estimate ")
                  and page.suffix == ".txt"]  # fmt: skip
    return found


def as_argv(line: str) -> list[str]:
    """A documented line as arguments: [optional] parts kept, the first of a|b|c, ``...`` as one value."""
    words = shlex.split(line.replace("[", " ").replace("]", " "))[1:]
    return [w.split("|")[0] if "|" in w and not w.startswith("-") else ("1" if PLACEHOLDER.match(w) else w) for w in words]


def test_the_docs_show_hsx_commands() -> None:
    lines = command_lines()
    assert len(lines) >= 20 and {"README.md", "NOTES.txt"} <= {page for page, _, _ in lines}


@pytest.mark.parametrize(("page", "line", "whole"), command_lines(), ids=lambda v: str(v)[:60])
def test_every_documented_command_is_accepted_by_hsxs_parser(page: str, line: str, whole: bool) -> None:
    argv = as_argv(line)
    if argv and argv[0].startswith("--"):  # `hsx --version`
        assert argv[0] in parser()._option_string_actions, line
        return
    commands = subcommands()
    assert argv and argv[0] in commands, f"{page}: {line}: no command {argv[:1]}"
    options = commands[argv[0]]._option_string_actions
    unknown = [w.split("=")[0] for w in argv if w.startswith("--") and w.split("=")[0] not in options]
    assert unknown == [], f"{page}: {line}"
    if whole:
        try:
            parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: hsx's parser refuses {line!r}")


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "extractionjobs.hsx.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


def in_schema(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in path.split("."):
        if node.get("type") == "array":
            node = node.get("items", {})
        if "additionalProperties" in node and "properties" not in node:
            return True  # a map (resources.limits): any key
        props = node.get("properties") or {}
        if part not in props:
            return False
        node = props[part]
    return True


def named_fields() -> list[tuple[str, str]]:
    found = []
    for page in DOCS:
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            for match in FIELD.finditer(span):
                name = match.group(2)
                grouped = "." in name and name.split(".")[0] in GROUPS and not name.endswith(".py")
                if match.group(1) or (grouped and page.name in SPEC_PAGES):
                    found.append((page.name, name))
    return sorted(set(found))


def test_every_spec_field_the_docs_name_is_in_the_crd() -> None:
    fields = named_fields()
    assert len(fields) >= 20
    schema = _schema()
    assert [f"{page}: {name}" for page, name in fields if not in_schema(schema, name)] == []


def test_the_field_check_can_fail() -> None:
    schema = _schema()
    assert in_schema(schema, "server.resources.limits.memory") and in_schema(schema, "dataset.maxLength")
    assert not in_schema(schema, "dataset.maxLen") and not in_schema(schema, "model.modelPath")
