"""The tree keeps its promises: the machinery never imports the fork surface (src/components/ and the research
recipes of src/recipes/, reached only through the config's `_target_`s), and every function of the machinery and
the entry points is short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

FORK_SURFACE = ("src.components", "src.recipes")
MAX_FUNCTION_LINES = 40
ENTRY_POINTS = [REPO / "train.py", REPO / "eval.py"]
MACHINERY = [p for p in sorted((REPO / "src").rglob("*.py"))
             if not {"components", "recipes"} & set(p.relative_to(REPO / "src").parts)]


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
    components = {f"src.components.{p.stem}" for p in (REPO / "src" / "components").glob("*.py")
                  if p.stem != "__init__"}
    assert {"src.components.models", "src.components.datasets", "src.components.tasks"} <= modules == components


@pytest.mark.parametrize("path", [*MACHINERY, *ENTRY_POINTS], ids=lambda p: str(p.relative_to(REPO)))
def test_no_function_of_the_machinery_is_longer_than_40_lines(path: Path):
    """The machinery every fork owns stays short; the fork surface (a research model's forward) is the fork's."""
    too_long = {name: lines for name, lines in function_lengths(path).items() if lines > MAX_FUNCTION_LINES}
    assert too_long == {}


def test_the_length_check_counts_decorators_docstrings_and_nested_functions(tmp_path: Path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 3))
    (tmp_path / "long.py").write_text(f'@decorator\ndef long():\n    """Doc."""\n    def inner():\n{body}\n')
    assert function_lengths(tmp_path / "long.py") == {"long.py:2 long": MAX_FUNCTION_LINES + 1,
                                                      "long.py:4 inner": MAX_FUNCTION_LINES - 2}


def runtime_imports(path: Path) -> set[str]:
    """The modules `path` imports when it runs: every import but those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.update({node.module, *(f"{node.module}.{alias.name}" for alias in node.names)})
    return modules


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SRC = {module_name(p): p for p in sorted((REPO / "src").rglob("*.py"))}


def test_the_loop_names_no_add_on():
    """Its add-ons are callbacks (src/callbacks/) the config names; the loop imports none of them."""
    loop = [p for p in SRC.values() if p.parent.name == "loop"]
    assert {str(p.relative_to(REPO)): sorted(m for m in runtime_imports(p) if m.startswith("src.callbacks"))
            for p in loop if any(m.startswith("src.callbacks") for m in runtime_imports(p))} == {}
    assert "src/loop/trainer.py" in {str(p.relative_to(REPO)) for p in loop}


def test_the_checkpoint_formats_do_not_import_each_other():
    formats = {"src.checkpoint.file_store", "src.checkpoint.sharded_store"}
    for name in formats:
        assert not runtime_imports(SRC[name]) & formats, name


def test_the_import_graph_of_src_has_no_cycle():
    """Imports for annotations only count too: they tie two modules together for a reader all the same."""
    graph = {name: {m for m in imported_modules(path) if m in SRC and m != name} for name, path in SRC.items()}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(path[path.index(name):] + [name])
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])

    for name in graph:
        visit(name, [])
    assert cycles == []


# The imports inside functions of the machinery and the entry points: each one keeps a heavy, optional package out
# of the runs that do not use it (where a `_target_` or a module boundary could not), named here with its reason.
DEFERRED = {
    "src/callbacks/optuna_pruning.py": {"optuna"},  # only in a pruned Optuna trial; the callback is in every run
    "src/loop/export.py": {"safetensors.torch"},  # an optional package, for exporting only
    "src/loop/init_from.py": {"safetensors.torch"},  # likewise, for a .safetensors file only
    "src/parallel/ranks.py": {"submitit"},  # only in submitit's and srun's tasks
}
OWN = ["callbacks", "checkpoint", "config", "loop", "parallel", "reports"]


def deferred_imports(path: Path) -> set[str]:
    inside = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(m for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))
                          for m in ([sub.module] if isinstance(sub, ast.ImportFrom) else [a.name for a in sub.names]))
    return inside


def test_imports_sit_at_the_top_but_for_the_few_named_above():
    paths = [p for package in OWN for p in sorted((REPO / "src" / package).rglob("*.py"))] + ENTRY_POINTS
    found = {str(p.relative_to(REPO)): deferred_imports(p) for p in paths}
    assert {path: modules for path, modules in found.items() if modules} == DEFERRED
