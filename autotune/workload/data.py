"""Data for training checks: a train set and a held-out set, from one of three sources.

* default: a synthetic set generated locally at the model's input size (smooth random images
  labelled by a fixed random teacher network; no download), learnable but not in a few steps, so
  "does this configuration train as well as FP32?" has an answer on any model; a language model
  (a workload whose batches are tokens) gets sequences of a random Markov teacher instead
  (:func:`token_data`, used by autotune.accuracy.worker.check);
* ``--data DIR``: the user's images in ImageFolder layout (``DIR/<class>/<image>``), resized to the
  model's input size, with a deterministic per-class held-out split;
* ``--data package.module:factory``: a callable returning ``(train, held_out)`` datasets (or a
  :class:`Datasets`, or one train dataset when there is no held-out set).

Every source gives map-style ``torch.utils.data.Dataset`` objects whose items are ``(input,
label)``, so a ``DataLoader`` can read them too. :func:`batch_order` and :func:`collate` give the
deterministic batches the accuracy check feeds every configuration in the same order.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, Subset

from autotune.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MAX_SYNTHETIC_CLASSES = 10
"""Synthetic labels use at most this many classes (of the model's outputs)."""
LATENT_SIDE = 4
"""A synthetic image is a C x 4 x 4 Gaussian latent upsampled to the input size, and the teacher
labels the latent: the task is the same at any input size, and no network runs at 224x224. After
300 FP32 steps of 64 at 3x32x32 (MARGIN 0.8) an MLP reached 67% on 8 x 8 latents and 83% on 4 x 4,
a two-layer CNN 53% and 61%: a coarser latent is a task that more models learn."""
TEACHER_WIDTH = 32
"""Convolution filters (or hidden units) of the teacher (see Teacher)."""
TEACHER_KERNEL = 3
"""The teacher's filters see 3 x 3 latent cells (three quarters of the image): a pattern every
model that sees the whole image can learn. 1 x 1 filters (statistics of the pixels' colours) let a
two-layer CNN reach 84% but held an MLP to 55%, where 3 x 3 gave 61% and 83% (300 steps of 64,
MARGIN 0.8)."""
MARGIN = 0.5
"""A sample's latent is drawn again (up to 64 blocks of MARGIN_BLOCK) until the teacher's two
highest logits (of unit scale) differ by at least this much: no sample, trained on or held out, sits
on the boundary, where two FP32 runs disagree by chance. It sets the difficulty: after 300 steps of
64 (3x32x32) ResNet-18 reached 84.6% at 0.4, 89.8% at 0.6 and 94.6% at 0.8 (one seed each), and
86.2% at 0.5 (median of 3 seeds; scripts/teacher_calibration.py has the other models)."""
MARGIN_BLOCK = 16
"""Latents drawn at once while looking for one clear of the boundary (42% are, at MARGIN 0.5)."""
MAX_KEPT_LATENT = 4096
"""Latents of at most this many numbers are kept once drawn (SyntheticImages.latent); a wide
vector input's are drawn again."""
CALIBRATION_SAMPLES = 16384
"""Latents the teacher standardises its features and balances its classes on."""
BALANCE_ROUNDS = 20
"""Rounds of the class offsets' correction: each class then takes 9.3-10.9% of fresh latents' labels
(three seeds)."""
TOKEN_CLUSTERS = 16
"""Clusters of the token teacher's vocabulary (TeacherTokens). Of 1,003 tokens, 16 clusters let
tests/fake_models.py's TinyLM bring its held-out loss from 6.90 to 6.15 in 100 steps of 16, where
64 clusters left it at 6.49 (the chain's cycle is learnt sooner when it is shorter)."""
TOKEN_FOLLOW = 0.75
"""The token teacher's probability that the next cluster is the current one's successor."""
TOKEN_ZIPF = 1.0
"""Within a cluster, member m (from 1) is drawn with probability proportional to 1/m: the token
frequencies any language model learns first (with uniform members, in 64 clusters, TinyLM's
held-out loss moved from 6.91 to 6.87 in 300 steps of 64; with these, to 6.47)."""


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
    judged_by: str = "accuracy"
    """What judges a run on the held-out set: "accuracy" (the argmax against one label per sample)
    or "loss" (next tokens drawn from a teacher, where no one token is the right answer)."""


class Teacher:
    """A fixed random network that labels latents: for images ``TEACHER_WIDTH`` unit-norm
    convolution filters on the C x 4 x 4 latent, ReLU and the spatial mean; for other shapes a
    linear layer and ReLU. Its labels are the argmax over the vertices of a regular simplex of the
    features' leading principal components, each standardised, so every class has the same share
    and the same neighbours, and the difficulty is that of those components, stable across seeds (a
    random head over 8 random features gave an MLP 43% held-out accuracy on one seed and 78% on
    another; this head 45.5-47.1% on three). Made from a CPU generator: the same labels on every
    device."""

    def __init__(self, latent: tuple[int, ...], num_classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(_mix(seed, 0, -3))
        self.image = len(latent) == 3
        k = TEACHER_KERNEL
        shape = (TEACHER_WIDTH, latent[0], k, k) if self.image else (TEACHER_WIDTH, math.prod(latent))
        weight = torch.randn(shape, generator=g)
        self.weight = weight / weight.flatten(1).norm(dim=1).view(-1, *[1] * (weight.dim() - 1))
        sample = torch.randn((CALIBRATION_SAMPLES, *latent), generator=g)
        features = self._features(sample)
        self.mean = features.mean(0)
        values, vectors = torch.linalg.eigh(torch.cov((features - self.mean).T))
        dims = max(1, num_classes - 1)
        top = vectors[:, -dims:] / values[-dims:].clamp_min(1e-6 * float(values[-1])).sqrt()  # standardised
        # an orthonormal basis of the sum-zero subspace of R^classes: its rows are simplex vertices
        basis = torch.linalg.qr(torch.eye(num_classes) - 1.0 / num_classes)[0][:, :dims].T
        self.head = top @ basis if num_classes > 1 else top
        self.offset = torch.zeros(self.head.shape[1])
        logits = self.logits(sample)
        # lower the logits of a class that takes more than its share, until the shares are even
        # (of the latents a sample keeps: those at least MARGIN from the boundary)
        for _ in range(BALANCE_ROUNDS):
            self.shares = self._shares(logits, num_classes)
            step = 0.5 * torch.log((self.shares + 1e-3) * num_classes) * logits.std()
            self.offset += step
            logits -= step
        self.shares = self._shares(logits, num_classes)
        """Each class's share of the calibration latents' labels, among those kept."""

    @staticmethod
    def _shares(logits: torch.Tensor, num_classes: int) -> torch.Tensor:
        labels = logits.argmax(1)[clear(logits)] if num_classes > 1 else logits.argmax(1)
        return torch.bincount(labels, minlength=num_classes).float() / max(1, len(labels))

    def _features(self, z: torch.Tensor) -> torch.Tensor:
        if self.image:
            return torch.relu(torch.nn.functional.conv2d(z, self.weight, padding=TEACHER_KERNEL // 2)).mean(dim=(2, 3))
        return torch.relu(z.flatten(1) @ self.weight.T)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """(N, *latent) latents -> (N, classes) logits; the label is their argmax."""
        return (self._features(z) - self.mean) @ self.head - self.offset


class SyntheticImages(Dataset):
    """A classification set labelled by a fixed random :class:`Teacher`: sample ``i`` is a smooth
    low-frequency random field (a C x 4 x 4 Gaussian latent, upsampled bilinearly to the input size
    and scaled to unit variance; a Gaussian vector for non-image shapes), its label the teacher's
    argmax on the latent, so the label is a function of what the model sees: learnable, but not in a
    few steps (see MARGIN). Latents and labels come from CPU generators, a pure function of (seed,
    split, i): the same on every device (the upsampling runs on ``device``, equal to rounding).
    Items are made on demand, so a set of any size costs no memory; an item costs the teacher on
    a block of 4x4 latents and one upsampling, never a network at the input size."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, size: int, *, seed: int = 0,
                 split: int = 0, device: str | torch.device = "cpu", teacher: Teacher | None = None) -> None:
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
        self.latent_shape = latent_shape(self.input_shape)
        self.teacher = teacher if teacher is not None else teacher_of(self.latent_shape, num_classes, seed)
        self._drawn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        field = self._upsampled(torch.randn((64, *self.latent_shape), generator=torch.Generator().manual_seed(seed)))
        self.gain = 1.0 / float(field.std())

    def _upsampled(self, z: torch.Tensor) -> torch.Tensor:
        if len(self.input_shape) != 3 or z.shape[-2:] == self.input_shape[-2:]:
            return z
        return torch.nn.functional.interpolate(z, size=self.input_shape[-2:], mode="bilinear", align_corners=False)

    def latent(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index``'s latent (on the CPU), the first of its draws clear of the teacher's
        boundary, and its label. Kept once drawn (48 numbers a sample): the check's FP32 reference,
        its reshuffled twin and the configuration read the same samples, and drawing one took 0.12 ms
        on a CPU core, 6 times the old templates' sample."""
        if index in self._drawn:
            return self._drawn[index]
        drawn = self._draw(index)
        if math.prod(self.latent_shape) <= MAX_KEPT_LATENT:
            self._drawn[index] = drawn
        return drawn

    def _draw(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_mix(self.seed, self.split, index))
        for _ in range(64):
            z = torch.randn((MARGIN_BLOCK, *self.latent_shape), generator=g)
            logits = self.teacher.logits(z)
            kept = clear(logits).nonzero() if self.num_classes > 1 else torch.zeros((1, 1), dtype=torch.long)
            if len(kept):
                break
        first = int(kept[0]) if len(kept) else 0
        return z[first], logits[first].argmax()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for a synthetic set of {self.size}")
        z, label = self.latent(index % self.size)
        x = self._upsampled(z[None].to(self.device))[0] * self.gain
        return x, label.to(self.device)


@functools.lru_cache(maxsize=8)
def teacher_of(latent: tuple[int, ...], num_classes: int, seed: int) -> Teacher:
    """The Teacher of (latent shape, classes, seed), built once a process (0.16 s on a CPU core):
    a check builds its data for each worker request, a test process for many checks."""
    return Teacher(latent, num_classes, seed)


def latent_shape(input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """C x 4 x 4 (or smaller) for an image of C x H x W; the input's own shape for anything else."""
    if len(input_shape) == 3:
        channels, height, width = input_shape
        return (channels, min(height, LATENT_SIDE), min(width, LATENT_SIDE))
    return tuple(input_shape)


def clear(logits: torch.Tensor) -> torch.Tensor:
    """Which rows of (N, classes) logits are at least MARGIN from the teacher's boundary."""
    top = logits.topk(2, dim=1).values
    return top[:, 0] - top[:, 1] >= MARGIN


def _mix(seed: int, split: int, index: int) -> int:
    """A distinct 63-bit generator seed per (seed, split, index)."""
    return (seed * 1_000_003 + split * 7_919 + index * 2_654_435_761 + 12_345) % (2**63 - 1)


def synthetic(input_shape: tuple[int, ...], num_classes: int, *, train_size: int, held_out_size: int,
              seed: int = 0, device: str | torch.device = "cpu") -> Datasets:
    """The default data: a set labelled by a fixed random teacher at the model's input size (no
    downloads). Labels use ``min(num_classes, MAX_SYNTHETIC_CLASSES)`` of the model's classes."""
    used = min(num_classes, MAX_SYNTHETIC_CLASSES)
    shape = "x".join(str(d) for d in input_shape)
    teacher = teacher_of(latent_shape(tuple(input_shape)), used, seed)  # one for both splits
    return Datasets(
        train=SyntheticImages(input_shape, used, train_size, seed=seed, split=0, device=device, teacher=teacher),
        held_out=SyntheticImages(input_shape, used, held_out_size, seed=seed, split=1, device=device,
                                 teacher=teacher),
        num_classes=used,
        source=f"synthetic: {used} classes labelled by a fixed random teacher at {shape}, seed {seed}",
    )


class TeacherTokens(Dataset):
    """Token sequences of a fixed random Markov teacher, learnable in a short run at any vocabulary:
    the vocabulary is cut into ``TOKEN_CLUSTERS`` random clusters of equal size (a remainder of
    tokens never occurs); the next token's cluster is its token's cluster's successor on a fixed
    cycle with probability ``TOKEN_FOLLOW``, else any cluster, and the token within the cluster is
    uniform. A model learns each token's cluster and the cycle, so its held-out loss falls from the
    uniform entropy ln(vocab) towards the teacher's (``entropy``). The chain is drawn without a
    loop over positions (a cluster is its last fresh draw plus the steps since), so an item of 1,024
    tokens costs a few vectorised operations. Sample ``i`` is a pure function of (seed, split, i),
    from CPU generators: the same on every device."""

    def __init__(self, vocab_size: int, seq_len: int, size: int, *, seed: int = 0, split: int = 0,
                 shifted: bool = True, dtype: torch.dtype = torch.long) -> None:
        if size < 1 or vocab_size < 1 or seq_len < 1:
            raise ConfigError(f"a token teacher needs a sample, a token and a position, got size={size}, "
                              f"vocab_size={vocab_size}, seq_len={seq_len}")
        self.vocab_size, self.seq_len, self.size = vocab_size, seq_len, size
        self.seed, self.split, self.shifted, self.dtype = seed, split, shifted, dtype
        self.clusters = min(TOKEN_CLUSTERS, vocab_size)
        self.per_cluster = vocab_size // self.clusters
        # token of (cluster c, member m): tokens[c * per_cluster + m]
        self.tokens = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(_mix(seed, 0, -4)))
        weights = 1.0 / torch.arange(1, self.per_cluster + 1, dtype=torch.float64) ** TOKEN_ZIPF
        self.member_p = weights / weights.sum()
        self.member_cdf = self.member_p.cumsum(0).float()

    @property
    def entropy(self) -> float:
        """The teacher's next-token entropy in nats: the lowest expected held-out loss."""
        k = self.clusters
        follow = TOKEN_FOLLOW + (1 - TOKEN_FOLLOW) / k
        other = (1 - follow) / (k - 1) if k > 1 else 0.0
        cluster = -follow * math.log(follow) - (k - 1) * other * math.log(other) if other > 0 else 0.0
        return cluster - float((self.member_p * self.member_p.log()).sum())

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for a token set of {self.size}")
        g = torch.Generator().manual_seed(_mix(self.seed, self.split, index % self.size))
        n = self.seq_len + 1 if self.shifted else self.seq_len
        fresh = torch.rand(n, generator=g) >= TOKEN_FOLLOW
        fresh[0] = True
        start = torch.randint(0, self.clusters, (n,), generator=g)
        member = torch.searchsorted(self.member_cdf, torch.rand(n, generator=g)).clamp_max(self.per_cluster - 1)
        position = torch.arange(n)
        last = torch.cummax(torch.where(fresh, position, 0), dim=0).values  # the last fresh draw
        cluster = (start[last] + position - last) % self.clusters
        t = self.tokens[cluster * self.per_cluster + member].to(self.dtype)
        return (t[:-1], t[1:]) if self.shifted else (t, t.clone())


def token_data(vocab_size: int, seq_len: int, *, train_size: int, held_out_size: int, seed: int = 0,
               shifted: bool = True, dtype: torch.dtype = torch.long) -> Datasets:
    """A language model's check data: TeacherTokens sequences, a held-out split, judged by loss."""
    train = TeacherTokens(vocab_size, seq_len, train_size, seed=seed, split=0, shifted=shifted, dtype=dtype)
    held = TeacherTokens(vocab_size, seq_len, held_out_size, seed=seed, split=1, shifted=shifted, dtype=dtype)
    return Datasets(train=train, held_out=held, num_classes=vocab_size, judged_by="loss",
                    source=f"synthetic: sequences of {seq_len} tokens from a fixed random Markov teacher over "
                           f"{vocab_size} tokens in {train.clusters} clusters (entropy {train.entropy:.2f} nats a "
                           f"token, uniform {math.log(vocab_size):.2f}), {held_out_size} held-out, seed {seed}")


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
