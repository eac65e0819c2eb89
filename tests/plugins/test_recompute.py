"""Activation recomputation on the built-in models: less saved for backward, same gradients."""
from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from plugins.recompute import apply_recompute
from plugins.transforms import ModelContext
from runner.data import SyntheticClassificationData, SyntheticLanguageModelData
from runner.core.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier, ResNetClassifier


def mlp() -> tuple[nn.Module, tuple]:
    return MLPClassifier(), (torch.randn(64, 32), torch.randint(4, (64,)))


def gpt() -> tuple[nn.Module, tuple]:
    tokens = torch.randint(64, (8, 33))
    return GPTDecoder(), (tokens[:, :-1], tokens[:, 1:])


def resnet() -> tuple[nn.Module, tuple]:
    return ResNetClassifier(), (torch.randn(8, 3, 16, 16), torch.randint(4, (8,)))


MODELS = pytest.mark.parametrize("make", [mlp, gpt, resnet], ids=["mlp", "gpt", "resnet"])


def plain_and_recomputed(make, **options) -> tuple[nn.Module, nn.Module, tuple]:
    """The same initial model twice, the second with recompute applied (default: auto blocks)."""
    torch.manual_seed(0)
    model, batch = make()
    recomputed = copy.deepcopy(model)
    apply_recompute(recomputed, ModelContext(recomputed), **{"checkpoints": [], "enable_offload": False, **options})
    return model, recomputed, batch


def saved_storages(model: nn.Module, inputs: torch.Tensor) -> dict[int, int]:
    """Storages one forward saves for backward through the outermost saved-tensor hooks,
    parameters left out: data pointer -> bytes (so a storage saved twice counts once)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(inputs)  # kept alive until the end so no storage is freed and reused
    del output
    return saved


def cross_entropy(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gradients(model: nn.Module, batch: tuple) -> list[torch.Tensor]:
    cross_entropy(model, batch).backward()
    return [p.grad for p in model.parameters()]


@MODELS
def test_saved_bytes_drop(make):
    model, recomputed, (inputs, _) = plain_and_recomputed(make)
    plain_bytes = sum(saved_storages(model, inputs).values())
    recomputed_bytes = sum(saved_storages(recomputed, inputs).values())
    assert recomputed_bytes < 0.5 * plain_bytes, (recomputed_bytes, plain_bytes)


@MODELS
@pytest.mark.parametrize("enable_offload", [False, True], ids=["on_device", "offload"])
def test_gradients_and_running_stats_match(make, enable_offload):
    model, recomputed, batch = plain_and_recomputed(make, enable_offload=enable_offload)
    for plain_grad, recomputed_grad in zip(gradients(model, batch), gradients(recomputed, batch), strict=True):
        torch.testing.assert_close(recomputed_grad, plain_grad, atol=1e-6, rtol=0)
    # Batch norm (ResNet) folds the batch statistics into its running ones once, not again
    # when the block is recomputed in backward.
    for plain_buffer, recomputed_buffer in zip(model.buffers(), recomputed.buffers(), strict=True):
        torch.testing.assert_close(recomputed_buffer, plain_buffer, atol=0, rtol=0)


def test_offload_takes_the_checkpoint_inputs():
    # A checkpoint saves its input under the saved-tensor hooks active around it: without
    # offload the test's own hooks see it, with offload save_on_cpu packs it instead.
    model, on_device, (inputs, _) = plain_and_recomputed(mlp)
    offloaded = copy.deepcopy(model)
    apply_recompute(offloaded, ModelContext(offloaded), [], enable_offload=True)

    def block_inputs_seen(net: nn.Module) -> list[bool]:
        pointers = []
        for block in net.blocks:
            block.register_forward_pre_hook(lambda _, args: pointers.append(args[0].untyped_storage().data_ptr()))
        saved = saved_storages(net, inputs)
        return [pointer in saved for pointer in pointers]

    assert block_inputs_seen(on_device) == [True] * 3
    assert block_inputs_seen(offloaded) == [False] * 3


def test_state_dict_keys_and_loading():
    model, recomputed, _ = plain_and_recomputed(mlp)
    assert list(recomputed.state_dict()) == list(model.state_dict())
    fresh = MLPClassifier()
    apply_recompute(fresh, ModelContext(fresh), ["blocks.*"], enable_offload=True)
    fresh.load_state_dict(model.state_dict())  # an old (plain) state dict loads into the wrapped model
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    MLPClassifier().load_state_dict(recomputed.state_dict())  # and back


@pytest.mark.parametrize("checkpoints, wrapped", [
    (["blocks.*"], ["blocks.0", "blocks.1", "blocks.2"]),  # the glob also matches blocks.0.net...: nested ones dropped
    (["ResidualMLPBlock"], ["blocks.0", "blocks.1", "blocks.2"]),
    (["blocks.1", "blocks.1.net.1", "head"], ["blocks.1", "head"]),
    (["LayerNorm"], ["blocks.0.net.0", "blocks.1.net.0", "blocks.2.net.0", "head.0"]),
    (["stem", "blocks.2.net"], ["blocks.2.net", "stem"]),
])
def test_selection(checkpoints, wrapped):
    model = MLPClassifier()
    assert apply_recompute(model, ModelContext(model), checkpoints, enable_offload=False) == wrapped
    is_wrapped = {name for name, module in model.named_modules() if hasattr(module, "_checkpoint_wrapped_module")}
    assert is_wrapped == set(wrapped)


@pytest.mark.parametrize("make, blocks", [
    (MLPClassifier, ["blocks.0", "blocks.1", "blocks.2"]),
    (GPTDecoder, ["blocks.0", "blocks.1"]),
    (ResNetClassifier, ["blocks.0", "blocks.1", "blocks.2"]),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ["0", "1"]),
])
def test_empty_selects_the_repeated_blocks(make, blocks):
    model = make()
    assert apply_recompute(model, ModelContext(model), [], enable_offload=False) == blocks


def test_typo_is_refused_with_a_suggestion():
    model = MLPClassifier()
    with pytest.raises(ConfigError, match=r"strategy\.recompute\.checkpoints='blocks\.O'.*matches no module"
                                          r".*did you mean .*blocks\.0"):
        apply_recompute(model, ModelContext(model), ["blocks.*", "blocks.O"], enable_offload=False)
    with pytest.raises(ConfigError, match="did you mean ResidualMLPBlock"):
        apply_recompute(model, ModelContext(model), ["ResidualMLPBlok"], enable_offload=False)


def test_no_repeated_blocks_is_refused():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match="no repeated block list.*name the modules"):
        apply_recompute(model, ModelContext(model), [], enable_offload=False)


@pytest.mark.parametrize("make_model, make_data, enable_offload", [
    (MLPClassifier, lambda: SyntheticClassificationData(num_train=512, num_val=64), False),
    (GPTDecoder, lambda: SyntheticLanguageModelData(num_train=256, num_val=32), True),
    (ResNetClassifier, lambda: SyntheticClassificationData(input_shape=(3, 8, 8), num_train=512, num_val=64), False),
], ids=["mlp", "gpt_offload", "resnet"])
def test_training_loss_falls(make_model, make_data, enable_offload, tmp_path):
    torch.manual_seed(0)
    model, data = make_model(), make_data()
    apply_recompute(model, ModelContext(model), [], enable_offload=enable_offload)
    data.setup("fit")

    def loss() -> float:
        model.eval()  # batch norm normalises with its running statistics
        with torch.no_grad():
            value = cross_entropy(model, data.train_set.tensors).item()
        model.train()  # Trainer.fit keeps the modes it finds
        return value

    before = loss()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=6, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    after = loss()
    assert after < 0.5 * before, (before, after)
