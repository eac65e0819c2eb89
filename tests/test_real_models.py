"""The field's models on files, through the real command: torchvision's ResNet on an ImageFolder of
generated PNGs, and transformers' GPT-2 and Llama (shrunk) on nanoGPT token files made with
numpy (tests/helpers/data_files.py:field_files); alone, and Llama with tensor parallel (the strategies of
the table train these models in tests/test_combinations.py); a resume from the middle of an epoch
that ends bit for bit where the run ended, for each data of files; the reference experiments' CPU recipes."""
from __future__ import annotations

import csv
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers.commands import PROJECT_ROOT
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


# The reference experiments' recipes for a CPU: the command each file's "Shrunk for a CPU" comment
# shows, run as it is on the field's files, its placeholders filled in.
EXPERIMENTS = PROJECT_ROOT / "experiments"
CPU_RECIPE = "# Shrunk for a CPU"


def cpu_recipes() -> dict:
    """{experiment: its CPU recipe's command}: the `#   lightfleet ` line after the recipe's heading
    and the `#     ` lines that continue it."""
    recipes = {}
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        lines = path.read_text().splitlines()
        heading = next((index for index, line in enumerate(lines) if line.startswith(CPU_RECIPE)), None)
        if heading is None:
            continue
        start = next(index for index in range(heading, len(lines)) if lines[index].startswith("#   lightfleet "))
        end = next(index for index in range(start + 1, len(lines)) if not lines[index].startswith("#     "))
        recipes[path.stem] = " ".join(line.lstrip("# ") for line in lines[start:end])
    return recipes


def test_every_cpu_recipe_of_the_experiments_learns_and_validates(field_files, lightfleet, tmp_path):
    # The token files as a user makes them, and the vocabulary size prepare-data prints for the recipe.
    prepared = lightfleet("prepare-data", str(field_files / "corpus"), "--tokenizer", str(field_files / "tokenizer.json"),
                          "-o", "tokens", "--val-fraction", "0.1")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    placeholders = {"TOKENS": str(tmp_path / "tokens"), "VOCAB": re.search(r"model\.vocab_size=(\d+)", prepared.stdout)[1],
                    "IMAGES": str(field_files / "images"), "CLASSES": "2"}
    recipes = cpu_recipes()
    assert sorted(recipes) == ["gpt2_124m", "resnet50_fleet_collective"]
    for experiment, command in recipes.items():
        filled = re.sub(r"\b(%s)\b" % "|".join(placeholders), lambda word: placeholders[word[1]], command)
        args = shlex.split(filled)
        assert args[:2] == ["lightfleet", f"experiment={experiment}"], command
        # One torch thread: the suite shares 2 cores among 2 workers, where more threads spin-wait.
        done = lightfleet(*args[1:], f"paths.output_dir={experiment}", *QUIET, "collective.execution_strategy.num_threads=1")
        assert done.returncode == 0, (experiment, done.stderr[-3000:])
        results = yaml.safe_load((tmp_path / experiment / "results.yaml").read_text())
        max_steps = int(re.search(r"trainer\.max_steps=(\d+)", command)[1])
        assert results["global_step"] == max_steps and "val_loss" in results, (experiment, results)
        losses = train_losses(tmp_path / experiment)
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < 0.8 * first, f"{experiment}: loss did not fall: {first:.3f} -> {last:.3f}"
