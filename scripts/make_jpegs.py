"""Write a folder of real JPEG images in ImageFolder layout (DIR/<class>/<image>.jpg), to try
`autotune search --data DIR` on a data pipeline that decodes JPEGs as a real one does.

    python3 scripts/make_jpegs.py /tmp/jpegs                      # 3000 images, 10 classes, 256x256
    python3 scripts/make_jpegs.py /tmp/jpegs --num-images 2000 --size 224 --classes 10

Each class has its own look (a stripe orientation and frequency, a colour cast), and every image
varies it (phase, amplitude, a random blob, pixel noise), so a model learns the classes and the
JPEG decoder sees photo-like entropy rather than flat colour. Images are written in parallel.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def class_look(label: int, num_classes: int) -> tuple[float, float, np.ndarray]:
    """A class's stripe angle (radians), stripe frequency (cycles per image) and RGB cast."""
    angle = math.pi * label / num_classes
    frequency = 3.0 + 2.0 * (label % 4)
    cast = np.random.default_rng(10_000 + label).uniform(-60, 60, size=3)
    return angle, frequency, cast


def render(label: int, index: int, num_classes: int, size: int, seed: int) -> np.ndarray:
    """One size x size RGB image (uint8) of class ``label``."""
    rng = np.random.default_rng([seed, label, index])
    angle, frequency, cast = class_look(label, num_classes)
    angle += rng.normal(0, 0.08)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    phase = rng.uniform(0, 2 * math.pi)
    stripes = np.sin(2 * math.pi * frequency * (x * math.cos(angle) + y * math.sin(angle)) + phase)
    image = 128 + rng.uniform(40, 70) * stripes[..., None] + cast[None, None, :]
    # a soft blob somewhere, of a random colour: content that varies within a class
    cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.08, 0.25)
    blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
    image += blob[..., None] * rng.uniform(-80, 80, size=3)[None, None, :]
    image += rng.normal(0, 12, size=image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def _write_chunk(args: tuple[str, list[tuple[int, int]], int, int, int, int]) -> int:
    root, items, num_classes, size, seed, quality = args
    for label, index in items:
        path = Path(root) / f"class{label:02d}" / f"img{index:05d}.jpg"
        Image.fromarray(render(label, index, num_classes, size, seed)).save(path, "JPEG", quality=quality)
    return len(items)


def make_jpegs(root: str | Path, *, num_images: int = 3000, num_classes: int = 10, size: int = 256,
               seed: int = 0, quality: int = 90, jobs: int | None = None) -> int:
    """Write ``num_images`` JPEGs (spread evenly over ``num_classes`` folders) under ``root``;
    returns how many were written."""
    if num_images < num_classes or num_classes < 1:
        raise ValueError(f"need at least one image per class: {num_images} images for {num_classes} classes")
    if size < 8:
        raise ValueError(f"--size {size} is too small for a JPEG worth decoding; use 32 or more")
    root = Path(root)
    for label in range(num_classes):
        (root / f"class{label:02d}").mkdir(parents=True, exist_ok=True)
    items = [(i % num_classes, i // num_classes) for i in range(num_images)]
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = max(1, jobs)
    chunks = [items[i::jobs * 4] for i in range(jobs * 4)]
    work = [(str(root), chunk, num_classes, size, seed, quality) for chunk in chunks if chunk]
    if jobs == 1:
        return sum(map(_write_chunk, work))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return sum(pool.map(_write_chunk, work))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder to write (created if missing)")
    parser.add_argument("--num-images", type=int, default=3000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--size", type=int, default=256, help="width and height in pixels (default 256)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, help="processes writing images (default: every CPU)")
    args = parser.parse_args(argv)
    try:
        n = make_jpegs(args.out, num_images=args.num_images, num_classes=args.classes, size=args.size,
                       seed=args.seed, quality=args.quality, jobs=args.jobs)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {n} JPEGs in {args.classes} classes to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
