"""The synthetic data: learnable tasks as LightningDataModules, nothing to download, nothing on
disk (data=classification, data=images, data=language_model).

Each data module draws its whole data set from a `torch.Generator` seeded by `seed`, so every
process of a distributed run builds identical data whatever the global RNG state.
"""
from __future__ import annotations

from typing import Optional, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from runner.config.values import check_values
from runner.data.loading import Workers, check_workers, stateful_loader
from runner.data.order import global_order


# Scale of the class prototypes against the unit noise: an MLP passes 90% accuracy within
# ~50 steps, yet a flat input stays ambiguous often enough that accuracy stays below 100%.
CLASS_SIGNAL = 0.5


class SplitData(pl.LightningDataModule):
    """Holds the train/val/test TensorDatasets built by `make_datasets` and serves them
    (runner/data/loading.py: pinned batches and, with num_workers=auto, loader workers on CUDA)."""

    def __init__(self, batch_size: int, seed: int, num_workers: Workers, pin_memory: bool) -> None:
        check_values(batch_size=batch_size)
        check_workers(num_workers)
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None
        self.test_set: Optional[TensorDataset] = None

    def make_datasets(self, generator: torch.Generator) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        """Build (train, val, test) with `generator` as the only source of randomness."""
        raise NotImplementedError

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self.make_datasets(torch.Generator().manual_seed(self.seed))

    def _loader(self, dataset: TensorDataset, **options) -> DataLoader:
        return stateful_loader(dataset, self.trainer, batch_size=self.batch_size, num_workers=self.num_workers,
                               pin_memory=self.pin_memory, **options)

    @override
    def train_dataloader(self) -> DataLoader:
        # Resumable bit for bit, on any number of processes: lightfleet's global order
        # (runner/data/order.py), from (the run's seed, the epoch) alone, never the global RNG.
        return self._loader(self.train_set, sampler=global_order(self.trainer, self.train_set, self.batch_size))

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)


class SyntheticClassificationData(SplitData):
    """Gaussian noise of `input_shape` plus a fixed random offset chosen by the label.

    Labels are uniform over `num_classes`. Each class owns a fixed random "prototype": one
    offset per channel (the first dimension of `input_shape`: a flat vector [32] has 32
    one-value channels, an image [3, 16, 16] has 3), added at every position. The class is
    thus visible to a linear probe of a flat vector (an MLP) and in the per-channel means of
    an image (a CNN's global average pool), while the N(0, 1) noise keeps it from being
    trivial. (Labelling pure noise with a random teacher instead is fine for an MLP but
    leaves a CNN a tiny-margin function of channel means, learnt erratically.)
    """

    def __init__(
        self,
        input_shape: Sequence[int] = (32,),
        num_classes: int = 4,
        num_train: int = 2048,
        num_val: int = 512,
        num_test: int = 512,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: Workers = "auto",
        pin_memory: bool = True,
    ) -> None:
        check_values(input_shape=input_shape, num_classes=num_classes, num_train=num_train, num_val=num_val,
                     num_test=num_test)
        super().__init__(batch_size, seed, num_workers, pin_memory)
        self.input_shape = tuple(input_shape)  # YAML gives a list
        self.num_classes = num_classes
        self.num_train = num_train
        self.num_val = num_val
        self.num_test = num_test

    @override
    def make_datasets(self, generator: torch.Generator) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        channels, *positions = self.input_shape
        prototypes = CLASS_SIGNAL * torch.randn(self.num_classes, channels, *[1] * len(positions), generator=generator)

        def draw(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
            labels = torch.randint(self.num_classes, (num_samples,), generator=generator)
            return torch.randn(num_samples, *self.input_shape, generator=generator) + prototypes[labels], labels

        inputs, labels = draw(self.num_train + self.num_val)
        return (
            TensorDataset(inputs[: self.num_train], labels[: self.num_train]),
            TensorDataset(inputs[self.num_train :], labels[self.num_train :]),
            TensorDataset(*draw(self.num_test)),  # drawn last: train and val stay what they were
        )


class SyntheticLanguageModelData(SplitData):
    """Token sequences from a fixed random sparse Markov chain over `vocab_size` tokens.

    Every token has 2 or 3 possible successors with fixed random probabilities, so the
    next token is nearly determined by the current one: a small decoder's loss falls from
    ln(vocab_size) towards the chain's entropy (at most ln 3). Sequences are seq_len + 1
    tokens long and batches are `(tokens[:, :-1], tokens[:, 1:])`: seq_len positions each.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 32,
        num_train: int = 2048,
        num_val: int = 256,
        num_test: int = 256,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: Workers = "auto",
        pin_memory: bool = True,
    ) -> None:
        check_values(vocab_size=vocab_size, seq_len=seq_len, num_train=num_train, num_val=num_val, num_test=num_test)
        super().__init__(batch_size, seed, num_workers, pin_memory)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_train = num_train
        self.num_val = num_val
        self.num_test = num_test

    @property
    def tokens_per_sample(self) -> int:
        """Tokens a sample trains on: the run measures tokens/s from it."""
        return self.seq_len

    @override
    def make_datasets(self, generator: torch.Generator) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        vocab = self.vocab_size
        # Transition matrix: row t spreads its mass over 2 or 3 distinct random successors.
        successors = torch.rand(vocab, vocab, generator=generator).argsort(-1)[:, :3]
        weights = torch.rand(vocab, 3, generator=generator) + 0.1
        weights[torch.rand(vocab, generator=generator) < 0.5, 2] = 0.0  # about half get 2 successors
        transitions = torch.zeros(vocab, vocab).scatter_(1, successors, weights)

        def draw(num_sequences: int) -> torch.Tensor:
            tokens = torch.empty(num_sequences, self.seq_len + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(vocab, (num_sequences,), generator=generator)
            for position in range(1, self.seq_len + 1):
                tokens[:, position] = torch.multinomial(transitions[tokens[:, position - 1]], 1, generator=generator)[:, 0]
            return tokens

        tokens = draw(self.num_train + self.num_val)
        train, val, test = tokens[: self.num_train], tokens[self.num_train :], draw(self.num_test)  # test drawn last
        return tuple(TensorDataset(part[:, :-1], part[:, 1:]) for part in (train, val, test))
