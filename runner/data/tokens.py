"""data=tokens: nanoGPT's token files. Each split is one flat file of token ids (`train.bin`,
`val.bin`, optionally `test.bin`; uint16 as nanoGPT writes them, or uint32 for vocabularies past
65,535) read through a memmap, so a file of any size costs no memory. `lightfleet prepare-data`
writes them from text.

A sample is a window of seq_len + 1 tokens; batches are `(tokens[:, :-1], tokens[:, 1:])`, as the
built-in language-model data's. Training windows are `random` (nanoGPT's: any start, drawn anew
every epoch) or `sequential` (the file cut into consecutive windows, shuffled every epoch);
validation and test windows are consecutive, in order. Both orders come from (the run's seed,
the epoch) and are split over the data-parallel ranks, so a run resumed mid-epoch continues
with the window it would have drawn next.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from runner.core.errors import require_at_least
from runner.data import replicas, run_seed

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
WINDOWS = ("random", "sequential")


def check_token_file(name: str, path: str, dtype: str, seq_len: int) -> int:
    """The number of tokens in the file at `path`; ValueError("name=path: why") when it cannot
    serve windows of seq_len + 1 tokens (the command names the config key)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{name}={path}: no such file (a flat file of {dtype} token ids, as "
                         f"`lightfleet prepare-data` writes)")
    size, itemsize = file.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ValueError(f"{name}={path}: {size} bytes is not a whole number of {dtype} tokens ({itemsize} bytes "
                         f"each): another dtype (data.dtype), or a truncated file")
    tokens = size // itemsize
    if tokens < seq_len + 1:
        raise ValueError(f"seq_len={seq_len}: longer than {name} ({path}) allows: it holds {tokens} tokens and a "
                         f"window needs seq_len + 1")
    return tokens


class TokenFile(Dataset):
    """The windows of one token file, by start position: item `start` is (tokens[start : start +
    seq_len], tokens[start + 1 : start + seq_len + 1]) as int64."""

    def __init__(self, path: str, dtype: str, seq_len: int) -> None:
        self.path, self.dtype, self.seq_len = str(Path(path).expanduser()), dtype, seq_len
        self.num_tokens = Path(self.path).stat().st_size // np.dtype(DTYPES[dtype]).itemsize
        self._tokens: Optional[np.memmap] = None  # opened in the process that reads (a loader worker)

    def __len__(self) -> int:
        return self.num_tokens - self.seq_len  # the number of possible starts

    def __getitem__(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # workers open their own memmap


class WindowStarts(DistributedSampler):
    """This rank's window starts of one epoch, drawn when the first is (a resumed run's loader is
    made before Lightning sets the epoch): `random` draws `samples` starts anywhere, `sequential`
    cuts the file into consecutive windows, shuffled or in order. Every rank draws the same
    epoch's list from (seed, epoch) and takes every num_replicas-th from its rank on; the list is
    cut to a multiple of num_replicas, so every rank has as many batches."""

    def __init__(self, data: TokenFile, windows: str, samples: int, shuffle: bool, seed: int, num_replicas: int,
                 rank: int) -> None:
        super().__init__(data, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.windows = windows
        consecutive = data.num_tokens // (data.seq_len + 1) if windows == "sequential" else samples
        self.num_samples = consecutive // num_replicas
        self.total_size = self.num_samples * num_replicas

    @override
    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.windows == "random":
            starts = torch.randint(len(self.dataset), (self.total_size,), generator=generator)
        else:
            order = torch.randperm(self.total_size, generator=generator) if self.shuffle else torch.arange(self.total_size)
            starts = order * (self.dataset.seq_len + 1)
        yield from starts[self.rank :: self.num_replicas].tolist()

    @override
    def __len__(self) -> int:
        return self.num_samples


class TokenFileData(pl.LightningDataModule):
    """nanoGPT's token files as train/val(/test) splits of windows of seq_len + 1 tokens."""

    def __init__(
        self,
        train_bin: str,
        val_bin: str,
        test_bin: Optional[str] = None,
        dtype: str = "uint16",
        seq_len: int = 1024,
        windows: str = "random",
        samples_per_epoch: Optional[int] = None,
        batch_size: int = 12,
        num_workers: int = 0,
        pin_memory: bool = True,
        vocab_size: Optional[int] = None,
    ) -> None:
        require_at_least(1, seq_len=seq_len, batch_size=batch_size)
        require_at_least(0, num_workers=num_workers)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be one of {', '.join(DTYPES)}")
        if windows not in WINDOWS:
            raise ValueError(f"windows={windows}: must be one of {', '.join(WINDOWS)}")
        super().__init__()
        splits = {"train_bin": train_bin, "val_bin": val_bin, **({"test_bin": test_bin} if test_bin else {})}
        self.num_tokens = {name: check_token_file(name, path, dtype, seq_len) for name, path in splits.items()}
        if samples_per_epoch is not None:
            require_at_least(1, samples_per_epoch=samples_per_epoch)
        self.paths, self.dtype, self.seq_len, self.windows = splits, dtype, seq_len, windows
        # nanoGPT's epoch: as many random windows as the file has consecutive ones.
        self.samples_per_epoch = samples_per_epoch or self.num_tokens["train_bin"] // (seq_len + 1)
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.vocab_size = vocab_size  # the tokenizer's, when known: the command checks it against the model's

    @property
    def tokens_per_sample(self) -> int:
        """Tokens a sample trains on: the run measures tokens/s from it."""
        return self.seq_len

    def _loader(self, split: str, windows: str, shuffle: bool) -> DataLoader:
        data = TokenFile(self.paths[split], self.dtype, self.seq_len)
        sampler = WindowStarts(data, windows, self.samples_per_epoch, shuffle, run_seed(), **replicas(self.trainer))
        sampler.set_epoch(self.trainer.current_epoch if self.trainer and split == "train_bin" else 0)
        return StatefulDataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                                  pin_memory=self.pin_memory and torch.cuda.is_available(),
                                  persistent_workers=self.num_workers > 0)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train_bin", self.windows, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val_bin", "sequential", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        if "test_bin" not in self.paths:
            raise ValueError("test_bin=None: the test stage needs a test split (data.test_bin)")
        return self._loader("test_bin", "sequential", shuffle=False)
