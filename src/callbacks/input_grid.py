"""A grid of the first training inputs as the model receives them, in TensorBoard (`inputs/train_batch`), once at
the start of a run; only for image datasets (`image_size` in their info) whose first model input is C x H x W."""

from __future__ import annotations

import torch

from src.config.building import check_arguments
from src.config.schema import at_least
from src.loop.callback import Callback, Run
from src.reports.images import image_grid


class InputGrid(Callback):
    def __init__(self, count: int) -> None:
        check_arguments(count=(count, at_least(1)))
        self.count = count

    def on_run_start(self, run: Run) -> None:
        data, task = run.parts.data, run.parts.task
        if not run.parts.reporter.shows_images or "image_size" not in data.splits.info:
            return
        indices = next(iter(data.train_sampler))[: self.count]  # the sampler's first step, not yet started
        samples = [task.split(data.splits.train[index]) for index in indices]
        inputs = [args[0] if args else next(iter(kwargs.values()), None) for args, kwargs, _ in samples]
        if all(isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] in (1, 3) for x in inputs):
            run.parts.reporter.image("inputs/train_batch", image_grid(torch.stack(inputs)), step=0)
