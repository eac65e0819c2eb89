"""The built-in data: learnable synthetic tasks as LightningDataModules (nothing to download,
nothing on disk; synthetic.py), and the field's file formats (tokens.py: nanoGPT's token files,
images.py: an ImageFolder tree, hf_text.py: Hugging Face datasets and text files; prepare.py:
`lightfleet prepare-data`, text into token files).

Each synthetic data module draws its whole data set from a `torch.Generator` seeded by `seed`,
so every process of a distributed run builds identical data whatever the global RNG state.
Every training epoch, synthetic or of files, is lightfleet's global order (order.py): one order of
the whole data drawn from the run's seed and the epoch alone, cut into global batches of exactly
G = data-parallel processes x batch_size x accumulation, unit j (batch_size consecutive samples)
of each going to data-parallel rank j mod D; the last `len % G` samples of each epoch's order sit
that epoch out. So a global batch holds the same samples, in the same micro-batches, on any
number of processes, and a run resumed mid-epoch, on any number, continues with the global batch
it would have trained next.

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
