"""src/loop/precision.py: the autocast dtype of each `trainer.precision` value."""

import pytest
import torch

from src.common.errors import UsageError
from src.loop.precision import autocast_dtype


def test_precision_names():
    assert autocast_dtype(32) is None and autocast_dtype("32") is None
    assert autocast_dtype("bf16") is torch.bfloat16 and autocast_dtype(16) is torch.float16
    with pytest.raises(UsageError, match="trainer.precision=8 is not one of 32, bf16, 16"):
        autocast_dtype(8)
