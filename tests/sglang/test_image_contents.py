"""The extractor and operator images install only their extra: their entry points must work
without the packages those images lack (torch above all). The sglang image's hook must import
with nothing but numpy beyond the standard library."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import importlib.abc, sys
    blocked = set({blocked!r})
    class NotInThisImage(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"{{name}} is not installed in this image")
    sys.meta_path.insert(0, NotInThisImage())
    {code}
    """
)


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    script = CHILD.format(blocked=blocked, code=code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize("command", ["extract", "verify"])
def test_extractor_image_commands_need_no_torch(command: str) -> None:
    code = f"from hsx_extractor.tools.cli import main; import hsx_extractor.run.extraction; main([{command!r}, '--help'])"
    run = _run(["torch", "kopf", "kubernetes"], code)
    assert run.returncode == 0, run.stderr
    assert f"usage: hsx {command}" in run.stdout


def test_operator_image_needs_no_data_plane_packages() -> None:
    # numpy is in the operator extra: hsx_extractor.protocol imports it.
    blocked = ["torch", "transformers", "boto3", "tokenizers", "zstandard", "xxhash", "safetensors", "jinja2"]
    run = _run(blocked, "import hsx_operator.main, hsx_operator.desired; print('ok')")
    assert run.returncode == 0, run.stderr


def test_hook_imports_with_numpy_torch_and_the_standard_library_only() -> None:
    # What `pip install --no-deps` puts into the SGLang image: hsx without pydantic, yaml, aiohttp...
    blocked = ["pydantic", "yaml", "aiohttp", "boto3", "tokenizers", "zstandard", "xxhash", "jinja2", "kopf"]
    code = (
        "import hsx_extractor.sglang_hook.bootstrap, hsx_extractor.sglang_hook.hook, "
        "hsx_extractor.sglang_hook.writer; print('ok')"
    )
    run = _run(blocked, code)
    assert run.returncode == 0, run.stderr
