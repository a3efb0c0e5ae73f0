"""Randomness per sample: every draw shaping sample i of epoch e comes from (seed, epoch, i) alone, not from the rank,
worker, batch or resume step. DataLoader datasets (`SeededSamples`) get torch's CPU, Python's and NumPy's generators
seeded from it; uint8 images on the device hash it there (`sample_key`, `draw`). Val samples use epoch VAL_EPOCH."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from src.common.seeding import seed_host_generators

VAL_EPOCH = -1  # the "epoch" val samples draw from: one fixed stream, whatever the pass
MASK32 = 0xFFFF_FFFF
_START = 0x243F_6A88  # the hash's initial state (digits of pi): nothing special about it but being fixed

Word = TypeVar("Word", int, torch.Tensor)  # a 32-bit word: a Python int, or an int64 tensor of them


def mix32(x: Word) -> Word:
    """lowbias32 (C. Wellons' hash prospector), the same arithmetic on Python ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB_352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846C_A68B)
    return x ^ (x >> 16)


def _times(x: Word, constant: int) -> Word:
    """x * constant mod 2^32 in 16-bit halves: no product exceeds 2^49, so an int64 tensor never overflows."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & MASK32


def _absorb(state: Word, *values: Word) -> Word:
    """The hash state after absorbing `values` (64-bit two's complement, 2 words each; ints, tensors or arrays)."""
    for value in values:
        for word in (value & MASK32, (value >> 32) & MASK32):
            state = mix32(state ^ word)
    return state


@functools.lru_cache(maxsize=64)
def _epoch_state(seed: int, epoch: int) -> int:
    return _absorb(_START, seed, epoch)


def sample_key(seed: int, epoch: int, index: Word) -> Word:
    """A 32-bit key of (seed, epoch, sample index) alone; `index` may be an int64 tensor, on any device."""
    return _absorb(_epoch_state(seed, epoch), index)


def draw(key: Word, number: int) -> Word:
    """The `number`-th random 32-bit word of the sample whose key is `key` (uniform, independent)."""
    return mix32(key ^ number)


def host_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for the host generators while sample `index` of `epoch` is fetched."""
    key = sample_key(seed, epoch, index)
    return (draw(key, 0) << 32) | draw(key, 1)


def host_seeds(seed: int, keys: Sequence[tuple[int, int]]) -> list[int]:
    """`host_seed` of each (epoch, index) key, hashed for the whole batch at once with NumPy."""
    states = np.fromiter((_epoch_state(seed, epoch) for epoch, _ in keys), dtype=np.int64, count=len(keys))
    key = _absorb(states, np.fromiter((index for _, index in keys), dtype=np.int64, count=len(keys)))
    return ((draw(key, 0).astype(np.uint64) << np.uint64(32)) | draw(key, 1).astype(np.uint64)).tolist()


@contextlib.contextmanager
def preserved_host_generators() -> Iterator[None]:
    """The block's draws leave torch's CPU, Python's and NumPy's global generators as they were."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


class SeededSamples(Dataset):
    """`dataset` read by (epoch, index) keys, the host generators seeded from (seed, epoch, index) for each."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        seed_host_generators(host_seed(self.seed, epoch, index))
        return self.dataset[index]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        """A batch's samples; in the main process the host generators are restored afterwards."""
        with contextlib.nullcontext() if get_worker_info() is not None else preserved_host_generators():
            samples = []
            for seed, (_, index) in zip(host_seeds(self.seed, keys), keys):
                seed_host_generators(seed)
                samples.append(self.dataset[index])
            return samples


class EpochKeys:
    """A batch sampler's index lists as (epoch, index) keys (`VAL_EPOCH` for samplers without an epoch)."""

    def __init__(self, batch_sampler: Iterable[list[int]]) -> None:
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = getattr(self.batch_sampler, "epoch", VAL_EPOCH)
        for indices in self.batch_sampler:
            yield [(epoch, index) for index in indices]


# -- randomness a training step or an evaluation draws per sample ------------------------------------------------

STEP_DRAWS = 0x57E9  # the domain of a step's draws, apart from every (seed, epoch) of the data path's


@functools.lru_cache(maxsize=256)
def _stream_state(seed: int, step: int, stream: str) -> int:
    """The hash state after absorbing the run's seed, the step (VAL_EPOCH: an evaluation) and the stream's name."""
    name = int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")
    return _absorb(_epoch_state(seed, STEP_DRAWS), step, name)


def uniform_per_sample(seed: int, step: int, stream: str, positions: torch.Tensor, shape: Sequence[int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform draws in (0, 1), `(len(positions), *shape)` on `positions`' device, row i from (seed, step, stream,
    positions[i]) alone, with no host sync; word j of a row is `draw(key, j)`."""
    keys = _absorb(_stream_state(seed, step, stream), positions.to(torch.int64))
    words = draw(keys[:, None], torch.arange(math.prod(shape), device=positions.device, dtype=torch.int64)[None, :])
    return ((words.double() + 0.5) / 2.0**32).to(dtype).view(len(positions), *shape)


def normal_per_sample(seed: int, step: int, stream: str, positions: torch.Tensor, shape: Sequence[int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws, as `uniform_per_sample` keys them (Box-Muller of two uniform words per value)."""
    uniform = uniform_per_sample(seed, step, stream, positions, (2, math.prod(shape)), torch.float64)
    radius = torch.sqrt(-2.0 * torch.log(uniform[:, 0]))
    return (radius * torch.cos(2 * math.pi * uniform[:, 1])).to(dtype).view(len(positions), *shape)
