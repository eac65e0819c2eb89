"""data=hf_text: text tokenized when the data is built, packed into windows of seq_len + 1 tokens.

The text is a Hugging Face dataset saved on disk (`save_to_disk`: a Dataset, or a DatasetDict's
splits), parquet or jsonl files (the documents are the column text_column), or text files, read
as `lightfleet prepare-data` reads them (prepare.py) and tokenized with a local tokenizer (a
tokenizer.json of the tokenizers library, or a directory AutoTokenizer loads; never a download).
Each split's documents are concatenated, each followed by the tokenizer's end-of-text token, and
cut into consecutive windows of seq_len + 1 tokens (the tail shorter than a window is left out).
Batches are `(tokens[:, :-1], tokens[:, 1:])` int64, as data=tokens serves them. Validation is a
DatasetDict's val_split, or the val_fraction of the training documents drawn by split_seed.

Training windows are data=tokens' `sequential` ones (tokens.py): shuffled every epoch from (the
run's seed, the epoch) in lightfleet's global order (order.py), so a run resumed mid-epoch, on any
number of processes, continues with the global batch it would have drawn next.

The tokens live in memory (2 bytes each, 4 past 65,536 ids), tokenized in the command (its
checks) and again in each process: a corpus that takes long to tokenize is better written once
by `lightfleet prepare-data` and read as data=tokens.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from typing_extensions import override

from runner.config.values import check_values
from runner.data.prepare import (DTYPES, Documents, TextTokenizer, encoded, load_tokenizer, open_documents,
                                  token_dtype, validation_mask)
from runner.data.tokens import TokenArray, TokenWindowData, TokenWindows, require_window


class HFTextData(TokenWindowData):
    """Text from disk, tokenized, as train/val(/test) splits of windows of seq_len + 1 tokens."""

    TEST_KNOB = "test_split"

    def __init__(
        self,
        path: str,
        tokenizer: str,
        text_column: str = "text",
        train_split: str = "train",
        val_split: Optional[str] = None,
        test_split: Optional[str] = None,
        val_fraction: float = 0.0005,
        split_seed: int = 0,
        lines: bool = False,
        eos_token: Optional[str] = None,
        seq_len: int = 1024,
        batch_size: int = 12,
        num_workers: int = 0,
        pin_memory: bool = True,
    ) -> None:
        check_values(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
        text_tokenizer = load_tokenizer(tokenizer, eos_token)

        def documents(split: str, knob: str) -> Documents:
            return open_documents([path], text_column, split, knob, lines)

        train = documents(train_split, "train_split")
        pieces: dict[str, List[np.ndarray]] = {"train": [], "val": []}
        if val_split is None:
            for ids, validates in zip(encoded(train, text_tokenizer, "hf_text train"),
                                      validation_mask(train, val_fraction, split_seed)):
                pieces["val" if validates else "train"].append(ids)
        else:
            pieces["train"] = list(encoded(train, text_tokenizer, "hf_text train"))
            pieces["val"] = list(encoded(documents(val_split, "val_split"), text_tokenizer, "hf_text val"))
        if test_split is not None:
            pieces["test"] = list(encoded(documents(test_split, "test_split"), text_tokenizer, "hf_text test"))
        self.tokens = {split: concatenated(ids, text_tokenizer) for split, ids in pieces.items()}
        chosen_by = {"train": f"train_split={train_split}", "test": f"test_split={test_split}",
                     "val": f"val_split={val_split}" if val_split else f"val_fraction={val_fraction}"}
        for split, tokens in self.tokens.items():
            require_window(seq_len, len(tokens), f"the {split} split ({chosen_by[split]}) of {path}")
        super().__init__(seq_len, "sequential", len(self.tokens["train"]) // (seq_len + 1), batch_size, num_workers,
                         pin_memory, text_tokenizer.vocab_size)

    @override
    def windows_of(self, split: str) -> Optional[TokenWindows]:
        return TokenArray(self.tokens[split], self.seq_len) if split in self.tokens else None


def concatenated(documents: List[np.ndarray], tokenizer: TextTokenizer) -> np.ndarray:
    """The documents' tokens end to end (none: an empty array of the tokens' dtype)."""
    return np.concatenate(documents) if documents else np.empty(0, DTYPES[token_dtype(tokenizer.vocab_size)])
