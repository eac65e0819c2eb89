"""Tiny data files the tests make on the fly (nothing is downloaded): token files from numpy and
a folder of generated PNGs in ImageFolder's layout."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def token_file(path: Path, num_tokens: int, dtype=np.uint16) -> Path:
    """Token ids 0, 1, 2, ... (mod 50000): a window's first token is its start."""
    (np.arange(num_tokens) % 50000).astype(dtype).tofile(path)
    return path


def image_folder(root: Path, per_class: int = 6, size: int = 40) -> Path:
    """ROOT/{train,val}/{dark,light}/*.png: noise around a dark or a light grey, told apart by
    their mean."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label, level in (("dark", 60), ("light", 190)):
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for index in range(per_class):
                pixels = np.clip(rng.normal(level, 30, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{index}.png")
    return root
