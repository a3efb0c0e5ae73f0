"""What a checkpoint holds, whatever its format: named parts (src/loop/trainer.py `stateful`: models, optimizers,
schedulers, scaler, loop, callbacks, config, output_model), each saved as its state_dict() (plain data as itself),
with tensors anywhere in it, sharded or not. A `Checkpoint` read back restores them into this run's parts by name."""

from __future__ import annotations

import copy
import functools
import logging
import operator
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from src.common.errors import UsageError
from src.parallel import distributed

log = logging.getLogger(__name__)

FORMAT = "ddp-template-checkpoint/3"


def state_of(part: Any) -> Any:
    """What a part saves: its state_dict(), or itself if it is plain data (the config)."""
    return part.state_dict() if hasattr(part, "state_dict") else part


def read_payload(path: Path) -> dict[str, Any]:
    """The checkpoint in the `.pt` file `path` (`weights_only=True`: never runs code), or one line saying why not."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        reason = type(error).__name__
        raise UsageError(f"checkpoint {path} cannot be read ({reason}): is it a complete .pt file?") from None
    found = payload.get("format") if isinstance(payload, dict) else None
    if found == FORMAT:
        return payload
    if isinstance(found, str) and found.startswith("ddp-template-checkpoint/"):
        raise UsageError(f"{path} is a checkpoint of another version of this template ({found}, this one reads "
                         f"{FORMAT}): use that version, or train again")
    raise UsageError(f"{path} is not a checkpoint of this template (no format={FORMAT!r} in it)")


class Checkpoint:
    """A checkpoint read from disk: `state` holds every part (a sharded one's tensors are read when restored)."""

    def __init__(self, path: Path, state: dict[str, Any]) -> None:
        self.path, self.state = path, state
        self.config: Any = state.get("config")  # the run's resolved config
        self.loop: Mapping[str, Any] = state.get("loop", {})  # the TrainState
        self.output_model: str = state.get("output_model", "model")
        self.model_names = list(state.get("models", {}))

    def restore(self, parts: Mapping[str, Any]) -> None:
        """Load each of `parts` from the part of the same name (not plain data; a part it lacks starts afresh)."""
        for name, part in parts.items():
            if not hasattr(part, "load_state_dict"):
                continue
            for named in (part, *getattr(part, "parts", {}).values()):
                if hasattr(named, "source"):
                    named.source = f"checkpoint {self.path}"  # what its errors name
            if name in self.state:
                self.restore_part(name, part)
            else:
                log.info("%s holds no %s state: it starts afresh", self.path, name)

    def restore_part(self, name: str, part: Any) -> None:
        part.load_state_dict(self.state[name])

    def whole(self, *keys: str) -> Any:
        """The state at `keys` (e.g. "models", "generator"), its tensors whole on the CPU, read in this process."""
        return functools.reduce(operator.getitem, keys, self.state)  # a .pt file's are so already

    def model_weights(self, name: str | None = None, weights: str = "model") -> dict[str, torch.Tensor]:
        """Model `name`'s tensors (default: the output model), whole on the CPU; `weights="ema"`: its EMA weights."""
        name = name or self.output_model
        if name not in self.model_names:
            raise UsageError(f"{self.path} holds no model {name!r}; it holds {', '.join(self.model_names)}")
        tensors = dict(self.whole("models", name))
        if not self.has_weights(weights, name):  # weights="model": always
            raise UsageError(f"{self.path} holds no {weights} weights of model {name!r} (its run had "
                             f"callbacks.{weights}.decay=null or averaged another model): evaluate weights=model")
        return tensors if weights == "model" else {**tensors, **self.whole("callbacks", weights, "weights")}

    def has_weights(self, weights: str, name: str | None = None) -> bool:
        if weights == "model":
            return True
        averaged = self.state.get("callbacks", {}).get(weights, {})
        return "weights" in averaged and averaged.get("model", name or self.output_model) == (name or self.output_model)


class Store:
    """Where a run writes its checkpoints, in one format; called on every rank alike. With `background`, `save` waits
    only for a host copy and writes it in a thread (collectives on a group of their own), one save in flight: the
    next `save` and `wait` wait for it, raising its failure on every rank. Every write is atomic."""

    def __init__(self, directory: Path, is_main_process: bool, keep_last: int = 2, background: bool = False,
                 timeout_s: float | None = None) -> None:
        self.directory, self.is_main_process, self.background = directory, is_main_process, background
        self.keep_last = keep_last  # step checkpoints kept, besides the newest and the best
        self.group = distributed.new_group(timeout_s) if background else None  # the writer's collectives' wait
        self._in_flight: _Writer | None = None
        self._host_copy: Any = None  # the last background save's copy, written: the next one copies into it

    def save(self, parts: Mapping[str, Any], step: int, is_best: bool, mid_epoch: bool = False) -> None:
        """Save `parts` as the newest checkpoint (the best too if `is_best`; a step checkpoint if `mid_epoch`)."""
        self.wait()
        snapshot = self.snapshot(parts)
        if not self.background:
            self.write(snapshot, step, is_best, mid_epoch)
            return
        # The training thread's last wait: it may change the parts from here on.
        snapshot = self._host_copy = on_host(snapshot, reuse=self._host_copy)
        self._in_flight = _Writer(lambda: self.write(snapshot, step, is_best, mid_epoch), self.group)

    def wait(self) -> None:
        """Until the save in flight (if any) is written; its failure raised here, on every rank."""
        writer, self._in_flight = self._in_flight, None
        if writer is not None:
            writer.join()

    def wait_after_failure(self) -> None:
        """After training failed: until the save in flight has ended (its own failure only logged)."""
        writer, self._in_flight = self._in_flight, None
        if writer is not None:
            writer.thread.join()
            if writer.failure is not None:
                log.warning("the checkpoint being written when training failed was not written: %s: %s",
                            type(writer.failure).__name__, writer.failure)

    def snapshot(self, parts: Mapping[str, Any]) -> Any:
        """What `write` writes of `parts`: their states (live tensors)."""
        return {"format": FORMAT, **{name: state_of(part) for name, part in parts.items()}}

    def write(self, snapshot: Any, step: int, is_best: bool, mid_epoch: bool) -> None:
        raise NotImplementedError


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
    """A copy of `state` on the CPU (a DTensor's local shard), each tensor into the one at its place in `reuse` (an
    earlier copy, no longer in use) where shape, stride and dtype agree."""
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
