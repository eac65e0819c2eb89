"""`lightfleet prepare-data INPUT ... --tokenizer PATH --out DIR`: text into nanoGPT's token files,
as data=tokens reads them (nanoGPT's prepare.py, from files on disk and a local tokenizer).

INPUT is text files (`.txt`: one document a file, or a line with --lines), parquet or jsonl files
(the documents are a column, --text-column), directories of such files, or a directory a Hugging
Face dataset was saved to (`save_to_disk`; a DatasetDict's --train-split). Each document is
tokenized, followed by the tokenizer's end-of-text token, and streamed to DIR/train.bin or, for
the seeded --val-fraction of the documents (at least one), DIR/val.bin: uint16 when every id fits
(ids up to 65,535), else uint32. DIR/meta.yaml beside them says the vocabulary size, the dtype, the
token and document counts, the tokenizer and the end-of-text token; data=tokens reads its
vocab_size and dtype from it. The files are written under temporary names and renamed at the end:
a refusal or an interruption leaves nothing behind, and an existing file is never overwritten.

The text side of data=hf_text (hf_text.py) is here too: reading documents, loading a local
tokenizer (never a download), the seeded validation split. None of it imports torch or Lightning:
the command starts in a fraction of a second (a tokenizer directory loads through transformers,
which imports torch itself).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np
import yaml

from runner.config.values import RULES
from runner.core.errors import ConfigError, exit_on_user_error, first_line

TRAIN_BIN, VAL_BIN, META_YAML = "train.bin", "val.bin", "meta.yaml"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# End-of-text tokens by convention (GPT-2's, Llama 3's, SentencePiece's, Gemma's), for a tokenizer
# that does not name its own.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TEXT_SUFFIXES = {".txt": "text", ".parquet": "parquet", ".jsonl": "jsonl"}
DOCUMENTS_PER_BATCH = 1000  # tokenized together: the tokenizers library spreads a batch over the cores
INTERRUPTED = 130  # Ctrl-C's exit status, as a run's (runner/rank/parent.py)
VOCAB_MULTIPLE = 64  # the model's vocabulary prepare-data suggests is padded to it, as nanoGPT's 50,304


class BadInput(ValueError):
    """Input that cannot be read, as "name=value: why": a data module's constructor raises it (the
    command names the config key, data.NAME), prepare-data names its flag."""

    def __init__(self, name: str, value: Any, why: str) -> None:
        super().__init__(f"{name}={value}: {why}")
        self.name, self.value, self.why = name, value, why


# --------------------------------------------------------------------------- tokenizers


class TextTokenizer(NamedTuple):
    """A local tokenizer, as the token files need it."""

    path: str
    encode_batch: Callable[[List[str]], List[List[int]]]  # texts -> their ids, no special tokens added
    vocab_size: int  # the largest id + 1: what a model's embedding must hold
    eos_id: int
    eos_token: str


def load_tokenizer(path: str, eos_token: Optional[str] = None) -> TextTokenizer:
    """The tokenizer at `path`: a tokenizer.json of the tokenizers library, or a directory that
    transformers' AutoTokenizer loads (local files only: nothing is downloaded). Its end-of-text
    token is `eos_token`, else its own (a directory's eos_token), else the first of EOS_TOKENS it has."""
    missing = RULES["tokenizer"].refusal(path)
    if missing:
        raise BadInput("tokenizer", path, missing)
    location = Path(path).expanduser()
    if location.is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(location))
        except Exception as error:  # noqa: BLE001 (the library's parse errors have no common type)
            raise BadInput("tokenizer", path, f"not a tokenizer.json the tokenizers library loads: "
                           f"{first_line(error)}") from None
        vocab, own_eos = tokenizer.get_vocab(with_added_tokens=True), None

        def encode_batch(texts: List[str]) -> List[List[int]]:
            return [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        from transformers import AutoTokenizer

        try:
            pretrained = AutoTokenizer.from_pretrained(str(location), local_files_only=True)
        except Exception as error:  # noqa: BLE001 (OSError, ValueError, ... as transformers finds the files)
            raise BadInput("tokenizer", path, f"not a tokenizer AutoTokenizer loads from disk: "
                           f"{first_line(error)}") from None
        vocab, own_eos = pretrained.get_vocab(), pretrained.eos_token

        def encode_batch(texts: List[str]) -> List[List[int]]:
            return pretrained(texts, add_special_tokens=False, verbose=False)["input_ids"]

    if eos_token is not None and eos_token not in vocab:
        raise BadInput("eos_token", eos_token, f"not a token of the tokenizer {path}")
    eos = eos_token or own_eos or next((token for token in EOS_TOKENS if token in vocab), None)
    if eos is None:
        raise BadInput("tokenizer", path, f"has no end-of-text token ({', '.join(EOS_TOKENS)}): name the token "
                       f"that ends a document (data.eos_token; prepare-data's --eos-token)")
    return TextTokenizer(str(location.resolve()), encode_batch, max(vocab.values()) + 1, vocab[eos], eos)


def token_dtype(vocab_size: int) -> str:
    """The token files' dtype: uint16 when every id fits in it (nanoGPT's), else uint32."""
    return "uint16" if vocab_size - 1 <= np.iinfo(np.uint16).max else "uint32"


# --------------------------------------------------------------------------- documents


class Documents(NamedTuple):
    """The documents of a source: `count` of them, in order, a batch at a time from `batches()`."""

    where: str  # the source, for messages
    count: int
    batches: Callable[[], Iterator[List[Optional[str]]]]  # None: a null value of a column


def open_documents(paths: Sequence[str], text_column: str, split: str, split_knob: str,
                   lines: bool = False) -> Documents:
    """The documents of `paths`: text files (each one document, or each non-blank line with
    `lines`), parquet or jsonl files (the `text_column` of each row), directories of such files, or
    one directory a Hugging Face dataset was saved to (`split` of a DatasetDict; `split_knob`
    names it in a refusal)."""
    files: List[Path] = []
    for path in paths:
        missing = RULES["path"].refusal(path)
        if missing:
            raise BadInput("path", path, missing)
        location = Path(path).expanduser()
        if (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
            if len(paths) > 1:
                raise BadInput("path", path, "a saved Hugging Face dataset is read alone: give it as the only input")
            return saved_dataset(location, text_column, split, split_knob)
        if location.is_file():
            found = [location] if location.suffix in TEXT_SUFFIXES else []
        else:
            found = sorted(file for file in location.rglob("*") if file.suffix in TEXT_SUFFIXES and file.is_file())
        if not found:
            raise BadInput("path", path, f"no text to read: files ending {', '.join(TEXT_SUFFIXES)} (or a directory "
                           f"holding them, or one a Hugging Face dataset was saved to)")
        files += found
    kinds = sorted({TEXT_SUFFIXES[file.suffix] for file in files})
    if len(kinds) > 1:
        raise BadInput("path", " ".join(paths), f"mixes {' and '.join(kinds)} files: give files of one kind")
    where = str(files[0]) if len(files) == 1 else f"{len(files)} {kinds[0]} files ({files[0]}, ...)"
    if split != "train":
        raise BadInput(split_knob, split, f"{where} has no such split (files are the split train; splits are a "
                       f"saved DatasetDict's)")
    if kinds == ["text"]:
        return text_documents(where, files, lines)
    return (parquet_documents if kinds == ["parquet"] else jsonl_documents)(where, files, text_column)


def batched(texts: Iterable[str]) -> Iterator[List[str]]:
    iterator = iter(texts)
    while batch := list(islice(iterator, DOCUMENTS_PER_BATCH)):
        yield batch


def text_documents(where: str, files: List[Path], lines: bool) -> Documents:
    if not lines:
        return Documents(where, len(files), lambda: batched(file.read_text(encoding="utf-8") for file in files))

    def each_line() -> Iterator[str]:
        for file in files:
            with file.open(encoding="utf-8") as text:
                yield from (line.rstrip("\r\n") for line in text if line.strip())

    return Documents(where, sum(1 for _ in each_line()), lambda: batched(each_line()))


def check_text_column(where: str, schema: Any, text_column: str) -> None:
    """BadInput unless the arrow `schema` has a column of strings named `text_column`."""
    import pyarrow as pa

    if text_column not in schema.names:
        raise BadInput("text_column", text_column, f"{where} has no such column (its columns: "
                       f"{', '.join(schema.names)})")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BadInput("text_column", text_column, f"{where}'s column holds {kind}, not text")


def parquet_documents(where: str, files: List[Path], text_column: str) -> Documents:
    import pyarrow.parquet as pq

    for file in files:
        check_text_column(str(file), pq.read_schema(file), text_column)

    def batches() -> Iterator[List[str]]:
        for file in files:
            for batch in pq.ParquetFile(file).iter_batches(DOCUMENTS_PER_BATCH, columns=[text_column]):
                yield batch.column(0).to_pylist()

    return Documents(where, sum(pq.ParquetFile(file).metadata.num_rows for file in files), batches)


def jsonl_documents(where: str, files: List[Path], text_column: str) -> Documents:
    def records() -> Iterator[tuple[str, dict]]:  # (where it is, the record)
        for file in files:
            with file.open(encoding="utf-8") as text:
                for number, line in enumerate(text, 1):
                    if line.strip():
                        try:
                            yield f"{file}:{number}", json.loads(line)
                        except json.JSONDecodeError as error:
                            raise BadInput("path", file, f"line {number} is not JSON: {error}") from None

    def texts() -> Iterator[Optional[str]]:
        for place, record in records():
            if not (isinstance(record, dict) and text_column in record
                    and (record[text_column] is None or isinstance(record[text_column], str))):
                columns = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise BadInput("text_column", text_column, f"{place} holds no text under it (its columns: {columns})")
            yield record[text_column]

    next(texts(), None)  # the first record's refusal before anything is written
    return Documents(where, sum(1 for _ in records()), lambda: batched(texts()))


def saved_dataset(directory: Path, text_column: str, split: str, split_knob: str) -> Documents:
    """A dataset `save_to_disk` wrote: a Dataset (the split `train`) or a DatasetDict's `split`."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(directory))
    except Exception as error:  # noqa: BLE001 (whatever a damaged directory raises)
        raise BadInput("path", directory, f"not a dataset load_from_disk reads: {first_line(error)}") from None
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if split not in splits:
        raise BadInput(split_knob, split, f"{directory} has no such split (its splits: {', '.join(splits)})")
    dataset = splits[split]
    where = f"{directory} ({split})"
    check_text_column(where, dataset.data.schema, text_column)
    texts = dataset.select_columns([text_column])
    return Documents(where, len(dataset), lambda: (batch[text_column] for batch in
                                                   texts.iter(batch_size=DOCUMENTS_PER_BATCH)))


def validation_mask(documents: Documents, val_fraction: float, split_seed: int) -> np.ndarray:
    """Which documents validate: the fraction `val_fraction` of them (at least one, and one left
    to train on), drawn by `split_seed`."""
    if not 0 <= val_fraction < 1:
        raise BadInput("val_fraction", val_fraction, "must be in [0, 1)")
    if documents.count < 2:
        raise BadInput("val_fraction", val_fraction, f"{documents.where} holds {documents.count} document(s): "
                       f"splitting off validation documents needs 2 or more")
    chosen = min(documents.count - 1, max(1, round(documents.count * val_fraction)))
    mask = np.zeros(documents.count, dtype=bool)
    mask[np.random.default_rng(split_seed).permutation(documents.count)[:chosen]] = True
    return mask


def encoded(documents: Documents, tokenizer: TextTokenizer, desc: str) -> Iterator[np.ndarray]:
    """Each document's token ids followed by the end-of-text token, in order, in the token files'
    dtype; a progress bar over the documents on stderr."""
    from tqdm import tqdm

    dtype = DTYPES[token_dtype(tokenizer.vocab_size)]
    with tqdm(total=documents.count, desc=desc, unit="doc", file=sys.stderr, dynamic_ncols=True) as bar:
        for batch in documents.batches():
            encodings = tokenizer.encode_batch([text or "" for text in batch])  # a null document is an empty one
            bar.update(len(batch))  # before the yields: a consumer may stop at the last document
            for ids in encodings:
                ids.append(tokenizer.eos_id)
                yield np.array(ids, dtype)


# --------------------------------------------------------------------------- the command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, as every lightfleet error
        raise ConfigError(self.prog, None, message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(prog="lightfleet prepare-data", description="Tokenize text into the token files of "
                     "data=tokens (OUT/train.bin, OUT/val.bin, OUT/meta.yaml), with a local tokenizer.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files (.txt), parquet or jsonl files, "
                        "directories of them, or a directory a Hugging Face dataset was saved to (save_to_disk)")
    parser.add_argument("--tokenizer", required=True, metavar="PATH", help="a tokenizer.json of the tokenizers "
                        "library, or a directory AutoTokenizer loads (local files only: nothing is downloaded)")
    parser.add_argument("-o", "--out", required=True, metavar="DIR", help="where to write train.bin, val.bin and "
                        "meta.yaml (made if missing; existing token files are never overwritten)")
    parser.add_argument("--text-column", default="text", metavar="NAME",
                        help="the column of parquet, jsonl or dataset rows that holds the text (default: text)")
    parser.add_argument("--train-split", default="train", metavar="NAME",
                        help="the split of a saved DatasetDict to read (default: train)")
    parser.add_argument("--lines", action="store_true",
                        help="each non-blank line of a text file is a document (default: each file is one)")
    parser.add_argument("--val-fraction", type=float, default=0.0005, metavar="F", help="the fraction of the "
                        "documents written to val.bin, at least one (default: 0.0005, nanoGPT's)")
    parser.add_argument("--split-seed", type=int, default=0, metavar="N",
                        help="the seed that draws the validation documents (default: 0)")
    parser.add_argument("--eos-token", metavar="TOKEN", help="the token appended to every document (default: the "
                        f"tokenizer's own end-of-text token, else the first of {', '.join(EOS_TOKENS)} it has)")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """`lightfleet prepare-data ...` (argv: what follows prepare-data)."""
    with exit_on_user_error():
        args = parse_args(argv)
        out = Path(args.out).expanduser()
        if out.exists() and not out.is_dir():
            raise ConfigError("--out", args.out, "is a file, not a directory")
        existing = [out / name for name in (TRAIN_BIN, VAL_BIN, META_YAML) if (out / name).exists()]
        if existing:
            raise ConfigError(str(existing[0]), None, "exists; prepare-data never overwrites a file (choose another "
                              "--out)")
        try:
            tokenizer = load_tokenizer(args.tokenizer, args.eos_token)
            documents = open_documents(args.inputs, args.text_column, args.train_split, "train_split", args.lines)
            is_val = validation_mask(documents, args.val_fraction, args.split_seed)
            print(f"lightfleet: prepare-data: {documents.count} documents from {documents.where}, each followed by "
                  f"the tokenizer's end-of-text token {tokenizer.eos_token} (id {tokenizer.eos_id})", file=sys.stderr)
            inputs = [str(Path(path).expanduser().resolve()) for path in args.inputs]
            meta = write_token_files(out, documents, is_val, tokenizer, inputs)
        except KeyboardInterrupt:
            print("lightfleet: prepare-data: interrupted; nothing written", file=sys.stderr)
            return INTERRUPTED
        except BadInput as bad:  # named by its flag, or the input itself
            raise (ConfigError(str(bad.value), None, bad.why) if bad.name == "path" else
                   ConfigError(f"--{bad.name.replace('_', '-')}", bad.value, bad.why)) from None
    train_bin, val_bin = (shlex.quote(str((out / name).resolve())) for name in (TRAIN_BIN, VAL_BIN))
    model_vocab = -(-meta["vocab_size"] // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    print(f"prepare-data: wrote {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
          f"({meta['dtype']}); train on them: lightfleet model=causal_lm model.vocab_size={model_vocab} data=tokens "
          f"data.train_bin={train_bin} data.val_bin={val_bin}")
    return 0


def write_token_files(out: Path, documents: Documents, is_val: np.ndarray, tokenizer: TextTokenizer,
                      inputs: List[str]) -> dict:
    """Stream the documents' tokens to OUT/train.bin and OUT/val.bin, then OUT/meta.yaml (which
    names the `inputs`); return the meta. Written under temporary names, renamed when complete:
    whatever stops it (a bad record, Ctrl-C) leaves nothing, not even the directories it made."""
    made = next((folder for folder in reversed([out, *out.parents]) if not folder.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    partial = {name: out / f".{name}.{os.getpid()}.partial" for name in (TRAIN_BIN, VAL_BIN, META_YAML)}
    try:
        tokens, counts = {"train": 0, "val": 0}, {"train": 0, "val": 0}
        with partial[TRAIN_BIN].open("wb") as train, partial[VAL_BIN].open("wb") as val:
            for ids, validates in zip(encoded(documents, tokenizer, "prepare-data"), is_val):
                split = "val" if validates else "train"
                (val if split == "val" else train).write(ids.tobytes())
                tokens[split] += len(ids)
                counts[split] += 1
        meta = {"vocab_size": tokenizer.vocab_size, "dtype": token_dtype(tokenizer.vocab_size),
                "eos_id": tokenizer.eos_id, "eos_token": tokenizer.eos_token, "tokenizer": tokenizer.path,
                "inputs": inputs, "tokens": tokens, "documents": counts}
        partial[META_YAML].write_text("# Written by `lightfleet prepare-data`; data=tokens reads vocab_size and dtype "
                                      "from it.\n" + yaml.safe_dump(meta, sort_keys=False))
        for name, path in partial.items():
            os.replace(path, out / name)
        return meta
    except BaseException:
        for path in partial.values():
            path.unlink(missing_ok=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
