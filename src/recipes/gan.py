"""A GAN as a fork writes one: two models, two optimizers, alternating updates, in one task (`experiment=gan_digits`).

The generator maps latent noise to images, the discriminator tells real images from generated ones. Each training
step updates the discriminator on a real and a generated batch, then the generator through the discriminator (the
non-saturating loss): two `step.optimizer_step` calls of the primitives in src/loop/step.py. The latent noise is
drawn per sample (`micro.randn`), so 1 process and N ranks at the same global batch draw the same noise, and a
resumed run the noise the uninterrupted one drew.

Evaluation: the discriminator's accuracy on the val split's real images and on as many generated ones, and, with an
auxiliary `judge` classifier (a digits_cnn checkpoint: `aux.judge.path=...`), the mean top-class confidence it
gives `judged` generated samples and as many images of uniform noise: a number for quality (a sharp digit gets a
confident class, noise does not). Every epoch a grid of samples lands in TensorBoard (val/samples).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from src.loop.evaluation import Evaluation
from src.loop.step import StepContext
from src.loop.task import Shapes, Task, ratio


class GAN(Task):
    """Generator and discriminator over the dataset's images (their labels unused); `latent_size`: the generator's
    input width; `judged`: generated samples the judge scores at each evaluation."""

    models = ("generator", "discriminator")
    output_model = "generator"
    metric_names = ("loss", "d_loss", "g_loss", "d_real_acc", "d_fake_acc", "judge_confidence", "noise_confidence")
    monitor = None  # nothing means "better" without a judge; the preset monitors val/judge_confidence

    def __init__(self, latent_size: int = 16, judged: int = 500, **options: Any) -> None:
        super().__init__(**options)
        self.latent_size, self.judged = latent_size, judged

    def num_outputs(self, info: Mapping[str, Any]) -> int:
        return 1  # the discriminator's: one logit, real or generated

    def generate(self, generator: torch.nn.Module, latent: torch.Tensor, like: torch.Size) -> torch.Tensor:
        return generator(latent).view(-1, *like[1:])  # (N, features) as images

    def train_step(self, step: StepContext) -> None:
        generator, discriminator = step.models["generator"], step.models["discriminator"]
        real = [self.split(batch).args[0] for batch in step.batches]
        divisor = step.divisor([images.shape[0] for images in real])
        for micro, images in step.accumulate(real, ["discriminator"]):
            with torch.no_grad(), step.autocast():
                fake = self.generate(generator, micro.randn("latent", self.latent_size), images.shape)
            with step.autocast():
                real_logits, fake_logits = discriminator(torch.cat([images, fake])).float().chunk(2)
            d_loss = _bce(real_logits, 1.0) + _bce(fake_logits, 0.0)
            step.backward(d_loss, divisor)
            step.add_sums({"loss": d_loss.detach(), "d_loss": d_loss.detach(), "count": images.shape[0],
                           "d_real": (real_logits > 0).sum(), "d_fake": (fake_logits < 0).sum()})
        step.optimizer_step("discriminator")
        for micro, images in step.accumulate(real):  # the generator's gradient goes through the discriminator
            with step.autocast():
                logits = discriminator(self.generate(generator, micro.randn("latent_g", self.latent_size),
                                                     images.shape)).float()
            g_loss = _bce(logits, 1.0)  # non-saturating: the generator maximises log D(G(z))
            step.backward(g_loss, divisor)
            step.add_sums({"loss": g_loss.detach(), "g_loss": g_loss.detach()})
        step.optimizer_step("generator")

    def evaluate(self, val: Evaluation) -> None:
        generator, discriminator = val.models["generator"], val.models["discriminator"]
        shape = None
        for index, (batch, samples) in enumerate(val.batches()):
            images = self.split(batch).args[0]
            shape = images.shape
            with val.autocast():
                fake = self.generate(generator, samples.randn("latent", self.latent_size), images.shape)
                real_logits, fake_logits = discriminator(torch.cat([images, fake])).float().chunk(2)
            d_loss, g_loss = _bce(real_logits, 1.0) + _bce(fake_logits, 0.0), _bce(fake_logits, 1.0)
            val.add_sums({"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss, "count": images.shape[0],
                          "d_real": (real_logits > 0).sum(), "d_fake": (fake_logits < 0).sum()})
            if index == 0:
                val.image("samples", fake[:64])
        if "judge" in self.aux and shape is not None:
            self._judge(val, generator, shape, low=float(images.min()), high=float(images.max()))

    def _judge(self, val: Evaluation, generator: torch.nn.Module, shape: torch.Size, low: float, high: float) -> None:
        """The judge's mean top-class confidence on `judged` generated samples, and on as many images of uniform
        noise over the pixel range [low, high] (every rank's own val images' range: the same within a dataset)."""
        for samples in val.generated(self.judged, 256):
            noise = low + (high - low) * samples.rand("noise", *shape[1:])
            with val.autocast():
                fake = self.generate(generator, samples.randn("judged", self.latent_size), shape)
                judged = self.aux["judge"](torch.cat([fake, noise])).float().softmax(dim=1).amax(dim=1)
            on_fake, on_noise = judged.chunk(2)
            val.add_sums({"judged": len(samples.positions), "judge": on_fake.sum(), "noise_judge": on_noise.sum()})

    def sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {name: () for name in ("d_loss", "g_loss", "d_real", "d_fake")}

    def val_sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {name: () for name in ("judged", "judge", "noise_judge")}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        metrics = {name: ratio(sums[key], sums["count"]) for name, key in (
            ("loss", "loss"), ("d_loss", "d_loss"), ("g_loss", "g_loss"), ("d_real_acc", "d_real"),
            ("d_fake_acc", "d_fake"))}
        if "judged" in sums and float(sums["judged"]) > 0:
            metrics.update(judge_confidence=ratio(sums["judge"], sums["judged"]),
                           noise_confidence=ratio(sums["noise_judge"], sums["judged"]))
        return metrics


def _bce(logits: torch.Tensor, label: float) -> torch.Tensor:
    """Binary cross-entropy of every logit against one label, summed."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, label), reduction="sum")
