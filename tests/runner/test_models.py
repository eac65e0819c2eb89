"""Built-in models and synthetic data: each conf pair really learns, data is seeded, confs build."""
from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf

from runner.data import SyntheticClassificationData, SyntheticLanguageModelData
from runner.models import ClassifierModule, GPTDecoder, MLPClassifier, ResNetClassifier

CONF = Path(__file__).resolve().parents[2] / "conf"

# model conf, data conf, training steps, validation accuracy to beat after training
# (chance: 1/4 for the classifiers, 1/64 for the decoder).
PAIRS = [
    pytest.param("mlp", "classification", 60, 0.7, id="mlp"),
    pytest.param("resnet", "images", 30, 0.7, id="resnet"),
    pytest.param("gpt", "language_model", 60, 0.3, id="gpt"),
]

# model conf, data conf, {model argument: data argument it must equal}
PAIRED_VALUES = [
    ("mlp", "classification", {"input_dim": "input_shape.0", "num_classes": "num_classes"}),
    ("resnet", "images", {"in_channels": "input_shape.0", "num_classes": "num_classes"}),
    ("gpt", "language_model", {"vocab_size": "vocab_size", "seq_len": "seq_len"}),
]


def load(group: str, name: str):
    return OmegaConf.load(CONF / group / f"{name}.yaml")


def trainer(**overrides) -> pl.Trainer:
    quiet = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                 enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**quiet, **overrides)


def validate(model: pl.LightningModule, data: pl.LightningDataModule) -> dict:
    return trainer().validate(model, data, verbose=False)[0]


@pytest.mark.parametrize("model_name, data_name, steps, min_accuracy", PAIRS)
def test_model_learns_its_task(model_name, data_name, steps, min_accuracy):
    torch.manual_seed(0)
    model = hydra.utils.instantiate(load("model", model_name))
    data = hydra.utils.instantiate(load("data", data_name))
    before = validate(model, data)
    # No validation during fit: only the before/after numbers matter, and they cost time.
    trainer(max_steps=steps, limit_val_batches=0).fit(model, data)
    after = validate(model, data)
    assert after["val_loss"] < 0.5 * before["val_loss"], (before, after)
    assert after["val_acc"] > min_accuracy, (before, after)


@pytest.mark.parametrize("model_name, data_name, pairs", PAIRED_VALUES)
def test_paired_confs_agree(model_name, data_name, pairs):
    model, data = load("model", model_name), load("data", data_name)
    for model_key, data_key in pairs.items():
        assert model[model_key] == OmegaConf.select(data, data_key), (model_key, data_key)


@pytest.mark.parametrize("path", sorted((CONF / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_conf_instantiates(path):
    conf = OmegaConf.load(path)
    model = hydra.utils.instantiate(conf)
    assert isinstance(model, ClassifierModule)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured  # with its LR schedule
    assert type(optimizer).__name__ == conf.optimizer._target_.rsplit(".", 1)[1]
    assert optimizer.defaults["lr"] == conf.optimizer.lr


# The data of files need files: tests/runner/test_file_data.py instantiates their confs with some.
FILE_DATA = ("hf_text", "imagefolder", "tokens")


@pytest.mark.parametrize("path", sorted(p for p in (CONF / "data").glob("*.yaml") if p.stem not in FILE_DATA),
                         ids=lambda p: p.stem)
def test_data_conf_instantiates(path):
    data = hydra.utils.instantiate(OmegaConf.load(path))
    data.setup("fit")
    inputs, targets = next(iter(data.train_dataloader()))
    assert len(inputs) == len(targets) == data.batch_size


@pytest.mark.parametrize("model_class", [MLPClassifier, ResNetClassifier, GPTDecoder])
def test_blocks_repeat_one_class(model_class):
    # Activation recomputation looks for the layers to checkpoint in `blocks`.
    children = list(model_class().blocks.children())
    assert len(children) >= 2
    assert len({type(child) for child in children}) == 1


def test_default_optimizer_and_hyperparameters():
    model = MLPClassifier(hidden_dim=16)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["momentum"] == 0.9
    assert model.hparams["hidden_dim"] == 16 and "optimizer" not in model.hparams


def test_resnet_batch_norm_and_bias_names():
    # Weight decay exclusion finds these parameters by name substring.
    names = [name for name, _ in ResNetClassifier().named_parameters()]
    assert any("bn" in name for name in names) and any("bias" in name for name in names)
    assert all("bn" in name or "bias" in name or name.endswith("conv.weight") or name == "head.weight"
               for name in names)


DATA_CLASSES = [
    pytest.param(lambda seed: SyntheticClassificationData(input_shape=[3, 8, 8], seed=seed), id="images"),
    pytest.param(lambda seed: SyntheticLanguageModelData(seed=seed), id="language_model"),
]


def tensors(data: pl.LightningDataModule) -> list[torch.Tensor]:
    data.setup("fit")
    return [*data.train_set.tensors, *data.val_set.tensors]


@pytest.mark.parametrize("make_data", DATA_CLASSES)
def test_data_depends_on_seed_only(make_data):
    first = tensors(make_data(seed=0))
    torch.manual_seed(123)  # the global RNG must not matter
    assert all(torch.equal(a, b) for a, b in zip(first, tensors(make_data(seed=0))))
    assert not torch.equal(first[0], tensors(make_data(seed=1))[0])


def test_language_model_targets_are_next_tokens():
    data = SyntheticLanguageModelData(vocab_size=16, seq_len=8, batch_size=4)
    data.setup("fit")
    inputs, targets = next(iter(data.val_dataloader()))
    assert inputs.shape == targets.shape == (4, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # Sparse chain: each token is followed by at most 3 distinct tokens.
    tokens, next_tokens = data.train_set.tensors
    pairs = torch.unique(torch.stack([tokens.flatten(), next_tokens.flatten()]), dim=1)
    assert torch.bincount(pairs[0]).max() <= 3
