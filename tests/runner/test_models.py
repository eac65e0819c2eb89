"""Built-in models and synthetic data: each conf pair really learns, data is seeded, confs build; the\ncompact models' FLOPs at every input size and every knob's own effect."""
from __future__ import annotations

from typing import Callable

import hydra
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.probe import attention_in_plain_matmuls, channels_last_knob, knobs_of, optimizer_knob
from runner.data import SyntheticClassificationData, SyntheticLanguageModelData
from runner.config.compose import compose_config
from runner.core.paths import CONF_DIR
from runner.models import BasicBlock, ClassifierModule, GPTDecoder, MLPClassifier, ResidualMLPBlock, ResNetClassifier

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
    """The conf as Hydra composes it: a model's with its optimizer (conf/model/optimizer/)."""
    return compose_config([f"{group}={name}"])[group]


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


@pytest.mark.parametrize("path", sorted((CONF_DIR / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_conf_instantiates(path):
    conf = load("model", path.stem)
    model = hydra.utils.instantiate(conf)
    assert isinstance(model, ClassifierModule)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured  # with its LR schedule
    assert type(optimizer).__name__ == conf.optimizer._target_.rsplit(".", 1)[1]
    assert optimizer.defaults["lr"] == conf.optimizer.lr


# The data of files need files: tests/runner/test_file_data.py instantiates their confs with some.
FILE_DATA = ("hf_text", "imagefolder", "tokens")


@pytest.mark.parametrize("path", sorted(p for p in (CONF_DIR / "data").glob("*.yaml") if p.stem not in FILE_DATA),
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


# --------------------------------------------------------------------------- figures at every input size


@pytest.mark.parametrize("seq_len", [16, 64])
def test_gpt_flops_per_token_follow_the_sequence_length(monkeypatch, seq_len):
    """Against torch's FLOP counter on a training step over seq_len tokens: the weights' 6 per token
    and attention's share, which grows with the context (PaLM's appendix B, as nanoGPT counts)."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention_in_plain_matmuls)
    model = GPTDecoder(vocab_size=64, seq_len=seq_len, d_model=64, n_heads=4, n_layers=2)
    tokens = torch.randint(64, (1, seq_len))
    with FlopCounterMode(display=False) as counter:
        model.loss(model(tokens), tokens).backward()
    # The formula also counts biases and norms as weights: under 3% more here.
    assert model.flops_per_token * seq_len == pytest.approx(counter.get_total_flops(), rel=0.03)


@pytest.mark.parametrize("model_class", [MLPClassifier, ResNetClassifier])
def test_the_mlp_and_the_resnet_claim_no_flops_the_input_size_would_change(model_class):
    # Neither knows its input's size when built (the data's input_shape): no MFU, rather than a wrong one.
    model = model_class()
    assert getattr(model, "flops_per_sample", None) is None and getattr(model, "flops_per_token", None) is None


# --------------------------------------------------------------------------- every knob
# Each check builds the model with one knob changed (make(knob=value)) and finds its effect in what
# the model computes or holds, against a count or a shape written here; a constructor argument or
# conf key without a check fails test_every_knob_of_the_compact_models_has_a_check.

Make = Callable[..., pl.LightningModule]


def mlp_parameters(input_dim=32, hidden_dim=64, num_blocks=3, num_classes=4) -> int:
    """Stem, blocks of (LayerNorm, two square layers), head of (LayerNorm, layer)."""
    block = 2 * hidden_dim + 2 * (hidden_dim * hidden_dim + hidden_dim)
    return (input_dim + 1) * hidden_dim + num_blocks * block + 2 * hidden_dim + (hidden_dim + 1) * num_classes


def gpt_parameters(vocab_size=64, seq_len=32, d_model=64, n_layers=2) -> int:
    """Token and position embeddings, blocks of (2 LayerNorms, q, k, v, projection, a 4x MLP), LayerNorm, head."""
    block = 4 * d_model + 4 * (d_model + 1) * d_model + (d_model + 1) * 4 * d_model + (4 * d_model + 1) * d_model
    return (vocab_size + seq_len) * d_model + n_layers * block + 2 * d_model + (d_model + 1) * vocab_size


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def calls(model: nn.Module, inputs: torch.Tensor, kind: type) -> list:
    """The output shapes of the modules of class `kind` as `inputs` pass through the model, in order."""
    shapes: list = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape))) for m in model.modules()
             if isinstance(m, kind)]
    model(inputs)
    for hook in hooks:
        hook.remove()
    return shapes


def sized(counter: Callable[..., int], inputs: Callable[[int], torch.Tensor], outputs: Callable[[int], tuple],
          **knob: int) -> Callable[[Make], None]:
    """A size knob: the parameters are `counter`'s count with it, and inputs of that size give outputs of that size."""
    (name, value), = knob.items()

    def check(make: Make) -> None:
        model = make(**knob)
        assert count(model) == counter(**knob)
        assert tuple(model(inputs(value)).shape) == outputs(value), name

    return check


def mlp_blocks(make: Make) -> None:
    assert calls(make(num_blocks=5), torch.randn(2, 32), ResidualMLPBlock) == [(2, 64)] * 5


def resnet_in_channels(make: Make) -> None:
    assert make(in_channels=1)(torch.randn(2, 1, 8, 8)).shape == (2, 4)
    with pytest.raises(RuntimeError):
        make()(torch.randn(2, 1, 8, 8))


def resnet_classes(make: Make) -> None:
    assert make(num_classes=7)(torch.randn(2, 3, 8, 8)).shape == (2, 7)


def resnet_widths(make: Make) -> None:
    # A stage per width, each after the first halving the resolution.
    assert calls(make(widths=[8, 24]), torch.randn(2, 3, 16, 16), BasicBlock) == [(2, 8, 16, 16), (2, 24, 8, 8)]


def resnet_blocks_per_stage(make: Make) -> None:
    shapes = calls(make(blocks_per_stage=2), torch.randn(2, 3, 16, 16), BasicBlock)
    assert shapes == [(2, 16, 16, 16)] * 2 + [(2, 32, 8, 8)] * 2 + [(2, 64, 4, 4)] * 2


def gpt_seq_len(make: Make) -> None:
    model = make(seq_len=8)
    assert count(model) == gpt_parameters(seq_len=8) and model(torch.randint(64, (2, 8))).shape == (2, 8, 64)
    with pytest.raises(IndexError):  # no position past seq_len
        model(torch.randint(64, (2, 9)))


def gpt_heads(make: Make) -> None:
    """The same weights split into 2 heads instead of 4 attend differently."""
    two, four = make(n_heads=2), make()
    two.load_state_dict(four.state_dict())
    assert two.blocks[0].attn.head_dim == 32
    tokens = torch.randint(64, (2, 8))
    assert not torch.allclose(two(tokens), four(tokens))


COMPACT = {MLPClassifier: "mlp", ResNetClassifier: "resnet", GPTDecoder: "gpt"}
COMPACT_KNOBS: dict = {
    MLPClassifier: {
        "input_dim": sized(mlp_parameters, lambda n: torch.randn(2, n), lambda n: (2, 4), input_dim=7),
        "hidden_dim": sized(mlp_parameters, lambda n: torch.randn(2, 32), lambda n: (2, 4), hidden_dim=16),
        "num_blocks": mlp_blocks,
        "num_classes": sized(mlp_parameters, lambda n: torch.randn(2, 32), lambda n: (2, n), num_classes=9),
        "optimizer": optimizer_knob},
    ResNetClassifier: {
        "in_channels": resnet_in_channels, "widths": resnet_widths, "blocks_per_stage": resnet_blocks_per_stage,
        "num_classes": resnet_classes,
        "channels_last": channels_last_knob, "optimizer": optimizer_knob},
    GPTDecoder: {
        "vocab_size": sized(gpt_parameters, lambda n: torch.randint(n, (2, 8)), lambda n: (2, 8, n), vocab_size=100),
        "d_model": sized(gpt_parameters, lambda n: torch.randint(64, (2, 8)), lambda n: (2, 8, 64), d_model=32),
        "n_layers": sized(gpt_parameters, lambda n: torch.randint(64, (2, 8)), lambda n: (2, 8, 64), n_layers=3),
        "seq_len": gpt_seq_len, "n_heads": gpt_heads, "optimizer": optimizer_knob},
}


@pytest.mark.parametrize("model_class", list(COMPACT), ids=list(COMPACT.values()))
def test_every_knob_of_the_compact_models_has_a_check(model_class):
    assert set(COMPACT_KNOBS[model_class]) == knobs_of(model_class, CONF_DIR / "model" / f"{COMPACT[model_class]}.yaml")


@pytest.mark.parametrize("model_class, knob", [(m, k) for m in COMPACT for k in sorted(COMPACT_KNOBS[m])],
                         ids=[f"{COMPACT[m]}-{k}" for m in COMPACT for k in sorted(COMPACT_KNOBS[m])])
def test_each_knob_of_the_compact_models_does_what_it_says(model_class, knob):
    torch.manual_seed(0)
    COMPACT_KNOBS[model_class][knob](model_class)
