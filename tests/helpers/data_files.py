"""Tiny data files the tests make on the fly (nothing is downloaded): token files from numpy, a
folder of generated PNGs in ImageFolder's layout, short text documents and tokenizers trained on
them with the tokenizers library; and the trainer a data module reads, for tests that build one."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

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


def picture_folder(root: Path, per_class: dict, size: int = 32) -> Path:
    """ROOT/SPLIT/{a,b}/*.png, `per_class[SPLIT]` images a class, every one the same picture (noise
    drawn once): two images of a batch differ only where their random crops and flips differ."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    for split, count in per_class.items():
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for index in range(count):
                Image.fromarray(pixels).save(root / split / label / f"{index}.png")
    return root


def on_device(device: str = "cpu", epoch: int = 0, processes: int = 1, precision: str = "32-true",
              accumulation: int = 1, rank: Optional[int] = None, position: Any = None) -> SimpleNamespace:
    """What a data module or a model reads of Lightning's trainer, for a run on `device` in
    `precision` in `epoch`, `processes` on the node, accumulating `accumulation` batches a step;
    with `rank`, as that one of `processes` data-parallel ranks (Lightning's sampler arguments);
    with `position` (runner/data/order.py:Position), resumed there, as GlobalPosition holds it."""
    import torch

    replicas = {"num_replicas": processes, "rank": rank} if rank is not None else None
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), num_devices=processes,
                           current_epoch=epoch, distributed_sampler_kwargs=replicas, precision=precision,
                           accumulate_grad_batches=accumulation,
                           callbacks=[SimpleNamespace(position=position)] if position is not None else [])


END_OF_TEXT = "<|endoftext|>"


def documents(count: int) -> list[str]:
    """`count` short documents (accents, digits, an inner line break), each ending with a newline."""
    rng = np.random.default_rng(0)
    words = ["the", "fox", "jumps", "über", "den", "lazy", "dog", "42", "times", "naïve", "café", "and", "sleeps"]
    return [" ".join(rng.choice(words, rng.integers(3, 12))) + ".\n" + " ".join(rng.choice(words, 3)) + "\n"
            for _ in range(count)]


def bpe_tokenizer(path: Path, texts: list[str], special_tokens: tuple[str, ...] = (END_OF_TEXT,)) -> Path:
    """A byte-level BPE trained on `texts` with the tokenizers library, saved as tokenizer.json at
    `path`: every text encodes and decodes back unchanged; about 300 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return path


def word_tokenizer(path: Path, num_words: int) -> Path:
    """A word-level tokenizer trained on the words w0 ... w{num_words - 1} (whitespace-separated),
    with [UNK] and the end-of-text token first, saved as tokenizer.json at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator([" ".join(f"w{i}" for i in range(num_words))], trainers.WordLevelTrainer(
        vocab_size=num_words + 2, special_tokens=["[UNK]", END_OF_TEXT]))
    tokenizer.save(str(path))
    return path


def decoded_documents(tokenizer: Path, ids: list[int]) -> list[str]:
    """The documents of a token stream: `ids` decoded by the tokenizer.json at `tokenizer`, cut after
    each end-of-text token (the stream ends with one)."""
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tokenizer)).decode(ids, skip_special_tokens=False)
    assert text.endswith(END_OF_TEXT)
    return text.split(END_OF_TEXT)[:-1]


def field_files(folder: Path) -> Path:
    """What the field's models train on in the tests, under `folder`: train.bin and val.bin, a
    token stream with a pattern to learn (each token fixes the next); images/, dark and light PNGs,
    16 of each a split; corpus/ (a saved Hugging Face dataset) and tokenizer.json trained on it,
    400 short documents."""
    import datasets

    stream = (np.arange(40_000) * 7 % 101).astype(np.uint16)
    stream.tofile(folder / "train.bin")
    stream[:4_000].tofile(folder / "val.bin")
    image_folder(folder / "images", per_class=16)
    texts = documents(400)
    bpe_tokenizer(folder / "tokenizer.json", texts)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:360]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[360:]})}).save_to_disk(folder / "corpus")
    return folder


# The command-line overrides that train the field's models, shrunk, on the files of field_files.


def gpt2_on_tokens(files: Path, *extra: str) -> list[str]:
    """transformers' GPT-2 (2 layers of 64) on the token files."""
    return ["model=causal_lm", "data=tokens", f"data.train_bin={files / 'train.bin'}",
            f"data.val_bin={files / 'val.bin'}", "data.seq_len=32", "data.batch_size=8", "model.vocab_size=128",
            "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.warmup_steps=2",
            "model.optimizer.lr=3e-3", *extra]


def resnet_on_images(files: Path, *extra: str) -> list[str]:
    """torchvision's ResNet-18 on the images, 32 pixels a side."""
    return ["model=vision", "model.arch=resnet18", "model.num_classes=2", "data=imagefolder",
            f"data.root={files / 'images'}", "data.image_size=32", "data.batch_size=8", "data.num_workers=0",
            "model.warmup_steps=2", "model.optimizer.lr=0.02", *extra]


def gpt2_on_text(files: Path, *extra: str) -> list[str]:
    """transformers' GPT-2 (2 layers of 32) on the saved dataset, through the trained tokenizer."""
    return ["model=causal_lm", "data=hf_text", f"data.path={files / 'corpus'}",
            f"data.tokenizer={files / 'tokenizer.json'}", "data.val_split=validation", "data.seq_len=16",
            "data.batch_size=4", "model.vocab_size=320", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
            "model.warmup_steps=2", *extra]
