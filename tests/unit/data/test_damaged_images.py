"""A damaged image file in an image folder: one line naming it, from the main process or a DataLoader worker, and
`python -m src.data.convert check-images` lists every one before a long run."""

from __future__ import annotations

import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import REPO
from dataset_files import write_noise_folder

from src.components import datasets
from src.data.splits import UnreadableSampleError, read_image


def test_a_truncated_and_a_foreign_file_are_one_line_naming_them(tmp_path: Path):
    write_noise_folder(tmp_path, {"train/b/2.png": "truncated", "val/a/1.png": "garbage"})
    assert read_image(str(tmp_path / "train/a/0.png")).size == (20, 20)
    with pytest.raises(UnreadableSampleError, match=rf"^{tmp_path}/train/b/2.png is not a readable image \(OSError: "
                                                    r"image file is truncated.*\): replace or remove it"):
        read_image(str(tmp_path / "train/b/2.png"))
    with pytest.raises(UnreadableSampleError, match=rf"^{tmp_path}/val/a/1.png is not a readable image \("
                                                    r"UnidentifiedImageError: "):
        read_image(str(tmp_path / "val/a/1.png"))
    assert UnreadableSampleError.local  # only the rank whose sampler holds it finds it: that rank prints it


@pytest.mark.parametrize("workers", [0, 2])
def test_image_folder_reading_a_damaged_file_in_a_loader_raises_the_line(tmp_path: Path, workers: int):
    write_noise_folder(tmp_path, {"train/b/2.png": "truncated"})
    splits = datasets.image_folder(str(tmp_path), image_size=(8, 8), augment=False)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=4, num_workers=workers)
    with pytest.raises(UnreadableSampleError) as raised:
        for _ in loader:
            pass
    assert str(raised.value).startswith(f"{tmp_path}/train/b/2.png is not a readable image (OSError: image file "
                                        "is truncated")
    assert "\n" not in str(raised.value) and "Traceback" not in str(raised.value)
    # The traceback holds the loader's iterator in a reference cycle: freed later by the garbage collector, in some
    # other test, its workers would wait out a 5 s join timeout each (pytorch/pytorch#39570); freed now, they end.
    traceback.clear_frames(raised.tb)
    assert len(list(torch.utils.data.DataLoader(splits.val, batch_size=4, num_workers=workers))) == 2


def test_check_images_lists_every_damaged_file_and_exits_1(tmp_path: Path):
    write_noise_folder(tmp_path, {"train/b/2.png": "truncated", "val/a/1.png": "garbage"})
    result = subprocess.run([sys.executable, "-m", "src.data.convert", "check-images", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" is not")[0] for line in lines[:-1]] == [f"{tmp_path}/train/b/2.png", f"{tmp_path}/val/a/1.png"]
    assert lines[-1] == f"{tmp_path}: 2 damaged image(s)"
    (tmp_path / "train/b/2.png").unlink()
    (tmp_path / "val/a/1.png").unlink()
    clean = subprocess.run([sys.executable, "-m", "src.data.convert", "check-images", str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert (clean.returncode, clean.stdout) == (0, f"{tmp_path}: 0 damaged image(s)\n")
