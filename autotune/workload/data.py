"""Data for training checks: a train set and a held-out set, from one of three sources.

* default: a learnable synthetic image set generated locally at the model's input size (per-class
  smooth templates plus noise; no download), so "did training work?" has an answer on any model;
* ``--data DIR``: the user's images in ImageFolder layout (``DIR/<class>/<image>``), resized to the
  model's input size, with a deterministic per-class held-out split;
* ``--data package.module:factory``: a callable returning ``(train, held_out)`` datasets (or a
  :class:`Datasets`, or one train dataset when there is no held-out set).

Every source gives map-style ``torch.utils.data.Dataset`` objects whose items are ``(input,
label)``, so a ``DataLoader`` can read them too. :func:`batch_order` and :func:`collate` give the
deterministic batches the accuracy check feeds every configuration in the same order.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, Subset

from autotune.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MAX_SYNTHETIC_CLASSES = 10
"""Synthetic labels use at most this many classes (of the model's outputs): a short run from
random weights learns them, so the held-out accuracy of FP32 is high and a drop is visible."""


@dataclass(kw_only=True)
class Datasets:
    """What a training check trains on and evaluates on."""

    train: Dataset
    """Items are (input, label)."""
    held_out: Dataset | None
    """Never trained on; None when the source has no held-out split (the check then compares
    training loss instead of accuracy)."""
    num_classes: int | None
    """Classes the labels use, when known."""
    source: str
    """One line saying where the data came from, for reports and config.json."""


class SyntheticImages(Dataset):
    """A learnable classification set: sample ``i`` is ``a * template[label] + noise``.

    Templates are smooth random patterns (low-resolution noise upsampled to the input size), one
    per class, shared by every split of the same seed; the amplitude ``a`` and the noise vary per
    sample. Sample ``i`` is a pure function of (seed, split, i, device type): items are generated
    on demand, so a set of any size costs no memory, and on a GPU each is generated there.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, size: int, *, seed: int = 0,
                 split: int = 0, device: str | torch.device = "cpu", noise: float = 1.0) -> None:
        if size < 1:
            raise ConfigError(f"a synthetic dataset needs at least one sample, got size={size}")
        if num_classes < 1:
            raise ConfigError(f"a synthetic dataset needs at least one class, got num_classes={num_classes}")
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = num_classes
        self.size = size
        self.seed = seed
        self.split = split
        self.device = torch.device(device)
        self.noise = noise
        self.templates = _templates(self.input_shape, num_classes, seed, self.device)
        # labels and amplitudes come from a CPU generator: the same on every device
        g = torch.Generator().manual_seed(_mix(seed, split, -1))
        self.labels = torch.randint(0, num_classes, (size,), generator=g)
        self.amplitudes = 0.5 + torch.rand(size, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for a synthetic set of {self.size}")
        index %= self.size
        g = torch.Generator(device=self.device).manual_seed(_mix(self.seed, self.split, index))
        noise = torch.randn(self.input_shape, generator=g, device=self.device)
        label = self.labels[index]
        x = self.amplitudes[index].item() * self.templates[label] + self.noise * noise
        return x, label.to(self.device)


def _mix(seed: int, split: int, index: int) -> int:
    """A distinct 63-bit generator seed per (seed, split, index)."""
    return (seed * 1_000_003 + split * 7_919 + index * 2_654_435_761 + 12_345) % (2**63 - 1)


def _templates(shape: tuple[int, ...], num_classes: int, seed: int, device: torch.device) -> torch.Tensor:
    """One pattern per class: smooth unit-variance noise plus a per-channel colour for images (a
    class is then visible both locally and after global pooling, so small CNNs learn it in a
    hundred steps); plain random vectors for non-image shapes. Made on the CPU, then moved."""
    g = torch.Generator().manual_seed(_mix(seed, 0, -2))
    if len(shape) == 3:
        channels, height, width = shape
        low = torch.randn((num_classes, channels, min(height, 4), min(width, 4)), generator=g)
        t = torch.nn.functional.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)
    else:
        t = torch.randn((num_classes, *shape), generator=g)
    dims = tuple(range(1, t.dim()))
    t = t - t.mean(dim=dims, keepdim=True)
    t = t / t.std(dim=dims, keepdim=True).clamp_min(1e-6)
    if len(shape) == 3:
        t = t + torch.randn((num_classes, shape[0], 1, 1), generator=g)
    return t.to(device)


def synthetic(input_shape: tuple[int, ...], num_classes: int, *, train_size: int, held_out_size: int,
              seed: int = 0, device: str | torch.device = "cpu") -> Datasets:
    """The default data: a learnable synthetic set at the model's input size (no downloads).

    Labels use ``min(num_classes, MAX_SYNTHETIC_CLASSES)`` of the model's classes.
    """
    used = min(num_classes, MAX_SYNTHETIC_CLASSES)
    shape = "x".join(str(d) for d in input_shape)
    return Datasets(
        train=SyntheticImages(input_shape, used, train_size, seed=seed, split=0, device=device),
        held_out=SyntheticImages(input_shape, used, held_out_size, seed=seed, split=1, device=device),
        num_classes=used,
        source=f"synthetic: {used} classes of templates plus noise at {shape}, seed {seed}",
    )


def image_folder(root: str | Path, input_shape: tuple[int, ...], *, held_out_fraction: float = 0.2,
                 seed: int = 0, max_classes: int | None = None) -> Datasets:
    """The user's images in ImageFolder layout, resized to ``input_shape`` (C x H x W), split into
    train and held-out per class, deterministically from ``seed``."""
    import torchvision
    from torchvision import transforms

    root = Path(root)
    _check_folder(root)
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise ConfigError(f"--data {root}: images need a model input of 1 or 3 channels x H x W, but the model "
                          f"takes {'x'.join(map(str, input_shape))}; use --data package.module:factory instead")
    if not 0 < held_out_fraction < 1:
        raise ConfigError(f"held_out_fraction must be between 0 and 1, got {held_out_fraction}")
    channels, height, width = input_shape
    steps = [transforms.Resize((height, width))]
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    # the usual ImageNet normalisation (per channel), so inputs look like what models train on
    mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if channels == 3 else ([0.5], [0.25])
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        folder = torchvision.datasets.ImageFolder(str(root), transform=transforms.Compose(steps))
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError(f"--data {root}: {exc}; the layout is DIR/<class name>/<image file>") from None
    num_classes = len(folder.classes)
    if max_classes is not None and num_classes > max_classes:
        raise ConfigError(f"--data {root} has {num_classes} classes but the model outputs {max_classes}; "
                          f"pass --num-classes {num_classes} (or a model with that many outputs)")
    by_class: dict[int, list[int]] = {}
    for index, (_, label) in enumerate(folder.samples):
        by_class.setdefault(label, []).append(index)
    g = torch.Generator().manual_seed(seed)
    train, held = [], []
    for label in sorted(by_class):
        indices = by_class[label]
        order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
        # at least one held-out image per class that has two or more
        n_held = min(len(order) - 1, max(1, round(held_out_fraction * len(order)))) if len(order) > 1 else 0
        held += order[:n_held]
        train += order[n_held:]
    if not held:
        raise ConfigError(f"--data {root}: every class has a single image, so nothing is left to hold out; "
                          "add at least two images to some class")
    return Datasets(train=Subset(folder, sorted(train)), held_out=Subset(folder, sorted(held)),
                    num_classes=num_classes,
                    source=f"ImageFolder {root}: {num_classes} classes, {len(train)} train / {len(held)} held-out "
                           f"images (seed {seed})")


def _check_folder(root: Path) -> None:
    if not root.exists():
        raise ConfigError(f"--data {root}: no such folder; give a folder of images in ImageFolder layout "
                          "(DIR/<class name>/<image file>) or package.module:factory")
    if not root.is_dir():
        raise ConfigError(f"--data {root} is a file, not a folder; the layout is DIR/<class name>/<image file>")
    classes = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    if not classes:
        raise ConfigError(f"--data {root} holds no class folders; the layout is DIR/<class name>/<image file>")
    if not any(f.suffix.lower() in IMAGE_SUFFIXES for d in classes for f in d.rglob("*") if f.is_file()):
        raise ConfigError(f"--data {root}: its class folders hold no images ({', '.join(IMAGE_SUFFIXES)}); "
                          "the layout is DIR/<class name>/<image file>")


def from_factory(target: str, *, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> Datasets:
    """Call ``package.module:factory`` with whichever of input_shape, num_classes and seed it takes."""
    factory = load_factory(target)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    offered = {"input_shape": tuple(input_shape), "num_classes": num_classes, "seed": seed}
    made = factory(**{k: v for k, v in offered.items() if k in params})
    if isinstance(made, Datasets):
        return made
    if isinstance(made, tuple) and len(made) == 2 and all(_is_dataset(d) or d is None for d in made) \
            and made[0] is not None:
        train, held = made
    elif _is_dataset(made):
        train, held = made, None
    else:
        raise ConfigError(f"--data {target!r} returned {type(made).__name__}; the factory must return "
                          "(train, held_out) datasets, one train dataset, or an autotune.workload.data.Datasets")
    for name, dataset in (("train", train), ("held-out", held)):
        if dataset is not None and len(dataset) == 0:
            raise ConfigError(f"--data {target!r}: its {name} dataset is empty")
    return Datasets(train=train, held_out=held, num_classes=None, source=f"factory {target}")


def _is_dataset(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def load_factory(target: str) -> Callable[..., Any]:
    """Import ``package.module:factory``; a clear error for each way that fails."""
    from autotune.workload.models import import_factory

    return import_factory(target, option="--data", error=ConfigError, returns="datasets",
                          example="mypkg.data:make_datasets, or give a folder of images")


def is_factory(spec: str) -> bool:
    """'pkg.module:factory' rather than a folder (a Windows drive letter is not a factory)."""
    return ":" in spec and not Path(spec).exists() and not (len(spec) > 1 and spec[1] == ":")


def check_data_spec(spec: str | None) -> None:
    """Fail early, before any device time, on a --data value that cannot work."""
    if spec is None:
        return
    if is_factory(spec):
        load_factory(spec)
    else:
        _check_folder(Path(spec))


def load_data(spec: str | None, *, input_shape: tuple[int, ...], num_classes: int, train_size: int,
              held_out_size: int, seed: int = 0, device: str | torch.device = "cpu") -> Datasets:
    """The datasets ``--data`` names: None (synthetic), a folder, or package.module:factory."""
    if spec is None:
        return synthetic(input_shape, num_classes, train_size=train_size, held_out_size=held_out_size,
                         seed=seed, device=device)
    if is_factory(spec):
        return from_factory(spec, input_shape=input_shape, num_classes=num_classes, seed=seed)
    return image_folder(spec, input_shape, seed=seed, max_classes=num_classes)


def batch_order(num_samples: int, batch_size: int, num_batches: int, seed: int) -> Iterator[list[int]]:
    """``num_batches`` lists of sample indices: epochs of seeded permutations, cut into batches.

    The same arguments always give the same order, which is what makes two training runs
    comparable ("same data order"). A dataset smaller than a batch is cycled within the batch.
    """
    if num_samples < 1:
        raise ConfigError("the training dataset is empty")
    g = torch.Generator().manual_seed(seed)
    pool: list[int] = []
    for _ in range(num_batches):
        while len(pool) < batch_size:
            pool += torch.randperm(num_samples, generator=g).tolist()
        yield pool[:batch_size]
        del pool[:batch_size]


def collate(dataset: Dataset, indices: list[int]) -> tuple[Any, torch.Tensor]:
    """The items at ``indices`` as one batch (as a DataLoader's default collate makes it)."""
    from torch.utils.data import default_collate

    inputs, labels = default_collate([dataset[i] for i in indices])
    return inputs, torch.as_tensor(labels)


def eval_batches(dataset: Dataset, batch_size: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """The whole dataset in order, in batches of ``batch_size`` (the last one may be smaller)."""
    for start in range(0, len(dataset), batch_size):
        yield collate(dataset, list(range(start, min(start + batch_size, len(dataset)))))
