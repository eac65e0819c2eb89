"""The built-in data: learnable synthetic tasks as LightningDataModules (nothing to download,
nothing on disk; synthetic.py), and the field's file formats (tokens.py: nanoGPT's token files,
images.py: an ImageFolder tree, hf_text.py: Hugging Face datasets and text files; prepare.py:
`lightfleet prepare-data`, text into token files).

Each synthetic data module draws its whole data set from a `torch.Generator` seeded by `seed`,
so every process of a distributed run builds identical data whatever the global RNG state.
Every training order, synthetic or of files, comes from the run's seed and the epoch alone
(order.py), and every loader is stateful: a run resumed mid-epoch continues with the batch it
would have drawn next.

The package itself imports nothing: `lightfleet prepare-data` runs without torch or Lightning.
Its names (`runner.data.SyntheticClassificationData`, as conf/data/ names them) load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

# The package's names and the module each lives in.
HOMES = {
    "GlobalOrder": "order",
    "global_order": "order",
    "run_seed": "order",
    "replicas": "order",
    "CLASS_SIGNAL": "synthetic",
    "SplitData": "synthetic",
    "SyntheticClassificationData": "synthetic",
    "SyntheticLanguageModelData": "synthetic",
}


def __getattr__(name: str) -> Any:
    if name not in HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{HOMES[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *HOMES])
