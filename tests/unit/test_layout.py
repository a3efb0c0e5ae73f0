"""The tree keeps its promises: the machinery never imports the fork surface (src/components/, reached
only through the config's `_target_`s), and every function of src/ and the entry points is short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

FORK_SURFACE = "src.components"
MAX_FUNCTION_LINES = 40
ENTRY_POINTS = [REPO / "train.py", REPO / "eval.py"]
MACHINERY = [p for p in sorted((REPO / "src").rglob("*.py")) if "components" not in p.relative_to(REPO / "src").parts]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of each function and method in `path`, from its `def` (or first decorator) to its last line."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lengths[f"{path.name}:{node.lineno} {node.name}"] = node.end_lineno - first + 1
    return lengths


def test_the_machinery_and_entry_points_never_import_the_fork_surface():
    assert len(MACHINERY) > 30
    upward = {str(p.relative_to(REPO)): sorted(m for m in imported_modules(p) if m.startswith(FORK_SURFACE))
              for p in MACHINERY + ENTRY_POINTS}
    assert {path: modules for path, modules in upward.items() if modules} == {}


def test_the_fork_surface_is_named_by_the_configs_targets():
    targets = {line.split("_target_:")[1].strip() for p in (REPO / "conf").rglob("*.yaml")
               for line in p.read_text().splitlines() if "_target_: src.components." in line}
    modules = {target.rsplit(".", 1)[0] for target in targets}
    assert modules == {"src.components.models", "src.components.datasets", "src.components.tasks"}


@pytest.mark.parametrize("path", [*MACHINERY, *sorted((REPO / "src" / "components").rglob("*.py")), *ENTRY_POINTS],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_function_is_longer_than_40_lines(path: Path):
    too_long = {name: lines for name, lines in function_lengths(path).items() if lines > MAX_FUNCTION_LINES}
    assert too_long == {}


def test_the_length_check_counts_decorators_docstrings_and_nested_functions(tmp_path: Path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 3))
    (tmp_path / "long.py").write_text(f'@decorator\ndef long():\n    """Doc."""\n    def inner():\n{body}\n')
    assert function_lengths(tmp_path / "long.py") == {"long.py:2 long": MAX_FUNCTION_LINES + 1,
                                                      "long.py:4 inner": MAX_FUNCTION_LINES - 2}
