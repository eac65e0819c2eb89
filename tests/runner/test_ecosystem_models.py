"""model=vision and model=causal_lm (runner/models/vision.py, causal_lm.py): the field's own
models, held against the libraries that define them: the same outputs as torchvision's and
transformers' own forward, the block lists every strategy needs, FLOPs as published and as torch
counts them at every input size, every knob's own effect, and the one-line refusals. Training
them: tests/test_real_models.py."""
from __future__ import annotations

import inspect
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from plugins.modules import repeated_block_list
from tests.helpers.probe import attention_in_plain_matmuls, channels_last_knob, knobs_of, optimizer_knob
from runner.core.paths import CONF_DIR
from runner.models.causal_lm import CausalLM
from runner.models.vision import VisionClassifier

TINY_LM = dict(vocab_size=128, seq_len=32, d_model=64, n_layers=3, n_heads=4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_causal_lm_computes_what_transformers_forward_computes(family):
    torch.manual_seed(0)
    model = CausalLM(family=family, n_kv_heads=2 if family == "llama" else None, **TINY_LM).eval()
    tokens = torch.randint(128, (2, 16))
    torch.testing.assert_close(model(tokens), model.lm(input_ids=tokens).logits, rtol=0, atol=0)
    name, blocks = repeated_block_list(model)
    assert name == ("lm.transformer.h" if family == "gpt2" else "lm.model.layers") and len(blocks) == 3


def test_a_saved_causal_lm_loads_from_its_directory(tmp_path):
    model = CausalLM(family="llama", **TINY_LM)
    model.lm.save_pretrained(tmp_path / "saved")
    loaded = CausalLM(pretrained_path=str(tmp_path / "saved"), vocab_size=1, n_layers=1)  # sizes come from the files
    assert (loaded.family, loaded.vocab_size, len(loaded.layers)) == ("llama", 128, 3)
    tokens = torch.randint(128, (1, 8))
    torch.testing.assert_close(loaded.eval()(tokens), model.eval()(tokens), rtol=0, atol=0)


def test_gpt2_124m_has_nanogpts_size_and_flops():
    model = CausalLM()  # the defaults: nanoGPT's GPT-2 small
    params = sum(p.numel() for p in model.parameters())
    assert params == 124_475_904
    # nanoGPT's estimate_mfu: 6 N + 12 L H T, N without the position embedding (the head is tied to the tokens')
    non_position = params - model.lm.transformer.wpe.weight.numel()
    assert model.flops_per_token == 6 * non_position + 12 * 12 * 768 * 1024


def test_only_llama_splits_over_tensor_parallel_ranks():
    assert "lm.model.layers.*.self_attn.q_proj" in CausalLM(family="llama", **TINY_LM).tensor_parallel_plan()
    with pytest.raises(ValueError, match="family=gpt2: its fused q/k/v Conv1D layers cannot be split"):
        CausalLM(**TINY_LM).tensor_parallel_plan()


def test_the_resnet_layout_computes_what_torchvisions_resnet_computes(tmp_path):
    import torchvision.models as models

    torch.manual_seed(0)
    reference = models.resnet18(num_classes=5).eval()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    model = VisionClassifier("resnet18", num_classes=5, image_size=32, weights_path=str(tmp_path / "weights.pt")).eval()
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(images), reference(images), rtol=0, atol=0)
    assert repeated_block_list(model)[0] == "blocks" and len(model.blocks) == 8  # every residual block, flat


def test_resnet50_flops_are_the_published_ones():
    # torchvision's ResNet-50: 4.09 GMACs a 224 image forward; training is 3 forwards' worth, 2 FLOPs a MAC.
    assert VisionClassifier("resnet50").flops_per_sample == pytest.approx(3 * 2 * 4.09e9, rel=0.01)


def test_other_architectures_keep_torchvisions_layout_and_its_block_list():
    model = VisionClassifier("vit_b_16", num_classes=3)
    assert repeated_block_list(model)[0] == "net.encoder.layers"
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3)


@pytest.mark.parametrize("knobs, message", [
    ({"arch": "resnet05"}, "arch=resnet05: not a torchvision classification model (did you mean resnet50"),
    ({"arch": "resnet18", "weights_path": "none.pt"}, "weights_path=none.pt: no such file"),
])
def test_wrong_architectures_and_files_are_named(knobs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        VisionClassifier(**knobs)


# --------------------------------------------------------------------------- figures at every input size


def forward_flops(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])  # the ResNet layout, and torchvision's own
def test_vision_flops_follow_the_image_size(arch):
    """A training step is 3 forwards' worth: torch's FLOP counter on the model's own forward of one
    image of the data's size (for ResNet-18, 49x fewer at 32 than at 224 pixels)."""
    flops = {}
    for size in (32, 64):
        model = VisionClassifier(arch, num_classes=4, image_size=size).eval()
        flops[size] = model.flops_per_sample
        assert flops[size] == 3 * forward_flops(model, torch.randn(1, 3, size, size))
    assert flops[64] > 2 * flops[32]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_flops_per_token_follow_the_sequence_length(monkeypatch, family):
    """Against torch's FLOP counter on a training step over seq_len tokens: 6 per weight a token
    meets and attention's share, which grows with the context (PaLM's appendix B)."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention_in_plain_matmuls)
    for seq_len in (16, 64):
        model = CausalLM(family=family, **{**TINY_LM, "seq_len": seq_len, "n_layers": 2})
        tokens = torch.randint(128, (1, seq_len))
        with FlopCounterMode(display=False) as counter:
            model.loss(model(tokens), tokens).backward()
        # The formula also counts biases and norms as weights: under 2% more here.
        assert model.flops_per_token * seq_len == pytest.approx(counter.get_total_flops(), rel=0.02), seq_len


# --------------------------------------------------------------------------- every knob
# Each check builds the model with one knob changed (make(knob=value)) and finds its effect in what
# the model computes or holds, against counts, shapes and schedules written here; a constructor
# argument or conf key without a check fails test_every_knob_of_the_fields_models_has_a_check.

Make = Callable[..., torch.nn.Module]


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def gpt2_parameters(vocab_size=128, seq_len=32, d_model=64, n_layers=3, ffn_dim=None, tied=True, **_) -> int:
    """Token and position embeddings; layers of 2 LayerNorms, the fused q/k/v and output
    projections and an MLP, with biases; the final LayerNorm; the head, bias-free, unless tied."""
    d, f = d_model, ffn_dim or 4 * d_model
    layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return (vocab_size + seq_len) * d + n_layers * layer + 2 * d + (0 if tied else vocab_size * d)


def llama_parameters(vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=None, ffn_dim=None, tied=True,
                     **_) -> int:
    """The token embedding; layers of 2 RMSNorms, q/k/v/o projections (k and v for n_kv_heads) and a
    gated MLP, without biases; the final RMSNorm; the head unless tied. No position weights (rotary)."""
    d, f, kv = d_model, ffn_dim or 4 * d_model, (n_kv_heads or n_heads) * d_model // n_heads
    layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * f
    return vocab_size * d + n_layers * layer + d + (0 if tied else vocab_size * d)


def lm_sizes(family: str = "gpt2", **knob: int) -> Callable[[Make], None]:
    """A size knob: the parameters are the formula's with it, and logits come for every token."""
    def check(make: Make) -> None:
        model = make(family=family, **knob)
        formula = gpt2_parameters if family == "gpt2" else llama_parameters
        assert count(model) == formula(**{**TINY_LM, **knob}), knob
        vocab = knob.get("vocab_size", 128)
        assert model(torch.randint(vocab, (2, 8))).shape == (2, 8, vocab)

    return check


def family(make: Make) -> None:
    from transformers import LlamaForCausalLM

    model = make(family="llama")
    assert isinstance(model.lm, LlamaForCausalLM) and count(model) == llama_parameters()


def lm_seq_len(make: Make) -> None:
    model = make(seq_len=16)
    assert count(model) == gpt2_parameters(seq_len=16) and model(torch.randint(128, (1, 16))).shape == (1, 16, 128)
    with pytest.raises(IndexError):  # GPT-2 has no position past seq_len
        model(torch.randint(128, (1, 17)))


def lm_heads(make: Make) -> None:
    """The same weights split into 2 heads instead of 4 attend differently."""
    for family in ("gpt2", "llama"):
        two, four = make(family=family, n_heads=2).eval(), make(family=family).eval()
        two.load_state_dict(four.state_dict())
        tokens = torch.randint(128, (2, 8))
        attention = two.layers[0].self_attn if family == "llama" else two.layers[0].attn
        assert attention.head_dim == 32
        assert not torch.allclose(two(tokens), four(tokens)), family


def kv_heads(make: Make) -> None:
    model = make(family="llama", n_kv_heads=2)
    assert count(model) == llama_parameters(n_kv_heads=2) and model.layers[0].self_attn.k_proj.out_features == 2 * 16


def dropout(make: Make) -> None:
    """Training forwards of the same tokens differ with dropout, agree without; evaluation's agree."""
    tokens = torch.randint(128, (2, 8))
    for family in ("gpt2", "llama"):
        for rate, differ in ((0.5, True), (0.0, False)):
            model = make(family=family, dropout=rate)
            assert (not torch.equal(model.train()(tokens), model(tokens))) == differ, (family, rate)
            torch.testing.assert_close(model.eval()(tokens), model(tokens), rtol=0, atol=0)


def tie_embeddings(make: Make) -> None:
    """false: the head is a matrix of its own, not the token embedding's storage."""
    for family, formula in (("gpt2", gpt2_parameters), ("llama", llama_parameters)):
        for tied in (True, False):
            model = make(family=family, **({} if tied else {"tie_embeddings": False}))
            embedding = model.lm.get_input_embeddings().weight
            assert (model.lm.lm_head.weight.data_ptr() == embedding.data_ptr()) == tied, (family, tied)
            assert count(model) == formula(tied=tied), (family, tied)


def pretrained_path(make: Make, tmp_path: Path) -> None:
    saved = make(family="llama", n_layers=2)
    saved.lm.save_pretrained(tmp_path / "saved")
    loaded = make(pretrained_path=str(tmp_path / "saved"))  # family and sizes from the files
    tokens = torch.randint(128, (1, 8))
    assert (loaded.family, len(loaded.layers)) == ("llama", 2)
    torch.testing.assert_close(loaded.eval()(tokens), saved.eval()(tokens), rtol=0, atol=0)


def lr_factors(model: torch.nn.Module, total: int) -> list:
    """The learning rate of each of `total` optimizer steps, as a fraction of the optimizer's."""
    model.trainer = SimpleNamespace(estimated_stepping_batches=total)
    configured = model.configure_optimizers()
    if not isinstance(configured, dict):  # no schedule: the optimizer's rate throughout
        return [1.0] * total
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    factors = []
    for _ in range(total):
        factors.append(optimizer.param_groups[0]["lr"] / optimizer.defaults["lr"])
        optimizer.step()
        schedule.step()
    return factors


def cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(make: Make) -> None:
    """A linear warm-up over 4 steps, then the decay over the remaining 8 of 12 (cosine, to min_lr_ratio)."""
    model = make(warmup_steps=4, lr_decay="cosine", min_lr_ratio=0.0)
    expected = [0.25, 0.5, 0.75, 1.0] + [cosine(step / 8) for step in range(8)]
    assert lr_factors(model, 12) == pytest.approx(expected)


def lr_decay(make: Make) -> None:
    assert lr_factors(make(warmup_steps=0, lr_decay="linear", min_lr_ratio=0.0), 10) == pytest.approx(
        [1 - step / 10 for step in range(10)])
    assert lr_factors(make(warmup_steps=0, lr_decay="none", min_lr_ratio=0.0), 10) == [1.0] * 10


def min_lr_ratio(make: Make) -> None:
    assert lr_factors(make(warmup_steps=0, lr_decay="cosine", min_lr_ratio=0.5), 10) == pytest.approx(
        [0.5 + 0.5 * cosine(step / 10) for step in range(10)])


SCHEDULE = {"warmup_steps": warmup_steps, "lr_decay": lr_decay, "min_lr_ratio": min_lr_ratio,
            "optimizer": optimizer_knob}


def vision_arch(make: Make) -> None:
    import torchvision

    model = make(arch="squeezenet1_0")
    assert model.net is not None and count(model) == count(torchvision.models.squeezenet1_0(num_classes=4))


def vision_classes(make: Make) -> None:
    assert make(num_classes=7).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def vision_image_size(make: Make) -> None:
    model = make(image_size=48).eval()
    assert model.flops_per_sample == 3 * forward_flops(model, torch.randn(1, 3, 48, 48)) != make().flops_per_sample


def vision_weights(make: Make, tmp_path: Path) -> None:
    import torchvision

    reference = torchvision.models.resnet18(num_classes=4).eval()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(make(weights_path=str(tmp_path / "weights.pt")).eval()(images), reference(images),
                               rtol=0, atol=0)


def label_smoothing(make: Make) -> None:
    logits, labels = torch.randn(8, 4), torch.randint(4, (8,))
    for smoothing in (0.2, 0.0):
        model = make(**({"label_smoothing": smoothing} if smoothing else {}))
        expected = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
        torch.testing.assert_close(model.loss(logits, labels), expected)
    assert make(label_smoothing=0.2).loss(logits, labels) != make().loss(logits, labels)


FIELD = {VisionClassifier: ("vision", dict(arch="resnet18", num_classes=4, image_size=32)), CausalLM: ("causal_lm", TINY_LM)}
FIELD_KNOBS: dict = {
    VisionClassifier: {**SCHEDULE, "arch": vision_arch, "num_classes": vision_classes, "image_size": vision_image_size,
                       "weights_path": vision_weights, "channels_last": channels_last_knob,
                       "label_smoothing": label_smoothing},
    CausalLM: {**SCHEDULE, "family": family, "vocab_size": lm_sizes(vocab_size=96), "seq_len": lm_seq_len,
               "d_model": lm_sizes(d_model=32), "n_layers": lm_sizes(n_layers=2), "n_heads": lm_heads,
               "n_kv_heads": kv_heads, "ffn_dim": lm_sizes(ffn_dim=48), "dropout": dropout,
               "tie_embeddings": tie_embeddings, "pretrained_path": pretrained_path},
}


@pytest.mark.parametrize("model_class", list(FIELD), ids=[name for name, _ in FIELD.values()])
def test_every_knob_of_the_fields_models_has_a_check(model_class):
    assert set(FIELD_KNOBS[model_class]) == knobs_of(model_class, CONF_DIR / "model" / f"{FIELD[model_class][0]}.yaml")


@pytest.mark.parametrize("model_class, knob", [(m, k) for m in FIELD for k in sorted(FIELD_KNOBS[m])],
                         ids=[f"{FIELD[m][0]}-{k}" for m in FIELD for k in sorted(FIELD_KNOBS[m])])
def test_each_knob_of_the_fields_models_does_what_it_says(model_class, knob, tmp_path):
    torch.manual_seed(0)
    check = FIELD_KNOBS[model_class][knob]
    make = lambda **knobs: model_class(**{**FIELD[model_class][1], **knobs})  # noqa: E731
    check(make, tmp_path) if "tmp_path" in inspect.signature(check).parameters else check(make)
