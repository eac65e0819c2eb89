"""data=hf_text: a Hugging Face dataset saved on disk (or parquet, jsonl, text files) tokenized with
a tokenizer trained here, packed into windows of seq_len + 1 tokens: the windows are the
tokenizer's ids of the documents joined by the end-of-text token, in a seeded order split over the
ranks, resumable mid-epoch; bad input and a model with too small a vocabulary are refused in one
line by the real command, and a short run trains on it."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers.data_files import END_OF_TEXT, bpe_tokenizer, decoded_documents, documents, on_device
from runner.data.hf_text import HFTextData

SEQ_LEN = 8
TRAIN, VAL = documents(30), documents(34)[30:]


@pytest.fixture
def files(tmp_path) -> Path:
    """tmp_path/corpus: a DatasetDict of TRAIN and VAL (columns id, text); tmp_path/tokenizer.json."""
    import datasets

    bpe_tokenizer(tmp_path / "tokenizer.json", TRAIN + VAL)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"id": list(range(len(TRAIN))), "text": TRAIN}),
        "validation": datasets.Dataset.from_dict({"id": list(range(len(VAL))), "text": VAL}),
    }).save_to_disk(tmp_path / "corpus")
    return tmp_path


def data(files: Path, **knobs) -> HFTextData:
    return HFTextData(**{"path": str(files / "corpus"), "tokenizer": str(files / "tokenizer.json"),
                         "val_split": "validation", "seq_len": SEQ_LEN, "batch_size": 4, **knobs})


def stream(files: Path, texts: list[str]) -> list[int]:
    """The tokenizer's ids of the documents, each followed by the end-of-text token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    return [i for text in texts for i in [*tokenizer.encode(text, add_special_tokens=False).ids,
                                          tokenizer.token_to_id(END_OF_TEXT)]]


def windows(loader) -> list[list[int]]:
    """Every window the loader serves, in order: its inputs and the last target."""
    served = []
    for inputs, targets in loader:
        assert inputs.dtype == targets.dtype == torch.int64 and torch.equal(inputs[:, 1:], targets[:, :-1])
        served += [[*x.tolist(), int(y[-1])] for x, y in zip(inputs, targets)]
    return served


def consecutive(tokens: list[int]) -> list[list[int]]:
    return [tokens[start : start + SEQ_LEN + 1] for start in range(0, len(tokens) - SEQ_LEN, SEQ_LEN + 1)]


def test_windows_are_the_tokenizers_ids_of_the_documents_joined_by_end_of_text(files):
    module = data(files)
    assert module.vocab_size == 300 and module.tokens_per_sample == SEQ_LEN
    train = windows(module.train_dataloader())
    expected = consecutive(stream(files, TRAIN))
    assert sorted(train) == sorted(expected) and train != expected  # every window once, shuffled
    assert windows(module.val_dataloader()) == consecutive(stream(files, VAL))  # in order


def test_without_a_validation_split_a_seeded_fraction_of_the_documents_validates(files):
    def validating(**knobs) -> list[str]:
        """The documents that validate; the others train, in order."""
        module = data(files, val_split=None, val_fraction=0.1, **knobs)
        val = decoded_documents(files / "tokenizer.json", module.tokens["val"].tolist())
        assert decoded_documents(files / "tokenizer.json", module.tokens["train"].tolist()) == [
            doc for doc in TRAIN if doc not in val]
        return val

    first = validating()
    assert len(first) == 3 and set(first) < set(TRAIN)
    assert validating(split_seed=0) == first and validating(split_seed=1) != first


def test_files_and_a_dataset_give_the_same_tokens(files):
    import datasets

    dataset = datasets.load_from_disk(str(files / "corpus"))["train"]
    dataset.to_parquet(files / "train.parquet")
    dataset.to_json(files / "train.jsonl")
    expected = data(files, val_split=None).tokens
    for path in ("train.parquet", "train.jsonl"):
        tokens = data(files, path=str(files / path), val_split=None).tokens
        assert tokens.keys() == expected.keys() and all(np.array_equal(tokens[s], expected[s]) for s in tokens), path


def test_the_order_comes_from_the_run_seed_and_the_epoch_not_the_global_rng(files, monkeypatch):
    loader = data(files).train_dataloader()
    first = windows(loader)
    torch.manual_seed(123)
    assert windows(data(files).train_dataloader()) == first
    loader.sampler.set_epoch(1)
    assert windows(loader) != first
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert windows(data(files).train_dataloader()) != first
    assert windows(data(files, num_workers=2).train_dataloader()) == windows(data(files).train_dataloader())


def test_ranks_take_disjoint_equal_shares_of_one_epochs_windows(files):
    """2 ranks at batch 4 make the global batch (8) that 1 process accumulating 2 batches makes:
    the epoch's windows cut to a multiple of 8, in batches of 4, batch j to rank j mod 2."""
    def batches(processes: int, rank=None) -> list:
        module = data(files)
        module.trainer = on_device(processes=processes, rank=rank, accumulation=2 // processes)
        served = windows(module.train_dataloader())
        return [served[start : start + 4] for start in range(0, len(served), 4)]

    alone, shares = batches(1), [batches(2, rank) for rank in (0, 1)]
    every_window = consecutive(stream(files, TRAIN))
    assert sum(map(len, alone)) == len(every_window) // 8 * 8 and shares == [alone[0::2], alone[1::2]]
    served = [tuple(window) for batch in alone for window in batch]
    assert len(set(served)) == len(served) and set(served) <= set(map(tuple, every_window))


def test_a_loader_resumed_mid_epoch_serves_the_rest_of_the_epoch(files):
    loader = data(files).train_dataloader()
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    rest = [torch.cat(batch, 1) for batch in batches]
    resumed = data(files).train_dataloader()
    resumed.load_state_dict(state)
    assert len(rest) > 1 and all(torch.equal(a, torch.cat(b, 1)) for a, b in zip(rest, resumed, strict=True))


def test_the_conf_names_every_knob_and_builds(files):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from runner.core.paths import CONF_DIR

    conf = OmegaConf.load(CONF_DIR / "data" / "hf_text.yaml")
    assert set(conf) - {"_target_"} == set(inspect.signature(HFTextData).parameters)
    knobs = {"path": str(files / "corpus"), "tokenizer": str(files / "tokenizer.json"), "val_split": "validation",
             "seq_len": SEQ_LEN}
    module = instantiate(OmegaConf.merge(conf, knobs))
    assert windows(module.val_dataloader()) == consecutive(stream(files, VAL))


# --------------------------------------------------------------------------- through the real command

SHRUNK = ["model=causal_lm", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data=hf_text",
          "data.path=corpus", "data.tokenizer=tokenizer.json", "data.val_split=validation", f"data.seq_len={SEQ_LEN}",
          "data.batch_size=4"]


@pytest.mark.parametrize("change, message", [
    ({"path": "nowhere"}, "data.path='nowhere': no such file or directory (text, parquet or jsonl files"),
    ({"text_column": "body"}, "data.text_column='body': corpus (train) has no such column (its columns: id, text)"),
    ({"val_split": "valid"}, "data.val_split='valid': corpus has no such split (its splits: train, validation)"),
    ({"path": "corpus.jsonl"}, "data.val_split='validation': corpus.jsonl has no such split (files are the split "
                               "train"),
    ({"tokenizer": "missing.json"}, "data.tokenizer='missing.json': no such file or directory (a tokenizer.json"),
    ({"seq_len": 500}, "data.seq_len=500: longer than the val split (val_split=validation) of corpus allows: it "
                       "holds "),
], ids=["no_path", "no_column", "no_split", "no_split_of_files", "no_tokenizer", "seq_len_too_long"])
@pytest.mark.slow
def test_bad_input_is_refused_in_one_line(lightfleet, files, change, message):
    (files / "corpus.jsonl").write_text('{"text": "a document"}\n')
    done = lightfleet(*SHRUNK, "model.vocab_size=320", *[f"data.{key}={value}" for key, value in change.items()])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"lightfleet: error: {message}"), done.stderr[-2000:]


@pytest.mark.slow
def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_and_a_large_enough_one_trains(lightfleet, files):
    refused = lightfleet(*SHRUNK, "model.vocab_size=256")
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        "lightfleet: error: model.vocab_size=256: fewer than the 300 token ids of the data "
        "(runner.data.hf_text.HFTextData); set model.vocab_size=300 or more")
    trained = lightfleet(*SHRUNK, "model.vocab_size=320", "trainer.max_steps=5", "trainer.val_check_interval=5",
                         "paths.output_dir=run",
                         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
    assert trained.returncode == 0, trained.stderr[-3000:]
    results = yaml.safe_load((files / "run" / "results.yaml").read_text())
    assert results["global_step"] == 5 and "val_loss" in results
