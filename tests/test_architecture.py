"""The layout is the law: each folder of shardkit imports only the folders docs/ARCHITECTURE.md's
table allows it (at the top, inside a function or for type checking: a lazy import is still a
dependency), every module is in a folder of the table, and no module imports itself through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardkit"


def folder_rules() -> dict[str, set[str]]:
    """Folder (`core`, `readers`, ..., `shardkit` for the package's own files) -> folders it may import."""
    rules: dict[str, set[str]] = {}
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`shardkit/"):
            continue
        folder = cells[0].strip("`").removeprefix("shardkit/").rstrip("/") or "shardkit"
        rules[folder] = set(re.findall(r"`([a-z_]+)`", cells[1])) | {folder}
    return rules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The shardkit modules a file imports, wherever the import statement stands, as full dotted
    names (`shardkit.core.errors`; `from . import x` names the module x when it is one)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("shardkit"):
                continue
            for alias in node.names:  # `from . import x`: x is a module when it is a file or a folder
                sub = PACKAGE.parent / (f"{target}.{alias.name}".replace(".", "/"))
                is_module = sub.with_suffix(".py").exists() or sub.is_dir() or any(sub.parent.glob(f"{sub.name}.*.so"))
                found.add(f"{target}.{alias.name}" if is_module else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("shardkit"))
    return found


def folder_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or (PACKAGE / f"{parts[1]}.py").exists() or parts[1] in ("__init__", "__main__"):
        return "shardkit"  # the package's own files (`shardkit/__init__.py`, a leaf like synthetic.py)
    return parts[1]


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): imports(path) for path in sorted(PACKAGE.rglob("*.py"))}
    return {name: {target for target in targets if target != name} for name, targets in modules.items()}


def test_every_folder_imports_only_what_its_row_allows() -> None:
    rules = folder_rules()
    wrong = []
    for module, targets in graph().items():
        folder = folder_of(module)
        assert folder in rules, f"{module}: its folder {folder!r} has no row in docs/ARCHITECTURE.md"
        for target in sorted(targets):
            if folder_of(target) not in rules[folder]:
                wrong.append(f"{module} imports {target}; shardkit/{folder}/ may import {sorted(rules[folder])}")
    assert not wrong, "\n".join(wrong)


def test_every_row_names_a_folder_that_exists() -> None:
    for folder in folder_rules():
        assert folder == "shardkit" or (PACKAGE / folder / "__init__.py").exists(), folder


def test_no_import_cycles() -> None:
    """Through any chain of imports, lazy ones included: a cycle means two modules are one idea, or
    one of them holds something that belongs in a third."""
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def test_reading_never_reaches_the_write_side_or_the_runtime() -> None:
    """What a training job imports (readers, formats, storage, core) pulls in no pack machinery and
    no process machinery (`runtime`: stops, processes, pools, Ray), through any chain of imports."""
    edges = graph()
    for start in [m for m in edges if folder_of(m) in ("readers", "formats", "storage")]:
        seen, pending = set(), [start]
        while pending:
            module = pending.pop()
            if module not in seen:
                seen.add(module)
                pending.extend(edges.get(module, ()))
        bad = sorted(m for m in seen if folder_of(m) in ("packing", "checks", "cli", "runtime"))
        assert not bad, f"{start} reaches {bad}"


def test_the_checker_sees_lazy_relative_and_type_only_imports() -> None:
    """The tests above must be able to fail: each kind of import statement is seen."""
    assert "shardkit.readers.mix" in imports(PACKAGE / "readers" / "dataset.py")  # inside a function
    assert "shardkit.packing.pack" in imports(PACKAGE / "cli" / "pack.py")  # lazy, two dots
    assert "shardkit.core._scan" in imports(PACKAGE / "core" / "codecs.py")  # `from . import _scan`
    assert "shardkit.storage.store" in imports(PACKAGE / "storage" / "cache.py")
    assert folder_of("shardkit.synthetic") == "shardkit" and folder_of("shardkit.readers.split") == "readers"
