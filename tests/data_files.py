"""Tiny data files the tests make on the fly (nothing is downloaded): token files from numpy, a
folder of generated PNGs in ImageFolder's layout, short text documents and tokenizers trained on
them with the tokenizers library."""
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
