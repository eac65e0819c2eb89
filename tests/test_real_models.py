"""The field's models on files, through the real command: torchvision's ResNet on an ImageFolder of
generated PNGs, and transformers' GPT-2 and Llama (shrunk) on nanoGPT token files made with
numpy; in 1 and 2 processes, with amp, recompute, sharding (stages 2 and 3, tensor parallel) and
pipeline; and a resume from the middle of an epoch that ends bit for bit where the run ended,
for each data of files."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import yaml

from data_files import bpe_tokenizer, documents, image_folder
from test_resume import checkpoint_overrides, resumes_exactly

STEPS = 16
QUIET = ["trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """train.bin and val.bin: a token stream with a pattern to learn (each token fixes the next);
    images/: dark and light PNGs, 16 of each a split; corpus/ and tokenizer.json: 400 short documents."""
    folder = tmp_path_factory.mktemp("files")
    stream = (np.arange(40_000) * 7 % 101).astype(np.uint16)
    stream.tofile(folder / "train.bin")
    stream[:4_000].tofile(folder / "val.bin")
    image_folder(folder / "images", per_class=16)
    texts = documents(400)  # a saved Hugging Face dataset and a tokenizer trained on it, for data=hf_text
    bpe_tokenizer(folder / "tokenizer.json", texts)
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:360]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[360:]})}).save_to_disk(folder / "corpus")
    return folder


def lm(files: Path, *extra: str) -> list:
    return ["model=causal_lm", "data=tokens", f"data.train_bin={files / 'train.bin'}",
            f"data.val_bin={files / 'val.bin'}", "data.seq_len=32", "data.batch_size=8", "model.vocab_size=128",
            "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.warmup_steps=2",
            "model.optimizer.lr=3e-3", *extra]


def vision(files: Path, *extra: str) -> list:
    return ["model=vision", "model.arch=resnet18", "model.num_classes=2", "data=imagefolder",
            f"data.root={files / 'images'}", "data.image_size=32", "data.batch_size=8", "data.num_workers=0",
            "model.warmup_steps=2", "model.optimizer.lr=0.02", *extra]


CASES = {
    "gpt2_alone": (lm, ["trainer.devices=1"]),
    "gpt2_amp_recompute": (lm, ["strategy=[amp,recompute]", "trainer.devices=2"]),
    "gpt2_sharding_stage3": (lm, ["strategy=[sharding]", "strategy.sharding.stage=3", "trainer.devices=2"]),
    # Pipeline stages cannot share GPT-2's tied head and token embedding.
    "gpt2_pipeline": (lm, ["strategy=[pipeline]", "model.tie_embeddings=false", "trainer.devices=2"]),
    "llama_tensor_parallel": (lm, ["model.family=llama", "model.n_kv_heads=2", "strategy=[sharding]",
                                   "strategy.sharding.stage=2", "strategy.sharding.mp_degree=2", "trainer.devices=2"]),
    "resnet_alone": (vision, ["trainer.devices=1"]),
    "resnet_amp_recompute": (vision, ["strategy=[amp,recompute]", "trainer.devices=2"]),
    "resnet_sharding_stage2": (vision, ["strategy=[sharding]", "strategy.sharding.stage=2", "trainer.devices=2"]),
    "resnet_pipeline": (vision, ["strategy=[pipeline]", "strategy.pipeline.micro_batch_size=2",
                                 "strategy.pipeline.accumulate_steps=4", "trainer.devices=2"]),
}


def train_losses(run: Path) -> list:
    return [float(row["train_loss"]) for row in csv.DictReader((run / "csv" / "metrics.csv").open())
            if row["train_loss"]]


@pytest.mark.parametrize("case", CASES)
def test_the_fields_models_train_on_files_with_the_strategies(case, files, lightfleet, tmp_path):
    make, extra = CASES[case]
    done = lightfleet(*make(files, *extra), f"trainer.max_steps={STEPS}", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert sorted(plan["strategies"]) == sorted(next((o.partition("=")[2].strip("[]").split(",")
                                                      for o in extra if o.startswith("strategy=")), []))
    losses = train_losses(tmp_path / "run")
    assert len(losses) >= STEPS - 1
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


def hf_text(files: Path, *extra: str) -> list:
    return ["model=causal_lm", "data=hf_text", f"data.path={files / 'corpus'}", f"data.tokenizer={files / 'tokenizer.json'}",
            "data.val_split=validation", "data.seq_len=16", "data.batch_size=4", "model.vocab_size=320",
            "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.warmup_steps=2", *extra]


# 2 processes; the token files' epoch is 40,000 / 33 random windows (151 batches of 8 on each
# rank), the images' 32 (2 batches on each), the corpus' a few hundred windows of 17 (tens of
# batches of 4 on each): step 7 is inside an epoch for all three.
RESUMES = {"tokens": (lm, 7), "imagefolder": (vision, 7), "hf_text": (hf_text, 7)}


@pytest.mark.parametrize("data", RESUMES)
def test_a_resume_from_the_middle_of_an_epoch_ends_bit_for_bit(data, files, lightfleet, tmp_path):
    make, step = RESUMES[data]
    done = lightfleet(*make(files, "trainer.devices=2"), "trainer.max_steps=12", "paths.output_dir=full", *QUIET,
                      *checkpoint_overrides(step))
    assert done.returncode == 0, done.stderr[-3000:]
    resumes_exactly(lightfleet, tmp_path, "full", step)


# The reference experiments as shipped, shrunk by overrides as their comments say.
EXPERIMENTS = {
    "gpt2_124m": lambda files: [f"data.train_bin={files / 'train.bin'}", f"data.val_bin={files / 'val.bin'}",
                                "model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                                "data.seq_len=32", "strategy.gradient_merge.k_steps=2", "model.warmup_steps=2"],
    "resnet50_fleet_collective": lambda files: [f"data.root={files / 'images'}", "model.arch=resnet18",
                                                "model.num_classes=2", "data.image_size=32", "data.num_workers=1",
                                                "model.warmup_steps=2"],
}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_reference_experiments_run_shrunk_on_files(experiment, files, lightfleet, tmp_path):
    done = lightfleet(f"experiment={experiment}", *EXPERIMENTS[experiment](files), "trainer.max_steps=4",
                      "trainer.val_check_interval=2", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    results = yaml.safe_load((tmp_path / "run" / "results.yaml").read_text())
    assert results["global_step"] == 4 and "val_loss" in results
