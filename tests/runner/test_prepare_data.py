"""`lightfleet prepare-data`, through the real command: text files, jsonl, parquet and saved Hugging
Face datasets into the token files of data=tokens. The files decode back to the documents, each
followed by the end-of-text token; the dtype fits the vocabulary; meta.yaml says what data=tokens
needs; the validation documents are a seeded fraction; refusals are one line and leave nothing
behind; the command imports no torch; the files train. Documents and tokenizers are made here
(tests/helpers/data_files.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.data_files import END_OF_TEXT, bpe_tokenizer, decoded_documents, documents, word_tokenizer
from runner.data.tokens import TokenFileData

DOCS = documents(20)
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    assert len(set(DOCS)) == len(DOCS)  # each document recognisable in the output
    return bpe_tokenizer(tmp_path / "tokenizer.json", DOCS)


def text_files(folder: Path, texts: list[str]) -> Path:
    """One file a document, named so that their sorted order is the documents'."""
    folder.mkdir()
    for index, text in enumerate(texts):
        (folder / f"{index:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def decoded(path: Path, tokenizer: Path) -> list[str]:
    """The documents of a uint16 token file."""
    return decoded_documents(tokenizer, np.fromfile(path, np.uint16).tolist())


def prepare(lightfleet, *args: str) -> subprocess.CompletedProcess:
    done = lightfleet("prepare-data", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_text_files_become_token_files_that_decode_to_the_documents_each_followed_by_end_of_text(
        lightfleet, tmp_path, tokenizer):
    text_files(tmp_path / "corpus", DOCS)
    done = prepare(lightfleet, "corpus", "--tokenizer", "tokenizer.json", "-o", "out", "--val-fraction", "0.1")
    train, val = decoded(tmp_path / "out" / "train.bin", tokenizer), decoded(tmp_path / "out" / "val.bin", tokenizer)
    assert len(val) == 2 and set(val) < set(DOCS)
    assert train == [doc for doc in DOCS if doc not in val]  # every other document, in order
    assert f"each followed by the tokenizer's end-of-text token {END_OF_TEXT} (id 0)" in done.stderr
    assert "prepare-data: 100%" in done.stderr and "20/20" in done.stderr  # the progress bar
    sizes = {split: (tmp_path / "out" / f"{split}.bin").stat().st_size // 2 for split in ("train", "val")}
    assert done.stdout.splitlines() == [
        f"prepare-data: wrote {sizes['train']:,} train and {sizes['val']:,} val tokens (uint16); train on them: "
        f"lightfleet model=causal_lm model.vocab_size=320 data=tokens data.train_bin={tmp_path / 'out' / 'train.bin'} "
        f"data.val_bin={tmp_path / 'out' / 'val.bin'}"]


def test_lines_of_a_text_file_are_documents_with_the_flag(lightfleet, tmp_path, tokenizer):
    lines = [line for doc in DOCS for line in doc.splitlines()]
    (tmp_path / "corpus.txt").write_text("\n\n".join(lines) + "\n", encoding="utf-8")  # blank lines are no documents
    prepare(lightfleet, "corpus.txt", "--lines", "--tokenizer", "tokenizer.json", "-o", "out")
    train, val = decoded(tmp_path / "out" / "train.bin", tokenizer), decoded(tmp_path / "out" / "val.bin", tokenizer)
    assert len(val) == 1 and sorted(train + val) == sorted(lines)


def save_dataset(path: Path, kind: str) -> None:
    """DOCS under the column `body` beside an `id` column, as `kind` stores them."""
    import datasets

    dataset = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "body": DOCS})
    if kind == "jsonl":
        dataset.to_json(path / "corpus.jsonl")
    elif kind == "parquet":  # two files, read in the order of their names
        dataset.select(range(12)).to_parquet(path / "corpus" / "a.parquet")
        dataset.select(range(12, len(DOCS))).to_parquet(path / "corpus" / "b.parquet")
    elif kind == "dataset":
        dataset.save_to_disk(path / "corpus")
    else:  # a DatasetDict: the split chosen with --train-split
        datasets.DatasetDict({"train": dataset.select(range(3)), "full": dataset}).save_to_disk(path / "corpus")


@pytest.mark.parametrize("kind, extra", [("jsonl", []), ("parquet", []), ("dataset", []),
                                         ("dataset_dict", ["--train-split", "full"])])
def test_a_column_of_jsonl_parquet_or_a_saved_dataset_gives_the_files_of_the_same_text_files(
        lightfleet, tmp_path, tokenizer, kind, extra):
    text_files(tmp_path / "texts", DOCS)
    prepare(lightfleet, "texts", "--tokenizer", "tokenizer.json", "-o", "from_texts", "--val-fraction", "0.1")
    save_dataset(tmp_path, kind)
    source = "corpus.jsonl" if kind == "jsonl" else "corpus"
    prepare(lightfleet, source, "--text-column", "body", *extra, "--tokenizer", "tokenizer.json", "-o", "out",
            "--val-fraction", "0.1")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "from_texts" / name).read_bytes(), name


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_a_null_text_is_an_empty_document(lightfleet, tmp_path, tokenizer, kind):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": [DOCS[0], None, DOCS[1]]})
    {"jsonl": lambda: dataset.to_json(tmp_path / "corpus.jsonl"), "parquet": lambda: dataset.to_parquet(
        tmp_path / "corpus.parquet"), "dataset": lambda: dataset.save_to_disk(tmp_path / "corpus")}[kind]()
    prepare(lightfleet, next(tmp_path.glob("corpus*")).name, "--tokenizer", "tokenizer.json", "-o", "out")
    found = [decoded(tmp_path / "out" / f"{split}.bin", tokenizer) for split in ("train", "val")]
    assert sorted(found[0] + found[1]) == sorted([DOCS[0], "", DOCS[1]])


@pytest.mark.parametrize("num_words, dtype", [(65534, "uint16"), (65535, "uint32")])
def test_the_dtype_is_uint16_while_every_id_fits_else_uint32(lightfleet, tmp_path, num_words, dtype):
    from tokenizers import Tokenizer

    words = Tokenizer.from_file(str(word_tokenizer(tmp_path / "words.json", num_words)))
    vocab = words.get_vocab()
    last = max(vocab, key=vocab.get)
    assert vocab[last] == num_words + 1 and vocab[END_OF_TEXT] == 1  # [UNK], the end of text, the words
    text_files(tmp_path / "corpus", [f"w0 {last} w7", f"{last} w1", "w2"])
    prepare(lightfleet, "corpus", "--tokenizer", "words.json", "-o", "out")
    meta = yaml.safe_load((tmp_path / "out" / "meta.yaml").read_text())
    assert meta["dtype"] == dtype and meta["vocab_size"] == num_words + 2
    tokens = np.concatenate([np.fromfile(tmp_path / "out" / f"{split}.bin", dtype) for split in ("train", "val")])
    assert sorted(tokens.tolist()) == sorted([*words.encode(f"w0 {last} w7 {last} w1 w2").ids, 1, 1, 1])
    assert num_words + 1 in tokens.tolist()


def test_meta_yaml_gives_data_tokens_its_vocabulary_and_dtype(lightfleet, tmp_path, tokenizer):
    from tokenizers import Tokenizer

    text_files(tmp_path / "corpus", DOCS)
    prepare(lightfleet, "corpus", "--tokenizer", "tokenizer.json", "-o", "out")
    out = tmp_path / "out"
    meta = yaml.safe_load((out / "meta.yaml").read_text())
    trained = Tokenizer.from_file(str(tokenizer))
    assert meta == {"vocab_size": trained.get_vocab_size(), "dtype": "uint16",
                    "eos_id": trained.token_to_id(END_OF_TEXT), "eos_token": END_OF_TEXT, "tokenizer": str(tokenizer),
                    "inputs": [str(tmp_path / "corpus")], "documents": {"train": 19, "val": 1},
                    "tokens": {split: (out / f"{split}.bin").stat().st_size // 2 for split in ("train", "val")}}
    files = {"train_bin": str(out / "train.bin"), "val_bin": str(out / "val.bin"), "seq_len": 4}
    data = TokenFileData(**files)
    assert data.vocab_size == meta["vocab_size"] and data.dtype == "uint16"
    assert TokenFileData(**files, vocab_size=512).vocab_size == 512  # one set on the command line wins
    with pytest.raises(ValueError, match="^dtype=uint32: the meta.yaml beside train_bin says uint16 "):
        TokenFileData(**files, dtype="uint32")
    (out / "meta.yaml").write_text("vocab_size: many\n")
    with pytest.raises(ValueError, match=r"train_bin=.*: the meta.yaml beside it is not prepare-data's"):
        TokenFileData(**files)


def test_the_validation_documents_are_drawn_by_the_seed(lightfleet, tmp_path, tokenizer):
    text_files(tmp_path / "corpus", DOCS)

    def validation(out: str, *seed: str) -> list[str]:
        prepare(lightfleet, "corpus", "--tokenizer", "tokenizer.json", "-o", out, "--val-fraction", "0.25", *seed)
        return decoded(tmp_path / out / "val.bin", tokenizer)

    first = validation("a")
    assert len(first) == 5 and validation("b", "--split-seed", "0") == first
    assert validation("c", "--split-seed", "1") != first


def test_the_command_imports_no_torch(tmp_path, tokenizer):
    text_files(tmp_path / "corpus", DOCS)
    code = ("import sys\nfrom runner.command.cli import main\n"
            "assert main(['prepare-data', 'corpus', '--tokenizer', 'tokenizer.json', '-o', 'out']) == 0\n"
            "print(sorted(name for name in ('torch', 'pytorch_lightning', 'hydra') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]"


def test_a_tokenizer_directory_loads_through_auto_tokenizer_as_its_tokenizer_json(lightfleet, tmp_path, tokenizer):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), eos_token=END_OF_TEXT).save_pretrained(tmp_path / "saved")
    text_files(tmp_path / "corpus", DOCS)
    prepare(lightfleet, "corpus", "--tokenizer", "tokenizer.json", "-o", "from_file")
    prepare(lightfleet, "corpus", "--tokenizer", "saved", "-o", "from_directory")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "from_directory" / name).read_bytes() == (tmp_path / "from_file" / name).read_bytes()


# --------------------------------------------------------------------------- refusals: one line, exit 2, nothing left


def bad_record_at_15(tmp_path: Path) -> None:
    lines = [f'{{"id": {i}, "text": "document {i}"}}' for i in range(20)]
    lines[14] = '{"id": 14}'
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")


REFUSALS = {  # (make the input, arguments, the error; whether the documents were being written)
    "missing_input": (None, ["nowhere"], "nowhere: no such file or directory (text, parquet or jsonl files", False),
    "no_text_column": ("dataset", ["corpus"], "--text-column='text': corpus (train) has no such column (its "
                                              "columns: id, body)", False),
    "no_split": ("dataset", ["corpus", "--text-column", "body", "--train-split", "validation"],
                 "--train-split='validation': corpus has no such split (its splits: train)", False),
    "no_tokenizer": ("texts", ["corpus", "--tokenizer", "missing.json"], "--tokenizer='missing.json': no such file "
                                                                         "or directory", False),
    "not_a_tokenizer": ("texts", ["corpus", "--tokenizer", "corpus/00.txt"],
                        "--tokenizer='corpus/00.txt': not a tokenizer.json the tokenizers library loads", False),
    "no_end_of_text": ("texts", ["corpus", "--tokenizer", "plain.json"], "--tokenizer='plain.json': has no "
                                                                         "end-of-text token", False),
    "unknown_eos": ("texts", ["corpus", "--eos-token", "<end>"], "--eos-token='<end>': not a token of the tokenizer",
                    False),
    "one_document": ("one", ["corpus"], "--val-fraction=0.0005: corpus/00.txt holds 1 document(s)", False),
    "bad_record": (bad_record_at_15, ["corpus.jsonl"], "--text-column='text': corpus.jsonl:15 holds no text "
                                                       "under it (its columns: id)", True),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_input_is_refused_in_one_line_and_leaves_nothing(lightfleet, tmp_path, tokenizer, case):
    make, args, message, writing = REFUSALS[case]
    bpe_tokenizer(tmp_path / "plain.json", DOCS, special_tokens=())
    if make in ("texts", "one"):
        text_files(tmp_path / "corpus", DOCS[:1] if make == "one" else DOCS)
    elif make == "dataset":
        save_dataset(tmp_path, "dataset")
    elif make is not None:
        make(tmp_path)
    tokenizer_args = [] if "--tokenizer" in args else ["--tokenizer", "tokenizer.json"]
    done = lightfleet("prepare-data", *args, *tokenizer_args, "-o", "out/sub")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(f"lightfleet: error: {message}"), done.stderr
    assert len(lines) == 1 or writing  # once writing, the note and the progress bar come first
    assert not (tmp_path / "out").exists()


def test_existing_token_files_are_never_overwritten(lightfleet, tmp_path, tokenizer):
    text_files(tmp_path / "corpus", DOCS)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.bin").write_bytes(b"mine")
    done = lightfleet("prepare-data", "corpus", "--tokenizer", "tokenizer.json", "-o", "out")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "lightfleet: error: out/train.bin: exists; prepare-data never overwrites a file (choose another --out)"]
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["train.bin"]
    assert (tmp_path / "out" / "train.bin").read_bytes() == b"mine"


# --------------------------------------------------------------------------- the files train


@pytest.mark.slow
def test_the_printed_command_trains_on_the_files_and_a_smaller_model_vocabulary_is_refused(
        lightfleet, tmp_path, tokenizer):
    text_files(tmp_path / "corpus", DOCS)
    done = prepare(lightfleet, "corpus", "--tokenizer", "tokenizer.json", "-o", "out", "--val-fraction", "0.1")
    command = done.stdout.split("train on them: lightfleet ")[1].split()
    shrunk = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=16", "data.batch_size=4"]
    refused = lightfleet(*command, *shrunk, "model.vocab_size=256")  # meta.yaml: 300 ids
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "lightfleet: error: model.vocab_size=256: fewer than the 300 token ids of the data "
        "(runner.data.tokens.TokenFileData); set model.vocab_size=300 or more"]
    refused = lightfleet(*command, *shrunk, "data.dtype=uint32")
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "lightfleet: error: data.dtype='uint32': the meta.yaml beside train_bin says uint16 (leave data.dtype unset "
        "to take it)"]
    trained = lightfleet(*command, *shrunk, "trainer.max_steps=5", "paths.output_dir=run", *QUIET)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "run" / "results.yaml").read_text())["global_step"] == 5
