"""The package's layout as the README draws it: no import cycles between modules, and the engine
never imports an instrument (bench/) or a teaching helper (teach/)."""

import ast
from pathlib import Path

import nanoserve

ROOT = Path(nanoserve.__file__).parent
ENGINE_FREE_OF = ("nanoserve.bench", "nanoserve.teach")
NOT_ENGINE = ("nanoserve.bench", "nanoserve.teach", "nanoserve.cli", "nanoserve.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every nanoserve module `path` imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("nanoserve"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` names a module
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("nanoserve"))
    modules = {module_name(p) for p in ROOT.rglob("*.py")}
    return {m for m in out if m in modules} - {name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in ROOT.rglob("*.py")}


def test_no_import_cycles():
    g = graph()
    # a package's __init__ re-exporting its own submodules is not a cycle worth the name: skip the edge
    # from a module to its own package __init__
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in g.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in edges.get(m, ()):
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])


def test_the_engine_imports_no_instrument_or_teaching_helper():
    for m, targets in graph().items():
        if m == "nanoserve" or m.startswith(NOT_ENGINE):
            continue
        bad = sorted(t for t in targets if t.startswith(ENGINE_FREE_OF))
        assert not bad, f"{m} imports {bad}"
