"""data=tokens: nanoGPT's token files. Each split is one flat file of token ids (`train.bin`,
`val.bin`, optionally `test.bin`; uint16 as nanoGPT writes them, or uint32 for token ids past
65,535) read through a memmap, so a file of any size costs no memory. `lightfleet prepare-data`
writes them from text, with a meta.yaml beside them: data=tokens takes its vocab_size and dtype
when data.vocab_size and data.dtype are not set, and refuses a data.dtype that differs.

A sample is a window of seq_len + 1 tokens; batches are `(tokens[:, :-1], tokens[:, 1:])`, as the
built-in language-model data's. Training windows are `random` (nanoGPT's: any start, drawn anew
every epoch) or `sequential` (the file cut into consecutive windows, shuffled every epoch);
validation and test windows are consecutive, in order, split over the data-parallel ranks. The
training windows come from (the run's seed, the epoch) in lightfleet's global order
(runner/data/order.py): a run resumed mid-epoch, on any number of processes, continues with the
global batch it would have drawn next.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytorch_lightning as pl
import torch
import yaml
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from runner.config.values import check_values
from runner.data.loading import stateful_loader
from runner.data.order import GlobalOrder, replicas, run_seed
from runner.data.prepare import DTYPES, META_YAML

WINDOWS = ("random", "sequential")


def check_token_file(name: str, path: str, dtype: str, seq_len: int) -> int:
    """The number of tokens in the file at `path`; ValueError("name=path: why") when it cannot
    serve windows of seq_len + 1 tokens (the command names the config key)."""
    check_values(**{name: path})
    file = Path(path).expanduser()
    size, itemsize = file.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ValueError(f"{name}={path}: {size} bytes is not a whole number of {dtype} tokens ({itemsize} bytes "
                         f"each): another dtype (data.dtype), or a truncated file")
    tokens = size // itemsize
    require_window(seq_len, tokens, f"{name} ({path})")
    return tokens


def require_window(seq_len: int, num_tokens: int, split: str) -> None:
    """ValueError("seq_len=...: why") when `split` (named so in the message) holds fewer tokens
    than a window of seq_len + 1."""
    if num_tokens < seq_len + 1:
        raise ValueError(f"seq_len={seq_len}: longer than {split} allows: it holds {num_tokens} tokens and a window "
                         f"needs seq_len + 1")


def token_file_meta(train_bin: str) -> dict:
    """The meta.yaml beside `train_bin` that prepare-data writes (its vocab_size and dtype); {}
    when there is none."""
    path = Path(train_bin).expanduser().parent / META_YAML
    if not path.is_file():
        return {}
    meta = yaml.safe_load(path.read_text())
    if not (isinstance(meta, dict) and meta.get("dtype") in DTYPES and isinstance(meta.get("vocab_size"), int)):
        raise ValueError(f"train_bin={train_bin}: the {META_YAML} beside it is not prepare-data's (a vocab_size and a "
                         f"dtype, one of {', '.join(DTYPES)}): remove it, or write the files again")
    return meta


class TokenWindows(Dataset):
    """The windows of a flat array of token ids, by start position: item `start` is
    (tokens[start : start + seq_len], tokens[start + 1 : start + seq_len + 1]) as int64."""

    def __init__(self, num_tokens: int, seq_len: int) -> None:
        self.num_tokens, self.seq_len = num_tokens, seq_len

    def tokens(self) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.num_tokens - self.seq_len  # the number of possible starts

    def __getitem__(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.tokens()[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class TokenArray(TokenWindows):
    """The windows of token ids in memory (data=hf_text's)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        super().__init__(len(tokens), seq_len)
        self.array = tokens

    @override
    def tokens(self) -> np.ndarray:
        return self.array


class TokenFile(TokenWindows):
    """The windows of one token file, read through a memmap."""

    def __init__(self, path: str, dtype: str, seq_len: int) -> None:
        self.path, self.dtype = str(Path(path).expanduser()), dtype
        super().__init__(Path(self.path).stat().st_size // np.dtype(DTYPES[dtype]).itemsize, seq_len)
        self._tokens: Optional[np.memmap] = None  # opened in the process that reads (a loader worker)

    @override
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # workers open their own memmap


def window_starts(data: TokenWindows, windows: str, count: int, shuffle: bool, generator: torch.Generator) -> torch.Tensor:
    """An epoch's `count` window starts, drawn from `generator` alone: `random` anywhere,
    `sequential` the file cut into consecutive windows, shuffled or in order."""
    if windows == "random":
        return torch.randint(len(data), (count,), generator=generator)
    order = torch.randperm(count, generator=generator) if shuffle else torch.arange(count)
    return order * (data.seq_len + 1)


def windows_per_epoch(data: TokenWindows, windows: str, samples: int) -> int:
    """How many windows an epoch draws: `samples` random ones, or every consecutive one."""
    return data.num_tokens // (data.seq_len + 1) if windows == "sequential" else samples


class TrainingWindows(GlobalOrder):
    """This rank's window starts of a training epoch: the epoch's starts (window_starts) in
    lightfleet's global order, the same global batches on any number of processes."""

    def __init__(self, data: TokenWindows, windows: str, samples: int, *, batch_size: int, seed: int,
                 trainer: Optional[pl.Trainer]) -> None:
        self.windows, self.samples = windows, samples
        super().__init__(data, batch_size=batch_size, seed=seed, trainer=trainer)

    @override
    def order_length(self) -> int:
        return windows_per_epoch(self.dataset, self.windows, self.samples)

    @override
    def epoch_order(self, generator: torch.Generator) -> torch.Tensor:
        return window_starts(self.dataset, self.windows, self.order_length(), True, generator)


class EvaluationWindows(DistributedSampler):
    """This rank's consecutive windows of a validation or test split, in order: every
    num_replicas-th from its rank on, the windows cut to a multiple of num_replicas so that every
    rank has as many batches."""

    def __init__(self, data: TokenWindows, num_replicas: int, rank: int) -> None:
        super().__init__(data, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=True)
        self.num_samples = windows_per_epoch(data, "sequential", 0) // num_replicas
        self.total_size = self.num_samples * num_replicas

    @override
    def __iter__(self) -> Iterator[int]:
        starts = window_starts(self.dataset, "sequential", self.total_size, False, torch.Generator())
        yield from starts[self.rank :: self.num_replicas].tolist()

    @override
    def __len__(self) -> int:
        return self.num_samples


class TokenWindowData(pl.LightningDataModule):
    """Splits of token ids served as windows of seq_len + 1 tokens in lightfleet's global order: training
    `windows` of the train split; validation and test windows consecutive, in order. The base of
    data=tokens (token files) and data=hf_text (tokens in memory)."""

    TEST_KNOB = "test"  # the knob that names the test split, for the test stage's refusal

    def __init__(self, seq_len: int, windows: str, samples_per_epoch: int, batch_size: int, num_workers: int,
                 pin_memory: bool, vocab_size: Optional[int]) -> None:
        super().__init__()
        self.seq_len, self.windows, self.samples_per_epoch = seq_len, windows, samples_per_epoch
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.vocab_size = vocab_size  # the tokenizer's, when known: the command checks it against the model's

    def windows_of(self, split: str) -> Optional[TokenWindows]:
        """The windows of split `train`, `val` or `test` (None: there is no test split)."""
        raise NotImplementedError

    @property
    def tokens_per_sample(self) -> int:
        """Tokens a sample trains on: the run measures tokens/s from it."""
        return self.seq_len

    def _loader(self, data: TokenWindows, sampler: DistributedSampler) -> DataLoader:
        return stateful_loader(data, self.trainer, batch_size=self.batch_size, sampler=sampler,
                               num_workers=self.num_workers, pin_memory=self.pin_memory)

    def _evaluation_loader(self, data: TokenWindows) -> DataLoader:
        return self._loader(data, EvaluationWindows(data, **replicas(self.trainer)))

    @override
    def train_dataloader(self) -> DataLoader:
        train = self.windows_of("train")
        return self._loader(train, TrainingWindows(train, self.windows, self.samples_per_epoch,
                                                   batch_size=self.batch_size, seed=run_seed(), trainer=self.trainer))

    @override
    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self.windows_of("val"))

    @override
    def test_dataloader(self) -> DataLoader:
        test = self.windows_of("test")
        if test is None:
            raise ValueError(f"{self.TEST_KNOB}=None: the test stage needs a test split (data.{self.TEST_KNOB})")
        return self._evaluation_loader(test)


class TokenFileData(TokenWindowData):
    """nanoGPT's token files as train/val(/test) splits of windows of seq_len + 1 tokens."""

    TEST_KNOB = "test_bin"

    def __init__(
        self,
        train_bin: str,
        val_bin: str,
        test_bin: Optional[str] = None,
        dtype: Optional[str] = None,
        seq_len: int = 1024,
        windows: str = "random",
        samples_per_epoch: Optional[int] = None,
        batch_size: int = 12,
        num_workers: int = 0,
        pin_memory: bool = True,
        vocab_size: Optional[int] = None,
    ) -> None:
        check_values(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers,
                     samples_per_epoch=samples_per_epoch, vocab_size=vocab_size)
        meta = token_file_meta(train_bin)
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be one of {', '.join(DTYPES)}")
        if dtype is not None and meta and dtype != meta["dtype"]:
            raise ValueError(f"dtype={dtype}: the {META_YAML} beside train_bin says {meta['dtype']} (leave data.dtype "
                             f"unset to take it)")
        dtype = dtype or meta.get("dtype", "uint16")
        if windows not in WINDOWS:
            raise ValueError(f"windows={windows}: must be one of {', '.join(WINDOWS)}")
        splits = {"train_bin": train_bin, "val_bin": val_bin, **({"test_bin": test_bin} if test_bin else {})}
        self.num_tokens = {name: check_token_file(name, path, dtype, seq_len) for name, path in splits.items()}
        # nanoGPT's epoch: as many random windows as the file has consecutive ones.
        super().__init__(seq_len, windows, samples_per_epoch or self.num_tokens["train_bin"] // (seq_len + 1),
                         batch_size, num_workers, pin_memory, vocab_size or meta.get("vocab_size"))
        self.paths, self.dtype = splits, dtype

    @override
    def windows_of(self, split: str) -> Optional[TokenWindows]:
        path = self.paths.get(f"{split}_bin")
        return None if path is None else TokenFile(path, self.dtype, self.seq_len)
