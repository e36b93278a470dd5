"""The repository's shape: nothing may shadow the standard library's ``operator``."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_operator_survives_running_from_repo_root() -> None:
    code = "import operator, sys; assert operator.__file__.startswith(sys.base_prefix), operator.__file__; print(operator.add(2, 3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"


def test_packages_have_distinct_names() -> None:
    import hsx_extractor
    import hsx_operator

    assert Path(hsx_extractor.__file__).parent == ROOT / "extractor" / "hsx_extractor"
    assert Path(hsx_operator.__file__).parent == ROOT / "operator" / "hsx_operator"
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_extractor_never_imports_operator() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "extractor").rglob("*.py")
        if "hsx_operator" in p.read_text()
    ]
    assert offenders == []
