"""What a checkpoint holds, whatever its format: named parts, each saved as its own state.

A run hands its store the parts that make it resumable, by name:

    model        the module's weights: the unwrapped module's state_dict (no `module.` or `_orig_mod.`
                 prefixes), or its shards under dist=fsdp
    optimizer    its state (position-keyed in a .pt file, by parameter name in shards)
    scheduler, scaler   their state_dicts
    loop         where the loop stands: epoch, step, history, the unfinished epoch's metric sums, the best
                 monitored value, and `stopped` (reason, epoch) once a callback ended the run
    callbacks    each callback's state under its name, e.g. callbacks.ema.weights (src/loop/callback.py)
    config       the run's resolved config (plain data: read back by eval.py, never restored)

and a `Checkpoint` read back restores them into this run's parts by the same names. Two formats implement
this: one `.pt` file per checkpoint (src/checkpoint/file_store.py, dist=ddp) and a directory of shards per
checkpoint (src/checkpoint/sharded_store.py, dist=fsdp); src/checkpoint/__init__.py picks one by the
strategy for writing and by the path for reading, so a run resumes either. No caller knows which.

Checkpoints written before the parts were named (format 1: the loop's fields, `ema`, `early_stopped_at` and
`pruned_at` at the top level) are read into this layout by `upgrade`, so they resume bitwise.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.checkpoint import layout
from src.common.errors import UsageError
from src.parallel import distributed, fsdp

log = logging.getLogger(__name__)

FORMAT = "ddp-template-checkpoint/2"
FORMAT_1 = "ddp-template-checkpoint/1"  # top-level loop fields; read through `upgrade`
MODEL, OPTIMIZER, CONFIG = "model", "optimizer", "config"


def state_of(part: Any) -> Any:
    """What a part saves: its state_dict(), or itself if it is plain data (the config)."""
    return part.state_dict() if hasattr(part, "state_dict") else part


# -- format 1 ------------------------------------------------------------------------------------------------

_LOOP_KEYS = ("epoch", "step", "best", "train_samples", "train_seconds", "history", "step_in_epoch",
              "epoch_totals")
# The words of the add-ons that could end a format-1 run, as their callbacks say them now.
_FORMAT_1_STOPS = {"early_stopped_at": ("early_stopped", "early stopping had ended this run"),
                   "pruned_at": ("pruned", "the sweep's pruner had ended this trial")}


def upgrade(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's payload in this format's layout, whichever format wrote it."""
    if payload.get("format") == FORMAT:
        return dict(payload)
    loop = {key: payload[key] for key in _LOOP_KEYS if key in payload}
    loop["epoch_totals"] = _named_totals(payload.get("epoch_totals"))
    loop["stopped"] = next(({"reason": reason, "epoch": payload[key], "ended_by": ended_by}
                            for key, (reason, ended_by) in _FORMAT_1_STOPS.items()
                            if payload.get(key) is not None), None)
    callbacks = {}
    if "ema" in payload:
        callbacks["ema"] = {"weights": payload["ema"], "best_weights": payload.get("best_weights", "model")}
    parts = {key: payload[key] for key in (MODEL, OPTIMIZER, "scheduler", "scaler", CONFIG) if key in payload}
    return {"format": FORMAT, **parts, "loop": loop, "callbacks": callbacks}


def _named_totals(saved: Any) -> dict[str, list[float]] | None:
    """Epoch sums saved by name; a checkpoint of a version that kept them as (loss, correct, count)
    is read as classification's sums."""
    if isinstance(saved, (list, tuple)):
        loss, correct, count = saved[:3]
        return {"loss": [loss], "count": [count], "correct": [correct]}
    return saved


def check_format(payload: Any, path: Path) -> dict[str, Any]:
    """`payload` in this format's layout, or one line saying it is no checkpoint of this template."""
    if not isinstance(payload, dict) or payload.get("format") not in (FORMAT, FORMAT_1):
        raise UsageError(f"{path} is not a checkpoint of this template (no format={FORMAT!r} in it)")
    return upgrade(payload)


# -- reading -------------------------------------------------------------------------------------------------


class Checkpoint:
    """A checkpoint read from disk: `state` holds every part but the model's and optimizer's tensors, which
    the format reads straight into this run's (prepared: wrapped or sharded) module and optimizer."""

    def __init__(self, path: Path, state: dict[str, Any]) -> None:
        self.path = path
        self.state = state

    @property
    def config(self) -> Any:
        return self.state.get(CONFIG)

    @property
    def loop(self) -> Mapping[str, Any]:
        return self.state.get("loop", {})

    def restore(self, parts: Mapping[str, Any]) -> None:
        """Load each of `parts` (this run's model, optimizer, scheduler, ... by name; see the module's docstring)
        from the part of the same name. The model comes before the optimizer; plain data is not restored."""
        for name, part in parts.items():
            if name == MODEL:
                self.load_model(part)
            elif name == OPTIMIZER:
                self.load_optimizer(parts[MODEL], part)
            elif not hasattr(part, "load_state_dict"):
                continue
            elif name in self.state:
                part.load_state_dict(self.state[name])
            else:
                log.info("%s holds no %s state: it starts afresh", self.path, name)

    def load_model(self, module: nn.Module, weights: str = MODEL) -> None:
        """The checkpoint's model weights into `module` (plain, or sharded), or those a callback saved as
        `weights` (`ema`: its state's `weights`)."""
        if weights == MODEL:
            self._load_model(module)
        else:
            self.load_whole_state(module, self.state["callbacks"][weights]["weights"])

    def has_weights(self, weights: str) -> bool:
        return weights == MODEL or "weights" in self.state.get("callbacks", {}).get(weights, {})

    def load_whole_state(self, module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """A whole state_dict into `module`, naming the file when keys or shapes differ."""
        if fsdp.is_sharded(module):
            fsdp.load_full_model_state(module, state)
            return
        try:
            module.load_state_dict(state)
        except RuntimeError as error:
            # torch names every mismatched key, one kind of problem per line: a few of each say enough.
            problems = [_first_keys(line.strip().rstrip(". ")) for line in str(error).strip().splitlines()[1:]]
            more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
            raise UsageError(
                f"checkpoint {self.path} does not fit this model ({'; '.join(problems[:2])}{more}); "
                "use the model and dataset configs it was saved with"
            ) from None

    def _load_model(self, module: nn.Module) -> None:
        raise NotImplementedError

    def load_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def model_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors on the CPU, by the plain module's names, with no model built."""
        raise NotImplementedError


def _first_keys(problem: str, shown: int = 3) -> str:
    """`Unexpected key(s) in state_dict: "a", "b", ...` cut to its first `shown` keys."""
    keys = re.findall(r'"([^"]+)"', problem)
    if len(keys) <= shown:
        return problem
    return f"{problem.split(':')[0]}: {', '.join(keys[:shown])} and {len(keys) - shown} more"


# -- writing -------------------------------------------------------------------------------------------------


class Store:
    """Where a run writes its checkpoints (`directory`, its run dir's checkpoints/), in one format. Called on
    every rank at the same points; a failed write stops every rank with one line.

    With `background` (trainer.async_checkpoint), `save` waits only for a copy of the state in host memory and
    writes it in a thread, while training goes on; its collectives run on a group of their own
    (src/parallel/distributed.py `new_group`). At most one save is in flight: the next `save`, and `wait` (the
    end of the run, preemption included), wait for it, and raise its failure on every rank. A write is as
    atomic as a synchronous one: a process killed during it leaves the previous checkpoint the newest.
    """

    def __init__(self, directory: Path, is_main_process: bool, keep_last: int = 2, background: bool = False,
                 timeout_s: float | None = None) -> None:
        self.directory = directory
        self.is_main_process = is_main_process
        self.keep_last = keep_last  # step checkpoints kept, besides the newest and the best
        self.group = distributed.new_group(timeout_s) if background else None  # the writer's collectives' wait
        self.background = background
        self._in_flight: _Writer | None = None
        self._host_copy: Any = None  # the last background save's copy, written: the next one copies into it

    def save(self, parts: Mapping[str, Any], step: int, is_best: bool, mid_epoch: bool = False) -> None:
        """Save `parts` (by name, as `Checkpoint.restore` takes them) as the newest checkpoint, also the best if
        `is_best`; a `mid_epoch` one is kept as a step checkpoint too (the newest `keep_last` of them)."""
        self.wait()
        snapshot = self.snapshot(parts)
        if not self.background:
            self.write(snapshot, step, is_best, mid_epoch)
            return
        # The training thread's last wait: it may change the parts from here on. Into the previous save's copy
        # where the shapes allow: writing into memory already mapped costs about half of a fresh allocation.
        snapshot = self._host_copy = on_host(snapshot, reuse=self._host_copy)
        self._in_flight = _Writer(lambda: self.write(snapshot, step, is_best, mid_epoch), self.group)

    def wait(self) -> None:
        """Until the save in flight (if any) is written; its failure raised here, on every rank."""
        writer, self._in_flight = self._in_flight, None
        if writer is not None:
            writer.join()

    def wait_after_failure(self) -> None:
        """After training failed for another reason: until the save in flight (if any) has ended, so the process
        group its collectives run on is not torn down under it (they wait at most dist.step_timeout_s for a
        rank that is gone); its own failure is only logged, the training's error is the run's."""
        writer, self._in_flight = self._in_flight, None
        if writer is not None:
            writer.thread.join()
            if writer.failure is not None:
                log.warning("the checkpoint being written when training failed was not written: %s: %s",
                            type(writer.failure).__name__, writer.failure)

    def snapshot(self, parts: Mapping[str, Any]) -> Any:
        """What `write` writes of `parts`: their states (live tensors, copied by `save` when it writes later)."""
        raise NotImplementedError

    def write(self, snapshot: Any, step: int, is_best: bool, mid_epoch: bool) -> None:
        raise NotImplementedError

    def latest(self) -> Path | None:
        return layout.latest(self.directory)

    def newest_first(self) -> list[Path]:
        return layout.newest_first(self.directory)


class _Writer:
    """`work` in a thread of its own, its collectives on `group`; `join` raises what it raised."""

    def __init__(self, work: Callable[[], None], group: Any) -> None:
        self.failure: BaseException | None = None
        self.work, self.group = work, group
        # A daemon: a run that fails elsewhere exits without it (the previous checkpoint stays the newest).
        self.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with distributed.collectives_on(self.group):
                self.work()
        except BaseException as error:  # noqa: BLE001 - raised again on the training thread by join()
            self.failure = error

    def join(self) -> None:
        self.thread.join()
        if self.failure is not None:
            raise self.failure


def on_host(state: Any, reuse: Any = None) -> Any:
    """A copy of `state` the training thread no longer touches: tensors copied to the CPU (a DTensor keeps its
    sharding, with its local shard copied), containers and plain values copied. A tensor goes into the CPU
    tensor at its place in `reuse` (an earlier copy of the same structure, no longer in use) when their
    shape, stride and dtype agree, and into new memory otherwise."""
    if isinstance(state, torch.Tensor):
        if hasattr(state, "to_local"):  # a DTensor
            local = _host_tensor(state.to_local(), reuse.to_local() if hasattr(reuse, "to_local") else None)
            return type(state).from_local(local, state.device_mesh, state.placements, run_check=False,
                                          shape=state.shape, stride=state.stride())
        return _host_tensor(state, reuse)
    if isinstance(state, dict):
        earlier = reuse if isinstance(reuse, dict) else {}
        return type(state)((key, on_host(value, earlier.get(key))) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        earlier = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(state) else [None] * len(state)
        values = [on_host(value, old) for value, old in zip(state, earlier)]
        return type(state)(*values) if hasattr(state, "_fields") else type(state)(values)
    return copy.deepcopy(state)


def _host_tensor(tensor: torch.Tensor, reuse: Any) -> torch.Tensor:
    tensor = tensor.detach()
    if (type(reuse) is torch.Tensor and reuse.device.type == "cpu" and reuse.dtype == tensor.dtype
            and reuse.shape == tensor.shape and reuse.stride() == tensor.stride()):
        return reuse.copy_(tensor)
    return tensor.to("cpu", copy=True)
