"""docs/ARCHITECTURE.md's module table is the law: every module has a row, and imports only what
its row allows (at the top or inside a function)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardkit"
READING = {"readers", "loader", "torch_data", "formats", "imaging", "manifest"}
WRITING = {"pack", "plan", "output", "executors", "probe", "discover"}


def table() -> dict[str, set[str]]:
    """Row name (`errors`, `formats`, `cli`, `shardkit` for the package files) -> allowed imports."""
    rows: dict[str, set[str]] = {}
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`shardkit/"):
            continue
        allowed = set(re.findall(r"`([a-z_]+)`", cells[2]))
        for path in re.findall(r"`shardkit/([^`]*)`", cells[0]):
            rows[_row_name(path)] = allowed
    return rows


def _row_name(path: str) -> str:
    if path.endswith("/"):
        return path.rstrip("/")
    if path in ("__init__.py", "__main__.py"):
        return "shardkit"
    return path.removesuffix(".py")


def module_row(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) > 1:
        return relative.parts[0]
    return _row_name(relative.name)


def imports(path: Path) -> set[str]:
    """The shardkit modules a file imports, as first-level names (`formats`, not `formats.lmdb`)."""
    found: set[str] = set()
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 in shardkit/, 1 in shardkit/cli/
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level > depth + 1:
                continue
            if node.level == depth + 1:  # relative to shardkit/
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names if alias.name != "__version__")
                    found.update("shardkit" for alias in node.names if alias.name == "__version__")
            # level <= depth: a sibling inside the same package, always allowed
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardkit"):
            found.add(node.module.split(".")[1] if "." in node.module else "shardkit")
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("shardkit."))
    return found


def test_every_module_has_a_row_and_imports_only_what_it_allows() -> None:
    rows = table()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        row = module_row(path)
        assert row in rows, f"{path.relative_to(ROOT)} has no row in docs/ARCHITECTURE.md"
        extra = imports(path) - rows[row] - {row}
        if extra:
            wrong.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}, its row allows {sorted(rows[row])}")
    assert not wrong, "\n".join(wrong)


def test_every_row_names_a_module_that_exists() -> None:
    for row in table():
        assert row == "shardkit" or (PACKAGE / f"{row}.py").exists() or (PACKAGE / row).is_dir(), row


def test_reading_never_reaches_the_writing_side() -> None:
    """Through any chain of imports, as the table allows them: the rule the table encodes."""
    rows = table()
    for start in READING:
        seen, stack = set(), [start]
        while stack:
            module = stack.pop()
            if module in seen or module not in rows:
                continue
            seen.add(module)
            stack.extend(rows[module])
        assert not seen & WRITING, f"{start} reaches {sorted(seen & WRITING)}"


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    """The test above must be able to fail: a function-level import from the writing side is seen."""
    probe_file = PACKAGE / "readers.py"
    assert "formats" in imports(probe_file) and "loader" in imports(probe_file)  # top level and lazy
    assert "pack" in imports(PACKAGE / "cli" / "pack.py")  # lazy, inside the command, two dots
