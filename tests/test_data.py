"""Data sources of the accuracy check: synthetic, ImageFolder, factory; and their errors."""

from __future__ import annotations

import sys

import pytest
import torch
from PIL import Image

from autotune.workload.data import (Datasets, SyntheticImages, batch_order, check_data_spec, collate, from_factory,
                           image_folder, load_data, synthetic)
from autotune.errors import ConfigError


def test_synthetic_is_deterministic_and_labelled_by_one_teacher():
    a = synthetic((3, 16, 16), 1000, train_size=50, held_out_size=20, seed=3)
    b = synthetic((3, 16, 16), 1000, train_size=50, held_out_size=20, seed=3)
    assert a.num_classes == 10  # labels use at most 10 of the model's 1000 classes
    x, y = a.train[7]
    assert x.shape == (3, 16, 16) and 0 <= int(y) < 10
    torch.testing.assert_close(x, b.train[7][0])
    assert int(b.train[7][1]) == int(y)
    # held-out samples are other samples labelled by the same teacher
    assert not torch.equal(a.held_out[7][0], x)
    assert a.train.teacher is a.held_out.teacher
    other = synthetic((3, 16, 16), 10, train_size=50, held_out_size=20, seed=4)
    assert not torch.equal(other.train[7][0], x)
    # every class occurs, none takes most of the labels
    _, ys = collate(a.train, list(range(50)))
    counts = torch.bincount(ys, minlength=10)
    assert int((counts > 0).sum()) >= 8 and int(counts.max()) <= 15
    with pytest.raises(IndexError):
        a.train[50]


def test_synthetic_non_image_shapes():
    d = SyntheticImages((12,), 4, 8, seed=0)
    assert d[0][0].shape == (12,)


def _write_folder(root, counts, size=(20, 12)):
    for c, (name, n) in enumerate(counts.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):
            colour = (40 * c + 3 * i, 200 - 50 * c, 100)
            Image.new("RGB", size, colour).save(root / name / f"img{i}.png")


def test_image_folder_split_is_per_class_deterministic_and_resized(tmp_path):
    _write_folder(tmp_path, {"cat": 5, "dog": 6, "eel": 2})
    d = image_folder(tmp_path, (3, 8, 8), seed=0)
    assert d.num_classes == 3 and "3 classes" in d.source
    held = [d.held_out.dataset.samples[i] for i in d.held_out.indices]
    train = [d.train.dataset.samples[i] for i in d.train.indices]
    assert not set(held) & set(train) and len(held) + len(train) == 13
    # every class with two or more images has at least one held out, and keeps one for training
    assert {label for _, label in held} == {0, 1, 2} and {label for _, label in train} == {0, 1, 2}
    again = image_folder(tmp_path, (3, 8, 8), seed=0)
    assert list(again.held_out.indices) == list(d.held_out.indices)
    x, y = d.train[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32
    gray = image_folder(tmp_path, (1, 4, 4))
    assert gray.train[0][0].shape == (1, 4, 4)


def test_image_folder_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no such folder.*ImageFolder layout"):
        image_folder(tmp_path / "missing", (3, 8, 8))
    with pytest.raises(ConfigError, match="holds no class folders"):
        image_folder(tmp_path, (3, 8, 8))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="hold no images"):
        image_folder(tmp_path, (3, 8, 8))
    with pytest.raises(ConfigError, match="is a file"):
        check_data_spec(str(tmp_path / "a" / "notes.txt"))
    folder = tmp_path / "imgs"
    _write_folder(folder, {"a": 2, "b": 2, "c": 2})
    with pytest.raises(ConfigError, match="3 classes but the model outputs 2; pass --num-classes 3"):
        image_folder(folder, (3, 8, 8), max_classes=2)
    with pytest.raises(ConfigError, match="1 or 3 channels"):
        image_folder(folder, (12,))
    single = tmp_path / "single"
    _write_folder(single, {"a": 1, "b": 1})
    with pytest.raises(ConfigError, match="single image"):
        image_folder(single, (3, 8, 8))


def test_factory_sources(tmp_path, monkeypatch):
    module = tmp_path / "my_data.py"
    module.write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def both(num_classes, seed):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    x = torch.randn(20, 4, generator=g); y = torch.randint(0, num_classes, (20,), generator=g)\n"
        "    return TensorDataset(x[:15], y[:15]), TensorDataset(x[15:], y[15:])\n"
        "def train_only():\n"
        "    return TensorDataset(torch.randn(6, 4), torch.zeros(6, dtype=torch.long))\n"
        "def wrong():\n"
        "    return 42\n"
        "def empty():\n"
        "    return TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))\n"
        "not_callable = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    d = load_data("my_data:both", input_shape=(4,), num_classes=3, train_size=1, held_out_size=1)
    assert isinstance(d, Datasets) and len(d.train) == 15 and len(d.held_out) == 5
    only = from_factory("my_data:train_only", input_shape=(4,), num_classes=3)
    assert only.held_out is None
    with pytest.raises(ConfigError, match="returned int; the factory must return"):
        from_factory("my_data:wrong", input_shape=(4,), num_classes=3)
    with pytest.raises(ConfigError, match="train dataset is empty"):
        from_factory("my_data:empty", input_shape=(4,), num_classes=3)
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        check_data_spec("my_data:nope")
    with pytest.raises(ConfigError, match="not callable"):
        check_data_spec("my_data:not_callable")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        check_data_spec("no_such_module_xyz:f")
    sys.modules.pop("my_data", None)


def test_batch_order_is_seeded_epochs():
    a = list(batch_order(10, 4, 5, seed=1))
    assert a == list(batch_order(10, 4, 5, seed=1)) and a != list(batch_order(10, 4, 5, seed=2))
    flat = [i for b in a for i in b]
    assert all(len(b) == 4 for b in a)
    assert sorted(flat[:10]) == list(range(10))  # the first epoch is a permutation
    assert len(list(batch_order(3, 8, 2, seed=0))[0]) == 8  # a set smaller than a batch is cycled
