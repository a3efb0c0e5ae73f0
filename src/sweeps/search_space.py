"""A sweep's command line as an Optuna search space, in the grammar of Hydra's Optuna plugin (`GRAMMAR`); a plain
`key=value` goes to every trial."""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep

from src.common.errors import UsageError
from src.config.hydra_errors import SWEEP_GRAMMAR as GRAMMAR
from src.parallel.job import quote_override


def split(overrides: list[Override]) -> tuple[dict[str, Any], list[str]]:
    """The swept keys with their Optuna distributions, and the fixed overrides every trial gets."""
    space = {o.get_key_element(): distribution(o) for o in overrides if o.is_sweep_override()}
    return space, [o.input_line or f"{o.get_key_element()}={o.value()}" for o in overrides if not o.is_sweep_override()]


def distribution(override: Override) -> Any:
    """The Optuna distribution an override's sweep stands for, or one error line naming the grammar."""
    import optuna.distributions as dist  # an optional package

    value, key = override.value(), override.get_key_element()
    tags = set(getattr(value, "tags", set()))
    if tags - {"log"} or (tags and not isinstance(value, IntervalSweep)):
        raise UsageError(f"{override.input_line}: the only tag a search space takes is log, on an interval: "
                         f"tag(log,interval(low,high))")
    if isinstance(value, ChoiceSweep) and not value.shuffle:
        return dist.CategoricalDistribution(value.list)
    if isinstance(value, RangeSweep) and not value.shuffle:
        values = list(override.sweep_iterator())
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            return dist.IntDistribution(values[0], values[-1], step=int(value.step))
        return dist.FloatDistribution(values[0], values[-1], step=value.step)
    if isinstance(value, IntervalSweep):
        if "log" in tags and value.start <= 0:
            raise UsageError(f"{override.input_line}: a log interval needs low > 0")
        return dist.FloatDistribution(value.start, value.end, log="log" in tags)
    raise UsageError(f"{override.input_line}: {key} names no distribution Optuna can sample; write {GRAMMAR}")


def override_value(value: Any) -> str:
    """A sampled value as Hydra's grammar reads it back (a float keeps every digit)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str) and any(c in value for c in " ,()[]{}'\"=\\"):
        return quote_override(value)
    return "null" if value is None else str(value)
