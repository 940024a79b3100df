"""The package's layout as the README draws it: layers that import only downward, folders included (a
module may import its own folder's modules and anything in a lower layer, never a higher one), no import
cycle between modules with package `__init__`s counted, and no two public classes of the same name."""

import ast
import re
from pathlib import Path

import nanoserve
from nanoserve.cli import build_parser

ROOT = Path(nanoserve.__file__).parent

LAYERS = [
    ["config"],
    ["kernels", "tokenizer"],
    ["structured", "kv"],
    ["sampling", "attention"],
    ["stopping", "model"],
    ["engine"],
    ["stages", "loader"],
    ["generate", "llm"],
    ["server"],
    ["bench"],
    ["teach"],
    ["cli"],
    ["__main__", "__init__"],
]
"""Bottom to top: a unit (a top-level module or folder, `__init__` the package's own) imports only units of
its own layer's lower neighbours, never one above it. The engine never imports an instrument or a teaching
helper; instruments import the engine; notebooks import both."""

RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its top-level module or folder under nanoserve."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


MODULES = {module_name(p) for p in ROOT.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every nanoserve module `path` imports, at the top, inside a function or under TYPE_CHECKING. `from . import x`
    imports module x when x is one, else the package itself (whose `__init__` defines x)."""
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
            if not target.startswith("nanoserve"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("nanoserve"))
    return {m for m in out if m in MODULES} - {name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in ROOT.rglob("*.py")}


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(RANK), f"add {sorted(units - set(RANK))} to LAYERS"


def test_imports_only_go_down_the_layers():
    bad = []
    for m, targets in graph().items():
        for t in targets:
            a, b = unit_of(m), unit_of(t)
            if a != b and RANK[b] >= RANK[a]:
                bad.append(f"{m} ({a}, layer {RANK[a]}) imports {t} ({b}, layer {RANK[b]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles_package_inits_included():
    edges = graph()
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


def test_no_two_public_classes_share_a_name():
    where: dict[str, list[str]] = {}
    for p in ROOT.rglob("*.py"):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module_name(p))
    clashes = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not clashes, clashes


def test_the_checks_catch_what_they_claim():
    """A cycle through a package __init__ and an upward import are seen: the test is not vacuous."""
    assert RANK["engine"] < RANK["generate"] and RANK["kv"] < RANK["attention"] < RANK["model"]
    assert imports(ROOT / "engine" / "llm_engine.py") >= {"nanoserve.engine.scheduler", "nanoserve.config"}
    assert "nanoserve.kernels" in imports(ROOT / "model" / "ops.py")  # `from .. import kernels`: the package


def readme_layout() -> dict[str, str]:
    """The README's layout drawing (the fenced block under "## Layout"), as {folder: its text}, "" for the
    top-level modules' entries."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    entries: dict[str, str] = {}
    key = ""
    for line in readme.split("\n## Layout\n", 1)[1].split("```")[1].splitlines()[2:]:  # after "nanoserve/"
        if line.startswith("  ") and not line.startswith("   "):  # a new entry: a folder, or top-level modules
            first = line.split()[0]
            key = first.rstrip("/") if first.endswith("/") else ""
        entries[key] = entries.get(key, "") + line + "\n"
    return entries


def drawn_commands(entries: dict[str, str]) -> list[str]:
    """The `bench` commands the drawing lists in its bench/ entry."""
    listed = re.search(r"the `bench` commands \(([^)]*)\)", entries["bench"]).group(1)
    return [" ".join(c.split()) for c in listed.split(",")]


def unnamed_modules(entries: dict[str, str], root: Path = ROOT) -> list[str]:
    """The package's modules (not `__init__`, `__main__`) that their folder's entry does not name; a `bench`
    command's module may be named by its command."""
    out = []
    for p in root.rglob("*.py"):
        folder = "" if p.parent == root else p.parent.relative_to(root).as_posix()
        text = entries.get(folder, "")
        if folder == "bench":
            text += " ".join(f"{c}.py" for c in drawn_commands(entries))
        if p.stem not in ("__init__", "__main__") and not re.search(rf"(?<![\w.]){re.escape(p.name)}", text):
            out.append(str(p.relative_to(root)))
    return sorted(out)


def test_the_readme_layout_names_every_module_and_bench_command():
    """A newcomer finds each file in the folder where the README's drawing puts it, and each `bench` command."""
    entries = readme_layout()
    assert unnamed_modules(entries) == []
    moved = {k: v.replace("torch_ops.py", "") for k, v in entries.items()} | {"": entries[""] + "torch_ops.py"}
    assert unnamed_modules(moved) == ["attention/torch_ops.py"]  # named, but in another folder's entry
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert sorted(drawn_commands(entries)) == sorted(bench._subparsers._group_actions[0].choices)
