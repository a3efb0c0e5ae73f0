"""Datasets larger than RAM, imported by `dataset=arrow` alone: `datasets`' `save_to_disk` layout, memory-mapped
and read by index.

    DIR/dataset_dict.json                   {"splits": ["train", "validation"]}
    DIR/<split>/data-00000-of-00003.arrow   Arrow IPC streams holding the split's rows, in order
    DIR/<split>/state.json                  the shard files, in order ("_data_files")
    DIR/<split>/dataset_info.json           the columns' features: Image, ClassLabel (its class names), Value"""

from __future__ import annotations

import bisect
import io
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from PIL import Image
from torch.utils.data import Dataset

from src.common.errors import UsageError
from src.data.splits import DatasetNotFoundError, UnreadableSampleError

IMAGE = "Image"  # the `_type` of an image feature: struct<bytes: binary, path: string>, encoded bytes


class ArrowSplit:
    """One split's rows across its shards, memory-mapped and read by index."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        state = _read_json(folder / "state.json", f"{folder} is not a split saved by save_to_disk")
        self.files = [folder / entry["filename"] for entry in state["_data_files"]]
        if missing := [file.name for file in self.files if not file.is_file()]:
            raise DatasetNotFoundError(f"{folder}: shard {', '.join(missing)} is missing ({len(self.files)} "
                                       "listed in its state.json); copy the whole dataset again")
        info = _read_json(folder / "dataset_info.json", f"{folder} has no dataset_info.json")
        self.features: dict[str, Any] = info.get("features") or {}
        self._opened_in: int | None = None
        self.schema = schema = self._open()
        self.columns: list[str] = schema.names
        self.image_columns = {name for name in self.columns if _is_image(self.features.get(name), schema.field(name))}
        self.vector_columns = {name for name in self.columns if _is_numeric_list(schema.field(name).type)}

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_batches": [], "_opened_in": None}  # a spawned worker maps the files anew

    def _open(self) -> Any:
        """Memory-map every shard's record batches in this process (once); returns the split's schema."""
        if self._opened_in == os.getpid():
            return self._schema
        self._batches, self.offsets, self._batch_file, self._file_start = [], [0], [], []
        for file_index, file in enumerate(self.files):
            try:
                stream = pa.ipc.open_stream(pa.memory_map(str(file)))
                batches = list(stream)
            except (pa.ArrowInvalid, OSError) as error:
                raise DatasetNotFoundError(f"{file} is not a readable Arrow stream ({_one_line(error)}); "
                                           "copy or convert the dataset again") from error
            if file_index == 0:
                self._schema = stream.schema
            elif not stream.schema.equals(self._schema):
                raise DatasetNotFoundError(f"{file} holds other columns than {self.files[0].name}: {stream.schema}")
            self._file_start.append(self.offsets[-1])
            for batch in batches:
                self._batches.append(batch)
                self._batch_file.append(file_index)
                self.offsets.append(self.offsets[-1] + batch.num_rows)
        self._opened_in = os.getpid()
        return self._schema

    def record_batches(self) -> list[Any]:
        self._open()
        return self._batches

    def values(self, index: int, columns: Sequence[str]) -> tuple[list[Any], str]:
        """Row `index`'s values of `columns` (images as encoded bytes), and where it is, for error messages."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a split of {len(self)} rows")
        self._open()
        position = bisect.bisect_right(self.offsets, index) - 1
        batch, row, file_index = self._batches[position], index - self.offsets[position], self._batch_file[position]
        where = f"{self.files[file_index].name} row {index - self._file_start[file_index]}"
        try:
            return [_value(batch.column(name), row, name in self.image_columns) for name in columns], where
        except Exception as error:  # an unreadable value: name it, whatever pyarrow raised
            raise UnreadableSampleError(f"corrupt record {index} of {self.folder} ({where}): {_one_line(error)}") \
                from error


def _is_image(feature: dict[str, Any] | None, field: Any) -> bool:
    """An Image feature; without features, a struct of `bytes` and `path` (what an Image is stored as)."""
    if feature is not None:
        return feature.get("_type") == IMAGE
    return pa.types.is_struct(field.type) and sorted(f.name for f in field.type) == ["bytes", "path"]


def _is_numeric_list(arrow_type: Any) -> bool:
    """A list (of lists ...) of numbers: a feature vector (or array), given to the model as one tensor."""
    nested = False
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        arrow_type, nested = arrow_type.value_type, True
    return nested and (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type))


def _value(column: Any, row: int, is_image: bool) -> Any:
    """One cell: an image's encoded bytes (read from its path where it has none), else the Python value."""
    if not is_image:
        return column[row].as_py()
    if (encoded := column.field("bytes")[row].as_py()) is None:
        if (path := column.field("path")[row].as_py()) is None:
            raise ValueError("the image holds neither bytes nor a path")
        return Path(path).read_bytes()
    return encoded


class ArrowSamples(Dataset):
    """The rows of a split as tuples of `columns`' values, images decoded and passed through `image_transform`."""

    def __init__(self, split: ArrowSplit, columns: Sequence[str], image_transform: Callable[[Any], Any] | None) -> None:
        self.split, self.columns, self.image_transform = split, list(columns), image_transform
        self.images = split.image_columns & set(columns)

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        values, where = self.split.values(index, self.columns)
        sample = []
        for name, value in zip(self.columns, values):
            if name in self.images:
                try:  # in RGB, as torchvision's ImageFolder decodes a file (so both give the same pixels)
                    with Image.open(io.BytesIO(value)) as image:
                        value = image.convert("RGB")
                except Exception as error:  # PIL raises several kinds for damaged bytes
                    raise UnreadableSampleError(f"corrupt record {index} of {self.split.folder} ({where}): cannot "
                                             f"decode its {name} ({_one_line(error)})") from error
                value = self.image_transform(value)
            elif name in self.split.vector_columns:  # float32 (int64) values, not a list the collate would transpose
                value = torch.tensor(value)
            sample.append(value)
        return tuple(sample)


def listed_splits(root: Path) -> list[str]:
    if not root.is_dir():
        raise DatasetNotFoundError(f"dataset folder {root} not found: give dataset.root the folder that "
                                   "python -m src.data.convert (or datasets' save_to_disk) wrote")
    return _read_json(root / "dataset_dict.json", f"{root} is not a dataset saved by save_to_disk")["splits"]


def column(split: ArrowSplit, name: str) -> list[Any]:
    """Every row's value of column `name` (numbers: a label column), in row order."""
    return [value for batch in split.record_batches() for value in batch.column(name).to_pylist()]


def open_splits(root: Path, names: Sequence[str]) -> list[ArrowSplit]:
    listed = listed_splits(root)
    for name in names:
        if name not in listed:
            raise UsageError(f"{root} has no split {name!r} (its splits: {', '.join(listed)}); "
                             "set dataset.train_split / dataset.val_split to one of them")
    return [ArrowSplit(root / name) for name in names]


def check_columns(split: ArrowSplit, names: Sequence[str], setting: str) -> None:
    if unknown := [name for name in names if name not in split.columns]:
        raise UsageError(f"{setting}: {', '.join(map(repr, unknown))} is not a column of {split.folder} "
                         f"(its columns: {', '.join(split.columns)})")


def target_info(splits: Sequence[ArrowSplit], name: str) -> dict[str, Any]:
    """`num_classes` for a ClassLabel or integer target column (the largest label + 1), `num_targets` for floats."""
    feature = splits[0].features.get(name) or {}
    if feature.get("_type") == "ClassLabel":
        return {"num_classes": len(feature["names"])}
    arrow_type = splits[0]._open().field(name).type
    if pa.types.is_integer(arrow_type):
        largest = max((pc.max(batch.column(name)).as_py() for split in splits for batch in split.record_batches()),
                      key=lambda value: -1 if value is None else value, default=None)
        return {"num_classes": 0 if largest is None else largest + 1}
    return {"num_targets": 1} if pa.types.is_floating(arrow_type) else {}


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DatasetNotFoundError(f"{what}: {path.name} is missing") from error
    except (OSError, ValueError) as error:
        raise DatasetNotFoundError(f"{path} cannot be read ({_one_line(error)})") from error


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]
