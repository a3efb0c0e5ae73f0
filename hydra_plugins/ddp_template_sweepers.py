"""The template's Hydra sweepers, under the name Hydra looks for.

Hydra instantiates a sweeper only from a class defined in the `hydra_plugins` namespace package (its
plugin scan imports every module here at each start, so this one imports no torch and no Optuna). The
code lives in src/sweeps/; conf/hydra/sweeper/ names these classes.
"""

from src.sweeps import grid, optuna_sweeper


class GridSweeper(grid.ResumableGridSweeper):
    """`-m` with the default `hydra/sweeper=grid`: Hydra's grid, resumable (src/sweeps/grid.py)."""


class OptunaSweeper(optuna_sweeper.OptunaSweeper):
    """`hydra/sweeper=optuna`: an Optuna study in <sweep dir>/optuna.db (src/sweeps/optuna_sweeper.py)."""
