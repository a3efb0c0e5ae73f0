"""Knowledge distillation as a fork writes it: a student learns from a frozen teacher (`experiment=distill_digits`).

The teacher is an auxiliary model (`aux.teacher.path`: a checkpoint of this template, e.g. a digits_cnn run's
best.pt): on the run's device, in eval mode, never trained, never wrapped by DDP or FSDP, never saved in the
run's checkpoints. The task is classification whose training loss sees the whole batch (`train_loss`): the
student's cross-entropy with the labels, and the KL divergence from the teacher's softened distribution at a
temperature T (Hinton et al. 2015), scaled by T^2 so its gradient keeps its size as T changes:

    loss = (1 - alpha) x CE(student, label) + alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T))

summed over the batch's samples like every task's loss, so the step divides by the global count and stays exact
on any world size. Evaluation is classification's: the student's own val loss and accuracy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from src.components.tasks import Classification
from src.loop.task import Batch


class Distillation(Classification):
    """Classification with a teacher's soft targets in the training loss."""

    aux_models = ("teacher",)

    def __init__(self, temperature: float = 2.0, alpha: float = 0.5, **options: Any) -> None:
        super().__init__(**options)
        self.temperature, self.alpha = temperature, alpha

    def train_loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            teacher = self.aux["teacher"](*batch.args, **batch.kwargs).float()
        hard = self.loss(outputs, batch.target)
        t = self.temperature
        soft = F.kl_div(F.log_softmax(outputs.float() / t, dim=1), F.log_softmax(teacher / t, dim=1),
                        log_target=True, reduction="sum") * t * t
        return (1 - self.alpha) * hard + self.alpha * soft
