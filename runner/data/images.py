"""data=imagefolder: images in torchvision's ImageFolder layout, one folder per class under each
split (`ROOT/train/CLASS/*.jpg`, `ROOT/val/CLASS/*.jpg`, optionally `ROOT/test/...`), as ImageNet
is laid out. Training takes torchvision's standard ImageNet transforms (a random resized crop
and a horizontal flip); validation and test resize and take the centre crop.

Batches are `(images [B, 3, image_size, image_size] float, labels [B])`. The training order and
every image's random crop and flip come from (the run's seed, the epoch, the image), never from a
worker's RNG: how many workers load the data changes nothing, and a run resumed mid-epoch, on
any number of processes, continues with the very global batch it would have drawn next (the
global order: order.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from runner.config.values import check_values
from runner.data.loading import stateful_loader
from runner.data.order import GlobalOrder, run_seed

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class SeededSamples(Dataset):
    """`dataset` read by (index, seed) pairs: each sample's random transforms draw from torch's
    RNG seeded with `seed`, in a fork that leaves the reading process's RNG as it was."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list[Any]:
        """A batch's samples (a DataLoader fetches a batch with one call): one fork of the RNG for
        the batch, seeded again for each sample."""
        samples = []
        with torch.random.fork_rng(devices=[]):
            for index, seed in items:
                torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed seeds accelerators too
                samples.append(self.dataset[index])
        return samples


class SeededOrder(GlobalOrder):
    """This rank's indices of the epoch's global order (GlobalOrder), each with the seed of its
    random transforms: a function of (run seed, epoch, index) alone."""

    @override
    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = list(super().__iter__())
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 2 + 1)  # not the order's stream
        seeds = torch.randint(2**62, (len(self.dataset),), generator=generator)
        for index in indices:
            yield index, int(seeds[index])


def image_folder(root: Path, split: str, key: str, transform: Any) -> Any:
    """torchvision's ImageFolder of ROOT/split; ValueError naming `key` when it is missing or holds
    no class folder with an image."""
    from torchvision.datasets import ImageFolder

    folder = root / split
    if not folder.is_dir():
        raise ValueError(f"{key}={split}: no folder {folder} (one folder per class under it, as ImageFolder reads)")
    try:
        return ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, RuntimeError) as error:  # no class folder, or classes without images
        raise ValueError(f"{key}={split}: {folder}: {str(error).strip().splitlines()[0]}") from None


class ImageFolderData(pl.LightningDataModule):
    """Train/val(/test) ImageFolder splits under `root`, with the ImageNet transforms."""

    def __init__(
        self,
        root: str,
        train_split: str = "train",
        val_split: str = "val",
        test_split: Optional[str] = None,
        image_size: int = 224,
        batch_size: int = 32,
        num_workers: int = 4,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
        min_crop_scale: float = 0.08,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        check_values(root=root, image_size=image_size, batch_size=batch_size, num_workers=num_workers,
                     prefetch_factor=prefetch_factor)
        if not 0 < min_crop_scale <= 1:
            raise ValueError(f"min_crop_scale={min_crop_scale}: must be in (0, 1]")
        super().__init__()
        self.root = Path(root).expanduser()
        from torchvision import transforms

        normalize = [transforms.ToTensor(), transforms.Normalize(list(mean), list(std))]
        train = transforms.Compose([transforms.RandomResizedCrop(image_size, scale=(min_crop_scale, 1.0)),
                                    transforms.RandomHorizontalFlip(), *normalize])
        # Resize to 256 for a 224 crop, as the reference ImageNet evaluation does.
        evaluate = transforms.Compose([transforms.Resize(round(image_size * 256 / 224)),
                                       transforms.CenterCrop(image_size), *normalize])
        self.splits = {"train": image_folder(self.root, train_split, "train_split", train),
                       "val": image_folder(self.root, val_split, "val_split", evaluate)}
        if test_split is not None:
            self.splits["test"] = image_folder(self.root, test_split, "test_split", evaluate)
        self.num_classes = len(self.splits["train"].classes)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor

    def _loader(self, dataset: Dataset, **options: Any) -> DataLoader:
        return stateful_loader(dataset, self.trainer, batch_size=self.batch_size, num_workers=self.num_workers,
                               pin_memory=self.pin_memory, prefetch_factor=self.prefetch_factor, **options)

    @override
    def train_dataloader(self) -> DataLoader:
        # The global order (runner/data/order.py): the same global batches on any number of processes.
        sampler = SeededOrder(self.splits["train"], batch_size=self.batch_size, seed=run_seed(), trainer=self.trainer)
        return self._loader(SeededSamples(self.splits["train"]), sampler=sampler)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.splits["val"])

    @override
    def test_dataloader(self) -> DataLoader:
        if "test" not in self.splits:
            raise ValueError("test_split=None: the test stage needs a test split (data.test_split)")
        return self._loader(self.splits["test"])
