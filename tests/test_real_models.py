"""The field's models on files, through the real command: torchvision's ResNet on an ImageFolder of
generated PNGs, and transformers' GPT-2 and Llama (shrunk) on nanoGPT token files made with
numpy (tests/helpers/data_files.py:field_files); alone, and Llama with tensor parallel (the strategies of
the table train these models in tests/test_combinations.py); a resume from the middle of an epoch
that ends bit for bit where the run ended, for each data of files; the reference experiments."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from tests.helpers.data_files import gpt2_on_text, gpt2_on_tokens, resnet_on_images
from tests.helpers.resume import checkpoint_overrides, resumes_exactly

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

STEPS = 16
QUIET = ["trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


# In one process, and Llama with tensor parallel; every strategy of the table trains these models in
# 2 processes in tests/test_combinations.py.
CASES = {
    "gpt2_alone": (gpt2_on_tokens, ["trainer.devices=1"]),
    "resnet_alone": (resnet_on_images, ["trainer.devices=1"]),
    "llama_tensor_parallel": (gpt2_on_tokens, ["model.family=llama", "model.n_kv_heads=2", "strategy=[sharding]",
                                               "strategy.sharding.stage=2", "strategy.sharding.mp_degree=2",
                                               "trainer.devices=2"]),
}


def train_losses(run: Path) -> list:
    return [float(row["train_loss"]) for row in csv.DictReader((run / "csv" / "metrics.csv").open())
            if row["train_loss"]]


@pytest.mark.parametrize("case", CASES)
def test_the_fields_models_train_on_files_with_the_strategies(case, field_files, lightfleet, tmp_path):
    make, extra = CASES[case]
    done = lightfleet(*make(field_files, *extra), f"trainer.max_steps={STEPS}", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert sorted(plan["strategies"]) == sorted(next((o.partition("=")[2].strip("[]").split(",")
                                                      for o in extra if o.startswith("strategy=")), []))
    losses = train_losses(tmp_path / "run")
    assert len(losses) >= STEPS - 1
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


# 2 processes; the token files' epoch is 40,000 / 33 random windows (151 batches of 8 on each
# rank), the images' 32 (2 batches on each), the corpus' a few hundred windows of 17 (tens of
# batches of 4 on each): step 7 is inside an epoch for all three.
RESUMES = {"tokens": (gpt2_on_tokens, 7), "imagefolder": (resnet_on_images, 7), "hf_text": (gpt2_on_text, 7)}


@pytest.mark.parametrize("data", RESUMES)
def test_a_resume_from_the_middle_of_an_epoch_ends_bit_for_bit(data, field_files, lightfleet, tmp_path):
    make, step = RESUMES[data]
    done = lightfleet(*make(field_files, "trainer.devices=2"), "trainer.max_steps=12", "paths.output_dir=full", *QUIET,
                      *checkpoint_overrides(step))
    assert done.returncode == 0, done.stderr[-3000:]
    resumes_exactly(lightfleet, tmp_path, "full", step)


# The reference experiments as shipped, shrunk by overrides as their comments say.
EXPERIMENTS = {
    "gpt2_124m": lambda files: [f"data.train_bin={files / 'train.bin'}", f"data.val_bin={files / 'val.bin'}",
                                "model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                                "data.seq_len=32", "strategy.gradient_merge.k_steps=2", "model.warmup_steps=2",
                                "fast_path.compile=false"],
    "resnet50_fleet_collective": lambda files: [f"data.root={files / 'images'}", "model.arch=resnet18",
                                                "model.num_classes=2", "data.image_size=32", "data.num_workers=1",
                                                "model.warmup_steps=2"],
}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_reference_experiments_run_shrunk_on_files(experiment, field_files, lightfleet, tmp_path):
    done = lightfleet(f"experiment={experiment}", *EXPERIMENTS[experiment](field_files), "trainer.max_steps=4",
                      "trainer.val_check_interval=2", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    results = yaml.safe_load((tmp_path / "run" / "results.yaml").read_text())
    assert results["global_step"] == 4 and "val_loss" in results
