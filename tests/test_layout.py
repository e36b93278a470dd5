"""The repository's shape: the rooms of docs/architecture.md and the one direction of their imports.

Imports are read from the source (every import statement, lazy and TYPE_CHECKING ones included),
so a rule broken anywhere in a module fails here, whether or not that line runs in a test.
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRACTOR = ROOT / "extractor" / "hsx_extractor"
OPERATOR = ROOT / "operator" / "hsx_operator"
MAX_MODULE_LINES = 500

# The extractor's top level: facts shared by every room. None imports a room.
SHARED = {"config", "contract", "reasons", "protocol", "model", "usage"}
# What the operator may take from the extractor: its config and contract, file-name constants,
# and the engines' launchers (pure: they build the server's command line).
OPERATOR_MAY_IMPORT = {
    "hsx_extractor",
    "hsx_extractor.config",
    "hsx_extractor.contract",
    "hsx_extractor.protocol",
    "hsx_extractor.storage.layout",
    "hsx_extractor.usage",
    "hsx_extractor.sglang_hook.launch",
    "hsx_extractor.vllm_hook.launch",
}


def module_name(path: Path) -> str:
    package_root = EXTRACTOR if path.is_relative_to(EXTRACTOR) else OPERATOR
    parts = [package_root.name, *path.relative_to(package_root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[str]:
    """Absolute names of the hsx modules ``path`` imports (``from a import b`` yields a.b if it is a module)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("hsx_"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("hsx_"):
                continue
            for alias in node.names:
                candidate = f"{mod}.{alias.name}"
                yield candidate if candidate in ALL_MODULES else mod


def modules() -> dict[str, Path]:
    return {module_name(p): p for root in (EXTRACTOR, OPERATOR) for p in root.rglob("*.py")}


ALL_MODULES = set(modules())


def graph() -> dict[str, set[str]]:
    edges = {name: set(imports_of(path)) & ALL_MODULES - {name} for name, path in modules().items()}
    # The public face loads its names on first use (module __getattr__), never while a module that
    # imports it (for __version__) is itself being imported: those are not import-time edges.
    edges["hsx_extractor"] = set()
    return edges


def room(module: str) -> str:
    """The room a module lives in: run, storage, tools, sglang_hook, vllm_hook, shared, reader, operator."""
    parts = module.split(".")
    if parts[0] == "hsx_operator":
        return "operator"
    if len(parts) == 1:
        return "face"
    if parts[1] in {"run", "storage", "tools", "sglang_hook", "vllm_hook"}:
        return parts[1]
    return "shared" if parts[1] in SHARED else parts[1]


def test_no_import_cycles() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == []


# Room -> the rooms it must never import.
FORBIDDEN = {
    "shared": {"run", "storage", "tools", "reader", "sglang_hook", "vllm_hook", "operator"},
    "storage": {"run", "tools", "reader", "sglang_hook", "vllm_hook", "operator"},
    "reader": {"run", "tools", "sglang_hook", "vllm_hook", "operator"},
    "run": {"tools", "reader", "operator"},
    "sglang_hook": {"run", "storage", "tools", "reader", "vllm_hook", "operator"},
    "vllm_hook": {"run", "storage", "tools", "reader", "sglang_hook", "operator"},
    "tools": {"operator", "in_place"},
    "in_place": {"run", "sglang_hook", "vllm_hook", "operator"},
}


def crossings(edges: dict[str, set[str]]) -> list[str]:
    """``module -> import`` pairs where a module's room imports a room FORBIDDEN to it."""
    return sorted(
        f"{m} -> {dep}"
        for m, deps in edges.items()
        for dep in deps
        if room(dep) in FORBIDDEN.get(room(m), set())
    )


def test_rooms_import_in_one_direction() -> None:
    assert crossings(graph()) == []


def test_the_checker_reports_a_crossing() -> None:
    fake = {
        "hsx_extractor.storage.store": {"hsx_extractor.run.plan", "hsx_extractor.storage.layout"},
        "hsx_extractor.model": {"hsx_extractor.config"},
    }
    assert crossings(fake) == ["hsx_extractor.storage.store -> hsx_extractor.run.plan"]


def test_operator_imports_only_the_agreed_extractor_modules() -> None:
    used = {
        dep
        for name, path in modules().items()
        if name.startswith("hsx_operator")
        for dep in imports_of(path)
        if dep.startswith("hsx_extractor")
    }
    assert used - OPERATOR_MAY_IMPORT == set()


def test_operator_imports_no_numpy_or_torch() -> None:
    code = (
        "import sys, hsx_operator.handlers, hsx_operator.crdgen, hsx_operator.main; "
        "print(sorted(m for m in ('numpy', 'torch', 'boto3', 'zstandard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_is_too_long() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_stdlib_operator_survives_running_from_repo_root() -> None:
    code = "import operator, sys; assert operator.__file__.startswith(sys.base_prefix), operator.__file__; print(operator.add(2, 3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"


def test_packages_have_distinct_names() -> None:
    import hsx_extractor
    import hsx_operator

    assert Path(hsx_extractor.__file__).parent == EXTRACTOR
    assert Path(hsx_operator.__file__).parent == OPERATOR
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_extractor_never_imports_operator() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "extractor").rglob("*.py")
        if "hsx_operator" in p.read_text()
    ]
    assert offenders == []


def test_the_public_face() -> None:
    import hsx_extractor

    assert {"HiddenStatesDataset", "OutputReader", "ExtractConfig"} <= set(hsx_extractor.__all__)
    assert hsx_extractor.ExtractConfig.__module__ == "hsx_extractor.config"
    assert hsx_extractor.HiddenStatesDataset.__module__ == "hsx_extractor.reader"
