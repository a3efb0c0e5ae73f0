"""src/loop/performance.py: the autocast dtype of each `trainer.precision` value the schema allows."""

import torch

from src.config import schema
from src.loop.performance import PRECISIONS, autocast_dtype


def test_precision_names():
    assert autocast_dtype(32) is None and autocast_dtype("32") is None
    assert autocast_dtype("bf16") is torch.bfloat16 and autocast_dtype(16) is torch.float16


def test_every_allowed_precision_has_a_dtype():
    assert tuple(PRECISIONS) == schema.PRECISIONS
