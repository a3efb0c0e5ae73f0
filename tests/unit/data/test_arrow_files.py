"""dataset=arrow and its converter: the save_to_disk layout read by index, and what bad input gets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from dataset_files import write_image_folder
from PIL import Image

from src.common.errors import UsageError
from src.components import datasets
from src.data import convert
from src.data.arrow_files import ArrowSplit
from src.data.splits import DatasetNotFoundError, UnreadableSampleError

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


def noise_folder(root, per_class: int = 3, size=(9, 7), splits=("train", "val")) -> None:
    """Noisy RGB PNGs in root/<split>/<class>/: every image different."""
    rng = np.random.default_rng(0)
    for split in splits:
        for name in COLOURS:
            (root / split / name).mkdir(parents=True)
            for index in range(per_class):
                pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{index}.png")


@pytest.fixture
def converted(tmp_path):
    noise_folder(tmp_path / "images")
    assert convert.main(["image-folder", str(tmp_path / "images"), str(tmp_path / "arrow")]) == 0
    return tmp_path


def test_a_converted_folder_gives_image_folders_samples_in_its_order(converted):
    options = {"image_size": (6, 8), "augment": False}
    folder = datasets.image_folder(str(converted / "images"), **options)
    arrow = datasets.arrow(str(converted / "arrow"), **options)
    assert arrow.info == folder.info == {"num_classes": 3, "in_channels": 3, "image_size": [6, 8], "num_features": 144}
    for ours, theirs in ((arrow.train, folder.train), (arrow.val, folder.val)):
        assert len(ours) == len(theirs) == 9
        for index in range(9):
            (image, label), (expected, expected_label) = ours[index], theirs[index]
            assert torch.equal(image, expected) and label == expected_label


def test_a_test_folder_becomes_the_test_split(tmp_path):
    noise_folder(tmp_path / "images", splits=("train", "val", "test"))
    assert convert.main(["image-folder", str(tmp_path / "images"), str(tmp_path / "arrow")]) == 0
    written = json.loads((tmp_path / "arrow" / "dataset_dict.json").read_text())["splits"]
    assert written == ["train", "validation", "test"]
    options = {"image_size": (6, 8), "augment": False}
    folder = datasets.image_folder(str(tmp_path / "images"), **options)
    arrow = datasets.arrow(str(tmp_path / "arrow"), **options)
    assert len(arrow.test) == len(folder.test) == 9
    for index in range(9):
        (image, label), (expected, expected_label) = arrow.test[index], folder.test[index]
        assert torch.equal(image, expected) and label == expected_label


def test_a_test_folder_of_other_classes_is_one_line_and_writes_nothing(tmp_path):
    noise_folder(tmp_path / "images", splits=("train", "val"))
    (tmp_path / "images" / "test" / "purple").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"^class folders differ between .*/train and .*/test: \['blue', 'green', "
                                         r"'red'\] and \['purple'\]$"):
        convert.class_names(tmp_path / "images")
    assert convert.main(["image-folder", str(tmp_path / "images"), str(tmp_path / "arrow")]) == 2
    assert not (tmp_path / "arrow").exists() and not (tmp_path / "arrow.partial").exists()


def test_the_layout_is_save_to_disks(converted):
    root = converted / "arrow"
    assert json.loads((root / "dataset_dict.json").read_text()) == {"splits": ["train", "validation"]}
    state = json.loads((root / "train" / "state.json").read_text())
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}] and state["_split"] is None
    features = json.loads((root / "train" / "dataset_info.json").read_text())["features"]
    assert features == {"image": {"_type": "Image"}, "label": {"names": sorted(COLOURS), "_type": "ClassLabel"}}
    stream = pa.ipc.open_stream(pa.memory_map(str(root / "train" / "data-00000-of-00001.arrow")))
    assert json.loads(stream.schema.metadata[b"huggingface"]) == {"info": {"features": features}}
    table = stream.read_all()
    assert table.column("label").to_pylist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    first = table.column("image")[0].as_py()
    assert first == {"bytes": (converted / "images/train/blue/0.png").read_bytes(), "path": "blue/0.png"}


def test_rows_span_shards_and_record_batches(tmp_path, monkeypatch):
    noise_folder(tmp_path / "images", per_class=40)
    monkeypatch.setattr(convert, "BATCH_ROWS", 7)
    schema = convert.image_schema(sorted(COLOURS))
    rows = convert.image_rows(tmp_path / "images" / "train", sorted(COLOURS))
    assert convert.write_split(tmp_path / "split", convert.batches_of(rows, schema), schema, shard_bytes=5_000) == 120
    split = ArrowSplit(tmp_path / "split")
    assert len(split.files) > 3 and len(split) == 120
    files = sorted(path for path in (tmp_path / "images" / "train").rglob("*.png"))  # blue, green, red; 0, 1, 10, ...
    for index in (0, 6, 7, 55, 119):
        (encoded,), where = split.values(index, ["image"])
        assert encoded == files[index].read_bytes(), where
    assert split.values(119, ["label"])[0] == [2]


def test_parquet_with_datasets_features_converts_with_them(tmp_path):
    images = [np.full((4, 5, 3), value, dtype=np.uint8) for value in (10, 200, 90)]
    encoded = []
    for pixels in images:
        path = tmp_path / f"{pixels[0, 0, 0]}.png"
        Image.fromarray(pixels).save(path)
        encoded.append({"bytes": path.read_bytes(), "path": None})
    features = {"img": {"_type": "Image"}, "y": {"dtype": "float32", "_type": "Value"}}
    schema = pa.schema([("img", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("y", pa.float32())],
                       metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    table = pa.Table.from_pylist([{"img": e, "y": float(i)} for i, e in enumerate(encoded)], schema=schema)
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table.slice(0, 2), tmp_path / "val.parquet")
    pq.write_table(table.slice(2, 1), tmp_path / "test.parquet")
    assert convert.main(["parquet", str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"),
                         str(tmp_path / "out"), "--test", str(tmp_path / "test.parquet")]) == 0
    splits = datasets.arrow(str(tmp_path / "out"), target="y", image_size=(4, 5), augment=False)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (3, 2, 1) and splits.test[0][1] == 2.0
    assert splits.info == {"num_targets": 1, "in_channels": 3, "image_size": [4, 5], "num_features": 60}
    image, target = splits.train[1]
    assert target == 1.0 and torch.allclose(image, torch.full((3, 4, 5), (200 / 255 - 0.5) / 0.5))


def test_a_column_of_numeric_lists_is_one_tensor_per_sample_and_gives_num_features(tmp_path):
    """A table's feature vectors (list<double>) and token ids (list<int64>): tensors a DataLoader stacks, not lists
    its collate would transpose; one vector column beside the target is `num_features` wide."""
    rows = [{"features": [float(i), i / 2, -1.0], "y": float(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "val.parquet")
    assert convert.main(["parquet", str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"),
                         str(tmp_path / "out")]) == 0
    splits = datasets.arrow(str(tmp_path / "out"), target="y")
    assert splits.info == {"num_targets": 1, "num_features": 3}
    features, target = splits.train[4]
    assert features.dtype == torch.float32 and torch.equal(features, torch.tensor([4.0, 2.0, -1.0])) and target == 4.0
    batch = next(iter(torch.utils.data.DataLoader(splits.train, batch_size=5)))
    assert batch[0].shape == (5, 3) and torch.equal(batch[1], torch.arange(5, dtype=torch.float64))
    tokens = [{"ids": [i, i + 1, i + 2, i + 3], "label": i % 2} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(tokens), tmp_path / "tokens.parquet")
    assert convert.main(["parquet", str(tmp_path / "tokens.parquet"), str(tmp_path / "tokens.parquet"),
                         str(tmp_path / "tokens")]) == 0
    ids, label = datasets.arrow(str(tmp_path / "tokens")).train[1]
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 2, 3, 4] and label == 1


def test_a_tables_columns_of_single_numbers_are_stacked_into_one_features_vector(tmp_path):
    """dataset.features: a plain table (one column per feature, as most are) becomes the `features` vector model=mlp
    takes; `all` stacks every column of numbers but the target, in order; the sample's other parts follow."""
    rows = [{"age": 30 + i, "note": f"n{i}", "income": i * 1.5, "height": 1.6 + i / 10, "label": i % 3}
            for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "val.parquet")
    assert convert.main(["parquet", str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"),
                         str(tmp_path / "out")]) == 0
    root = str(tmp_path / "out")
    assert datasets.arrow(root).fields == ("age", "note", "income", "height", "label")  # null: each column a part
    every = datasets.arrow(root, features="all", columns=["age", "income", "height", "label"])
    assert every.fields == ("features", "label") and every.info == {"num_classes": 3, "num_features": 3}
    features, label = every.train[4]
    assert features.dtype == torch.float32 and label == 1
    assert torch.equal(features, torch.tensor([34.0, 6.0, 2.0], dtype=torch.float32))
    batch = next(iter(torch.utils.data.DataLoader(every.val, batch_size=3)))
    assert batch[0].shape == (3, 3) and batch[1].tolist() == [0, 1, 2]
    chosen = datasets.arrow(root, features=["height", "age"], val_size=2)  # listed order; held-out val rows too
    assert chosen.fields == ("features", "note", "income", "label") and chosen.info["num_features"] == 2
    assert (len(chosen.train), len(chosen.val)) == (4, 2)
    for split in (chosen.train, chosen.val):
        for features, note, income, label in (split[i] for i in range(len(split))):
            row = rows[int(note[1:])]
            assert features.tolist() == pytest.approx([row["height"], row["age"]]) and income == row["income"]
    assert datasets.arrow(root, features="age").info["num_features"] == 1  # one column, named alone
    with pytest.raises(ValueError, match=r"dataset.features: 'note', 'label' is the target or not a column of single "
                       r"numbers; the sample's columns of single numbers: age, income, height$"):
        datasets.arrow(root, features=["age", "note", "label"])
    with pytest.raises(ValueError, match=r"dataset.features=\[\] names no column of single numbers"):
        datasets.arrow(root, features=[])


# ---- bad input: one line each, nothing written or touched ------------------------------------------------


def test_a_missing_shard_is_one_line_naming_it(converted):
    (converted / "arrow" / "validation" / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(DatasetNotFoundError, match="shard data-00000-of-00001.arrow is missing") as error:
        datasets.arrow(str(converted / "arrow"))
    assert str(converted / "arrow" / "validation") in str(error.value) and "\n" not in str(error.value)


def test_a_truncated_shard_is_one_line_naming_it(converted):
    shard = converted / "arrow" / "train" / "data-00000-of-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DatasetNotFoundError, match="is not a readable Arrow stream") as error:
        datasets.arrow(str(converted / "arrow"))
    assert str(shard) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("options, setting, name", [({"target": "lable"}, "dataset.target", "'lable'"),
                                                    ({"columns": ["image", "y"]}, "dataset.columns", "'y'"),
                                                    ({"val_split": "test"}, "dataset.val_split", "'test'")])
def test_a_name_that_does_not_exist_is_one_line_naming_what_exists(converted, options, setting, name):
    with pytest.raises(UsageError) as error:
        datasets.arrow(str(converted / "arrow"), **options)
    message = str(error.value)
    assert setting in message and name in message and "\n" not in message
    assert "image, label" in message or "train, validation" in message


def test_a_corrupt_record_names_the_file_and_index(converted):
    shard = converted / "arrow" / "train" / "data-00000-of-00001.arrow"
    data = bytearray(shard.read_bytes())
    png = (converted / "images/train/green/1.png").read_bytes()  # sample 4
    start = data.find(png)
    data[start + 40 : start + 60] = bytes(20)  # inside its pixel data: the header still reads
    shard.write_bytes(bytes(data))
    splits = datasets.arrow(str(converted / "arrow"), augment=False)
    splits.train[3]  # its neighbours read
    with pytest.raises(UnreadableSampleError) as error:
        splits.train[4]
    message = str(error.value)
    assert message.startswith(f"corrupt record 4 of {converted / 'arrow' / 'train'} (data-00000-of-00001.arrow row 4)")
    assert "cannot decode its image" in message and "\n" not in message


def test_a_workers_corrupt_record_error_keeps_its_own_line():
    """A DataLoader re-raises a worker's error built from its whole traceback."""
    from torch._utils import ExceptionWrapper

    try:
        raise UnreadableSampleError("corrupt record 4 of /data/train (data-00000-of-00001.arrow row 4): cannot decode")
    except UnreadableSampleError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(UnreadableSampleError) as error:
        wrapped.reraise()
    assert str(error.value) == "corrupt record 4 of /data/train (data-00000-of-00001.arrow row 4): cannot decode"


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "src.data.convert", *args], cwd=REPO, capture_output=True, text=True)


def test_converter_errors_are_one_line_and_write_nothing(tmp_path):
    write_image_folder(tmp_path / "images", {"red": (255, 0, 0)})
    (tmp_path / "images" / "train" / "red" / "broken.png").write_bytes(b"not a png")
    result = run_convert("image-folder", str(tmp_path / "images"), str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert "broken.png is not a readable image" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["images"]  # neither out nor out.partial
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    result = run_convert("image-folder", str(tmp_path / "images"), str(tmp_path / "out"))
    assert result.returncode == 2 and "already exists" in result.stderr
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["mine.txt"]
    result = run_convert("image-folder", str(tmp_path / "nowhere"), str(tmp_path / "out2"))
    assert result.returncode == 2 and f"image folder {tmp_path / 'nowhere' / 'train'} not found" in result.stderr


def test_a_killed_conversion_leaves_no_dataset_that_looks_whole(tmp_path):
    noise_folder(tmp_path / "images", per_class=2)
    os.mkfifo(tmp_path / "images" / "val" / "green" / "1a.png")  # reading it blocks: the kill lands mid-way
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "src.data.convert", "image-folder", str(tmp_path / "images"),
                                str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "out.partial"
    deadline = time.monotonic() + 60
    while not (partial / "validation").exists() and time.monotonic() < deadline:  # train written: blocked there
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not out.exists() and (partial / "train").is_dir()  # the train split was written, validation was not
    (tmp_path / "images" / "val" / "green" / "1a.png").unlink()
    assert run_convert("image-folder", str(tmp_path / "images"), str(out)).returncode == 0
    assert not partial.exists() and len(datasets.arrow(str(out)).val) == 6


def test_a_corrupt_record_is_reported_by_the_rank_that_reads_it(capsys, monkeypatch):
    """Only the rank whose samples hold it finds it; other usage errors are printed by rank 0 alone."""
    from src.common import errors

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(errors, "NON_MAIN_RANK_GRACE_S", 0.0)
    for error, printed in ((UnreadableSampleError("corrupt record 4 of /d/train (x.arrow row 4): bad"), True),
                           (UsageError("dataset.root is required"), False)):
        with pytest.raises(SystemExit) as exit_code, errors.exit_on_usage_error(is_main_process=False):
            raise error
        assert exit_code.value.code == 2
        assert capsys.readouterr().err == (f"error: {error}\n" if printed else "")
