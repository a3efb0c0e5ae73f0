"""The template's one import boundary: modules an entry point names at its top but imports only when the run
first needs them.

`python train.py --help` and `--cfg job` answer from the config alone, without torch (2.6-3.3 s to import
here) or anything built on it. So train.py and eval.py declare their torch-side modules with `module()`,
at the top with their other imports (the dependency graph stays in plain sight), and `load_all()` imports
them where the run begins, while garbage collection still pauses for start-up (src/common/heap.py).
Everywhere else, imports are plain imports at the top of their modules.

A declared module is a stand-in that imports the module on first use of one of its attributes. It is not
put into `sys.modules` (as importlib's LazyLoader would): anything that walks the loaded modules, as
`inspect.getmodule` does while torch imports itself, would import them all half-way through.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_deferred: list[Deferred] = []  # declared by module(), in order


class Deferred:
    """The module `name`, imported when one of its attributes is first read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def load(self) -> ModuleType:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attribute: str) -> Any:  # only for what the stand-in itself lacks: the module's names
        return getattr(self.load(), attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by name (submitit pickles the entry point's `main`)
        return Deferred, (self._name,)


def module(name: str, with_the_run: bool = True) -> Any:
    """A stand-in for the module `name` (see the module's docstring); typed Any, as the module it stands for.
    `with_the_run=False`: not imported by `load_all`, only if used (say, what only a launcher's workers need)."""
    deferred = Deferred(name)
    if with_the_run:
        _deferred.append(deferred)
    return deferred


def load_all() -> None:
    """Import every module `module()` declared with the run, in the order declared."""
    for deferred in _deferred:
        deferred.load()
