"""model=vision and model=causal_lm (runner/models/vision.py, causal_lm.py): the field's own
models, held against the libraries that define them: the same outputs as torchvision's and
transformers' own forward, the block lists every strategy needs, FLOPs as published, and the
one-line refusals. Training them: tests/test_real_models.py."""
from __future__ import annotations

import pytest
import torch

from plugins.modules import repeated_block_list
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
