"""The template's one import boundary: modules an entry point names at its top but imports only when the run
first needs them.

`python train.py --help` and `--cfg job` answer from the config alone, without torch (2.6-3.3 s to import
here) or anything built on it. So train.py and eval.py declare their torch-side modules with `module()`,
at the top with their other imports (the dependency graph stays in plain sight), and `load_all()` imports
them where the run begins, while garbage collection still pauses for start-up (src/common/heap.py).
Everywhere else, imports are plain imports at the top of their modules.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

_deferred: list[ModuleType] = []  # declared by module(), not yet imported by load_all()


def module(name: str) -> ModuleType:
    """The module `name`, imported on first use of one of its attributes (importlib's LazyLoader)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    lazy = importlib.util.module_from_spec(spec)
    sys.modules[name] = lazy
    parent, _, child = name.rpartition(".")
    if parent:  # as an import binds it: `src.loop.trainer` is an attribute of `src.loop`
        setattr(sys.modules[parent], child, lazy)
    spec.loader.exec_module(lazy)
    _deferred.append(lazy)
    return lazy


def load_all() -> None:
    """Import every module `module()` deferred so far (an attribute read imports a lazy module)."""
    while _deferred:
        getattr(_deferred.pop(0), "__name__")
