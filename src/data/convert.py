"""Convert data into the Arrow layout `dataset=arrow` reads (src/data/arrow_files.py), atomically (via OUT.partial).

    python -m src.data.convert image-folder SRC OUT   # SRC/train/<class>/*.png|jpg|..., SRC/val/... (and SRC/test/...)
    python -m src.data.convert parquet TRAIN VAL OUT [--test TEST]  # each a Parquet file or a folder of them
    python -m src.data.convert check-images ROOT      # decode every image under ROOT; list the damaged ones"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from src.common.errors import USAGE_ERROR_EXIT_CODE, UsageError
from src.common.files import fsync_directory
from src.data.splits import UnreadableSampleError, read_image

# torchvision's ImageFolder extensions (torchvision.datasets.folder.IMG_EXTENSIONS), matched the same way.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = {"train": "train", "val": "validation", "test": "test"}  # image folder's split folder -> the split's name
SHARD_BYTES = 500 * 2**20  # datasets' save_to_disk default (max_shard_size="500MB")
BATCH_ROWS = 100  # rows per Arrow record batch at most (a read maps in one batch's offsets to find a row)
BATCH_BYTES = 32 * 2**20  # and at most about this many bytes: the converter holds one batch in memory


def image_files(folder: Path, classes: list[str]) -> Iterator[tuple[Path, int]]:
    """(file, label) of every image under folder/<class>/, in torchvision ImageFolder's order."""
    for label, name in enumerate(classes):
        for root, _, names in sorted(os.walk(folder / name, followlinks=True)):
            for file_name in sorted(names):
                if file_name.lower().endswith(IMAGE_EXTENSIONS):
                    yield Path(root) / file_name, label


def class_names(source: Path) -> list[str]:
    """The sorted class folders, which train/, val/ and test/ (if any) must share, as dataset=image_folder requires."""
    found = {}
    for split in SPLITS:
        folder = source / split
        if not folder.is_dir() and split != "test":
            raise UsageError(f"image folder {folder} not found: put images in {folder}/<class_name>/")
        if folder.is_dir():
            found[split] = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    for split, names in found.items():
        if names != found["train"]:
            raise UsageError(f"class folders differ between {source}/train and {source}/{split}: {found['train']} "
                             f"and {names}")
    if not found["train"]:
        raise UsageError(f"{source}/train holds no class folders: put images in {source}/train/<class_name>/")
    return found["train"]


def image_rows(folder: Path, classes: list[str]) -> Iterator[dict[str, Any]]:
    """Rows {image: {bytes, path}, label} of a split's files; a file PIL cannot identify is refused."""
    count = 0
    for file, label in image_files(folder, classes):
        encoded = file.read_bytes()
        try:
            with Image.open(file) as image:
                image.verify()  # the header and, for PNG, chunk checksums; no full decode
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            raise UsageError(f"{file} is not a readable image ({type(error).__name__}: {error})") from error
        count += 1
        yield {"image": {"bytes": encoded, "path": str(file.relative_to(folder))}, "label": label}
    if count == 0:
        raise UsageError(f"image folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")


def image_schema(classes: list[str]) -> Any:
    """Arrow schema of an image folder's rows, with the `datasets` features in its metadata."""
    features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return pa.schema([("image", image), ("label", pa.int64())], metadata=metadata)


def batches_of(rows: Iterable[dict[str, Any]], schema: Any) -> Iterator[Any]:
    """Record batches of image rows: BATCH_ROWS rows, or fewer that hold BATCH_BYTES of images."""
    chunk, size = [], 0
    for row in rows:
        chunk.append(row)
        size += len(row["image"]["bytes"])
        if len(chunk) == BATCH_ROWS or size >= BATCH_BYTES:
            yield pa.RecordBatch.from_pylist(chunk, schema=schema)
            chunk, size = [], 0
    if chunk:
        yield pa.RecordBatch.from_pylist(chunk, schema=schema)


def write_split(folder: Path, batches: Iterable[Any], schema: Any, shard_bytes: int = SHARD_BYTES) -> int:
    """Write a split as save_to_disk does (shards of about `shard_bytes` and its JSON files); returns its rows."""
    folder.mkdir(parents=True)
    shards = [folder / "shard-0.tmp"]  # an empty split too has one (empty) shard, as datasets writes
    writer, rows, written = pa.ipc.new_stream(str(shards[0]), schema), 0, 0
    for batch in batches:
        if written >= shard_bytes:
            writer.close()
            shards.append(folder / f"shard-{len(shards)}.tmp")
            writer, written = pa.ipc.new_stream(str(shards[-1]), schema), 0
        writer.write_batch(batch)
        written += batch.nbytes
        rows += batch.num_rows
    writer.close()
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for shard, name in zip(shards, names):
        shard.rename(folder / name)
    # state.json and dataset_info.json as `datasets` 5 writes them.
    features = json.loads((schema.metadata or {}).get(b"huggingface", b"{}")).get("info", {}).get("features")
    state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": secrets.token_hex(8),
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return rows


def parquet_batches(source: Path) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of a Parquet file, or of a folder's *.parquet files in name order."""
    files = sorted(source.glob("*.parquet")) if source.is_dir() else [source]
    if not files or not all(file.is_file() for file in files):
        raise UsageError(f"{source}: no Parquet file there (give a .parquet file or a folder of them)")
    try:
        opened = [pq.ParquetFile(file) for file in files]
    except Exception as error:  # pyarrow's errors for a damaged or foreign file vary
        raise UsageError(f"{source} is not readable Parquet ({type(error).__name__}: {error})") from error
    schema = opened[0].schema_arrow
    for file, parquet in zip(files, opened):
        if not parquet.schema_arrow.remove_metadata().equals(schema.remove_metadata()):
            raise UsageError(f"{file} has other columns than {files[0]}: {parquet.schema_arrow}")
    return schema, (batch for parquet in opened for batch in parquet.iter_batches(batch_size=BATCH_ROWS))


def convert(out: Path, splits: dict[str, tuple[Any, Iterable[Any]]]) -> dict[str, int]:
    """Write `splits` ({name: (schema, record batches)}) as a dataset in `out`, atomically; returns their rows."""
    if out.exists():
        raise UsageError(f"{out} already exists: convert into a new folder (nothing was written)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed conversion left
    partial.mkdir(parents=True)
    try:
        rows = {name: write_split(partial / name, batches, schema) for name, (schema, batches) in splits.items()}
        (partial / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
        for file in partial.rglob("*.*"):
            with open(file, "rb") as written:
                os.fsync(written.fileno())
        for folder in [partial, *(partial / name for name in splits)]:
            fsync_directory(folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(out)
    fsync_directory(out.parent)
    return rows


def check_images(root: Path) -> int:
    """Print the images under `root` that do not decode in full, as training reads them, and their count; 1 if any."""
    if not root.is_dir():
        raise UsageError(f"{root} is not a folder")
    damaged = []
    for file in sorted(root.rglob("*")):
        if file.suffix.lower() in IMAGE_EXTENSIONS:
            try:
                read_image(str(file))
            except UnreadableSampleError as error:
                damaged.append(str(error).split(": replace or remove it")[0])
    print("\n".join(damaged + [f"{root}: {len(damaged)} damaged image(s)"]))
    return 1 if damaged else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.data.convert", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command, arguments, summary in (
            ("image-folder", ("source", "out"), "SRC/train/<class>/*, SRC/val/... (and SRC/test/...) -> OUT"),
            ("parquet", ("train", "val", "out", "--test"), "TRAIN, VAL (and TEST) Parquet files or folders -> OUT"),
            ("check-images", ("root",), "decode every image under ROOT; print the damaged ones")):
        subparser = commands.add_parser(command, help=summary)
        for argument in arguments:
            subparser.add_argument(argument, type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "check-images":
            return check_images(args.root)
        if args.command == "image-folder":
            classes = class_names(args.source)
            schema = image_schema(classes)
            rows = convert(args.out, {name: (schema, batches_of(image_rows(args.source / folder, classes), schema))
                                      for folder, name in SPLITS.items() if (args.source / folder).is_dir()})
        else:
            rows = convert(args.out, {"train": parquet_batches(args.train), "validation": parquet_batches(args.val),
                                      **({"test": parquet_batches(args.test)} if args.test else {})})
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    print(f"wrote {args.out}: " + ", ".join(f"{name} {count} rows" for name, count in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
