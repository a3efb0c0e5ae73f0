"""Self-supervised learning as a fork writes it: SimCLR on images (`experiment=simclr_digits`).

Each sample is seen as two augmented views (a shift of up to `shift` pixels, a brightness and contrast jitter,
Gaussian noise), drawn per sample from (seed, step, the sample's place in the global batch): the same views on any
world size and after a resume. The model embeds both; NT-Xent (Chen et al. 2020) pulls a sample's two views
together and pushes them from every other view of the GLOBAL batch: each rank's embeddings are gathered from every
rank with gradients (`step.all_gather`), so 2 ranks of B samples train what 1 process of 2B trains. The loss is
summed over the step's views and divided by its global count of samples, as every step's. With
`trainer.grad_accum=k` the negatives are still the whole global batch, not a micro-batch's (gradient caching, Gao
et al. 2021): every micro-batch is embedded once without gradients, the loss's gradient with respect to those
embeddings is taken over the global batch, and each micro-batch is embedded again to back-propagate its share.

Evaluation, exact on any world size: the val images' kNN accuracy over the embeddings of the train split (no
augmentation; every rank embeds its share, the bank is gathered in sample order), each val image voting with its
`k` nearest train images weighted by exp(similarity / 0.1); and a val loss, NT-Xent of each val image's two views
against the bank as negatives (fixed, so a sample's loss depends on no other val sample).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from src.loop.evaluation import Evaluation
from src.loop.step import Samples, StepContext
from src.loop.task import Shapes, Task, ratio

KNN_TEMPERATURE = 0.1


class SimCLR(Task):
    """Contrastive learning of `embedding_size`-wide embeddings of the dataset's images (labels: for kNN only)."""

    metric_names = ("loss", "knn_acc")
    monitor, mode = "val/knn_acc", "max"

    def __init__(self, embedding_size: int = 32, temperature: float = 0.2, k: int = 20, shift: int = 1,
                 noise: float = 0.3, jitter: float = 0.2, **options: Any) -> None:
        super().__init__(**options)
        self.embedding_size, self.temperature, self.k = embedding_size, temperature, k
        self.shift, self.noise, self.jitter = shift, noise, jitter

    def num_outputs(self, info: Mapping[str, Any]) -> int:
        return self.embedding_size

    def train_step(self, step: StepContext) -> None:
        model = step.models[self.output_model]
        images = [self.split(batch).args[0] for batch in step.batches]
        divisor = step.divisor([batch.shape[0] for batch in images])
        cached = self.embedding_gradients(step, model, images) if len(images) > 1 else None
        for micro, batch in step.accumulate(images):
            first, second = self.embed_views(step, model, batch, micro)
            if cached is not None:  # this micro-batch's share of the global batch's loss, through its embeddings
                step.backward((first * cached[0][micro.index]).sum() + (second * cached[1][micro.index]).sum(),
                              divisor)
                continue
            # This rank's rows of the global batch's views start at rank x its micro-batch size.
            loss_sum = self.nt_xent(first, second, step.all_gather(first), step.all_gather(second),
                                    step.rank * batch.shape[0])
            step.backward(loss_sum, divisor)
            step.add_sums({"loss": loss_sum.detach(), "count": batch.shape[0]})
        step.optimizer_step(self.output_model)

    def embedding_gradients(self, step: StepContext, model: torch.nn.Module,
                            images: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The gradient of the step's NT-Xent sum with respect to each micro-batch's embeddings of its two views,
        from every micro-batch embedded without gradients. The model's buffers (BatchNorm's running statistics)
        and the random state (dropout) are left as they were, so the pass with gradients embeds alike."""
        with torch.no_grad(), torch.random.fork_rng(devices=[step.device] if step.device.type == "cuda" else []):
            buffers = [buffer.clone() for buffer in model.buffers()]
            views = [self.embed_views(step, model, batch, Samples(step.seed, step.number, step.positions(index)))
                     for index, batch in enumerate(images)]
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
        first, second = (torch.cat(embedded).requires_grad_() for embedded in zip(*views))
        loss_sum = self.nt_xent(first, second, step.all_gather(first), step.all_gather(second),
                                step.rank * first.shape[0])  # this rank's micro-batches, in order, then the next's
        loss_sum.backward()
        step.add_sums({"loss": loss_sum.detach(), "count": first.shape[0]})
        sizes = [batch.shape[0] for batch in images]
        return first.grad.split(sizes), second.grad.split(sizes)

    def embed_views(self, step: StepContext, model: torch.nn.Module, images: torch.Tensor,
                    samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings of the two augmented views of `images`."""
        with step.autocast():
            return self.embed(model, torch.cat([self.view(images, samples, "a"),
                                                self.view(images, samples, "b")])).chunk(2)

    def embed(self, model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(model(images).float(), dim=1)

    def view(self, images: torch.Tensor, samples: Samples, name: str) -> torch.Tensor:
        """One augmented view of each image, its draws keyed by the sample and the view's `name`."""
        count, size = images.shape[0], 2 * self.shift + 1
        offsets = (samples.rand(f"{name}/shift", 2) * size).long().clamp(max=size - 1)  # (N, 2): 0 .. 2 shift
        background = images.amin(dim=(1, 2, 3), keepdim=True)
        padded = F.pad(images - background, [self.shift] * 4) + background
        rows = torch.arange(images.shape[2], device=images.device) + offsets[:, :1]  # (N, H)
        columns = torch.arange(images.shape[3], device=images.device) + offsets[:, 1:]  # (N, W)
        shifted = padded[torch.arange(count, device=images.device)[:, None, None], :, rows[:, :, None],
                         columns[:, None, :]].permute(0, 3, 1, 2)  # (N, C, H, W)
        scale, bias = (1 + self.jitter * (2 * samples.rand(f"{name}/jitter", 2) - 1)).unbind(dim=1)
        noise = self.noise * samples.randn(f"{name}/noise", *images.shape[1:])
        return shifted * scale.view(-1, 1, 1, 1) + (bias - 1).view(-1, 1, 1, 1) + noise

    def nt_xent(self, first: torch.Tensor, second: torch.Tensor, all_first: torch.Tensor, all_second: torch.Tensor,
                offset: int) -> torch.Tensor:
        """NT-Xent summed over this rank's 2n anchors (both views of its n samples), each against every view of the
        global batch but itself: its other view is the positive. `offset`: where its samples sit in `all_*`."""
        count, total = first.shape[0], all_first.shape[0]
        candidates = torch.cat([all_first, all_second])  # (2N, D)
        logits = torch.cat([first, second]) @ candidates.T / self.temperature  # (2n, 2N)
        own = torch.arange(count, device=first.device) + offset
        logits = logits.masked_fill(F.one_hot(torch.cat([own, own + total]), 2 * total).bool(), float("-inf"))
        return F.cross_entropy(logits, torch.cat([own + total, own]), reduction="sum")

    def evaluate(self, val: Evaluation) -> None:
        model = val.models[self.output_model]
        embedded, labels = [], []
        for batch, _ in val.batches("train"):
            split = self.split(batch)
            with val.autocast():
                embedded.append(self.embed(model, split.args[0]))
            labels.append(split.target)
        bank, bank_labels = val.gather(torch.cat(embedded)), val.gather(torch.cat(labels))
        classes = int(bank_labels.max()) + 1 if len(bank_labels) else 1
        for batch, samples in val.batches():
            split = self.split(batch)
            images = split.args[0]
            with val.autocast():
                plain, first, second = self.embed(model, torch.cat([images, self.view(images, samples, "a"),
                                                                    self.view(images, samples, "b")])).chunk(3)
            similar, nearest = (plain @ bank.T).topk(min(self.k, len(bank)), dim=1)
            votes = torch.zeros(len(plain), classes, device=plain.device).scatter_add_(
                1, bank_labels[nearest], (similar / KNN_TEMPERATURE).exp())
            # Against the bank as negatives: each val sample's loss depends on no other val sample.
            negatives = first @ bank.T / self.temperature
            positive = (first * second).sum(dim=1, keepdim=True) / self.temperature
            loss = F.cross_entropy(torch.cat([positive, negatives], dim=1),
                                   torch.zeros(len(first), dtype=torch.long, device=first.device), reduction="sum")
            val.add_sums({"loss": loss, "count": len(plain), "correct": (votes.argmax(dim=1) == split.target).sum()})

    def val_sum_shapes(self, info: Mapping[str, Any]) -> Shapes:
        return {"correct": ()}

    def compute(self, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        knn = {"knn_acc": ratio(sums["correct"], sums["count"])} if "correct" in sums else {}
        return {"loss": ratio(sums["loss"], sums["count"]), **knn}
