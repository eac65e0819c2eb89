"""strategy=[auto]'s memory estimates hold: recompute lowers the built-in GPT's, and each
memory strategy's estimate, alone and where strategies meet, matches what the ranks of a real
2-process run hold (bench/auto_memory.py measures them), where the estimate without that
strategy's memory model would not. A run planned for CUDA, on a machine without a GPU, is
measured with CUDA's autocast rules and attention kernels; the loss's backward over a large
vocabulary is counted on top of what is saved."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from bench.auto_memory import estimate_for, estimates, measure
from plugins.auto import gather_facts, saved_activations
from runner.core.contribution import SAVED_PARTS, SAVED_PRECISIONS, Facts
from runner.data import SyntheticLanguageModelData
from runner.models import CausalSelfAttention, ClassifierModule, GPTDecoder
from runner.strategies import schemas
from runner.strategies.auto import estimate

# Where each strategy's estimate differs from the plain one, by candidate label (GPT, AdamW, 2
# processes); at stages 2 and 3 the unsharded gradients of this one-unit model bring the gradients
# back to the plain figure.
CHANGED = {
    "recompute": ("activations",),
    "amp(dtype=bfloat16)": ("activations",),
    "gradient_merge(k_steps=2)": ("activations",),
    "sharding(stage=1)": ("optimizer_states",),
    "sharding(stage=2)": ("parameters", "optimizer_states"),
    "sharding(stage=3)": ("parameters", "optimizer_states"),
    "pipeline": ("parameters", "gradients", "optimizer_states", "activations"),
}
# Where strategies meet (Memory.held_activations): amp's 16-bit weight copies do not shrink with
# gradient merging's micro-batches; FSDP2 gathers 16-bit parameters, so autocast copies none; the
# pipeline rebuilds one block of one micro-batch at a time.
COMPOUND = ("amp(dtype=bfloat16)+gradient_merge(k_steps=4)", "amp(dtype=bfloat16)+sharding(stage=2)",
            "pipeline+recompute")
TOLERANCE = 0.2


def test_recompute_lowers_the_estimate_of_a_model_with_two_blocks():
    facts = gather_facts(GPTDecoder, SyntheticLanguageModelData(), device="cpu", world_size=1, num_nodes=1,
                         batch_size=32, device_memory_gb=None)
    saved = facts.saved["float32"]
    assert facts.blocks == 2 and saved["total"] == facts.activation_bytes
    # The blocks hold most of the activations; their inputs are what recompute keeps of them, and
    # one block's own while backward rebuilds it, by when the head's are freed.
    assert 0 < saved["largest_block"] < saved["in_blocks"] < saved["total"]
    assert 0 < saved["block_inputs"] < saved["head"] < saved["largest_block"]
    plain, _ = estimate(facts, {})
    recomputed, _ = estimate(facts, {"recompute": schemas()["recompute"]()})
    kept = saved["total"] - saved["in_blocks"] + saved["block_inputs"] + saved["largest_block"] - saved["head"]
    assert recomputed.activations == pytest.approx(kept) and recomputed.activations < 0.7 * plain.activations
    # Facts written by hand (nothing measured) keep the even-blocks rule: 2 of 2 blocks kept.
    by_hand = dataclasses.replace(facts, saved=None)
    assert estimate(by_hand, {"recompute": schemas()["recompute"]()})[0].activations == facts.activation_bytes


def test_amp_estimate_counts_what_autocast_saves():
    facts = gather_facts(GPTDecoder, SyntheticLanguageModelData(), device="cpu", world_size=1, num_nodes=1,
                         batch_size=32, device_memory_gb=None)
    float32, autocast, gathered = (facts.saved[p] for p in ("float32", "autocast", "autocast_16bit_parameters"))
    # Not half: the layer norms and the loss stay float32, and the weights' 16-bit copies are saved
    # too; those do not shrink with the batch. With 16-bit parameters (FSDP2) there are no copies.
    assert 0.5 * float32["total"] < autocast["total"] < 0.8 * float32["total"]
    assert autocast["total_fixed"] > 4 * float32["total_fixed"] and gathered["total_fixed"] == float32["total_fixed"]
    assert gathered["total"] < autocast["total"] - autocast["total_fixed"]


@pytest.mark.slow
def test_each_memory_strategy_estimate_matches_two_ranks(tmp_path):
    listed = [entry for entry in estimates("gpt", 2) if entry["label"] in ("none", *CHANGED, *COMPOUND)]
    measure("gpt", 2, listed, tmp_path, timeout=300)
    plain = next(entry["estimate"] for entry in listed if entry["label"] == "none")  # Memory.of(facts)
    assert {entry["label"] for entry in listed} == {"none", *CHANGED, *COMPOUND}
    for entry in listed:
        for kind, measured in entry["measured"].items():
            assert entry["estimate"][kind] == pytest.approx(measured, rel=TOLERANCE), (entry["label"], kind)
        for kind in CHANGED.get(entry["label"], ()):
            # Without the strategy's memory model the estimate would be the plain one: off by more.
            assert plain[kind] != pytest.approx(entry["measured"][kind], rel=TOLERANCE), (entry["label"], kind)


# --------------------------------------------------------------------------- planned for CUDA


class NormSoftmax(nn.Module):
    """A linear layer, a layer norm, a softmax and a linear head; no loss."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.softmax(self.norm(self.proj(x)), -1))


def saved_on(device: str, build, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    with torch.device("meta"):
        model = build()
    return saved_activations(model, (inputs, targets), [], device)


def test_planned_for_cuda_the_facts_keep_in_float32_what_cuda_autocast_keeps():
    batch, features, hidden, classes = 32, 16, 64, 8
    inputs, targets = torch.zeros(batch, features), torch.zeros(batch, dtype=torch.long)
    cpu, cuda = (saved_on(device, lambda: NormSoftmax(features, hidden, classes), inputs, targets)["autocast"]["total"]
                 for device in ("cpu", "cuda"))
    # Both: the first layer's 16-bit input (its weight needs no copy: the input needs no gradient)
    # and the head's 16-bit weight copy.
    both = 2 * batch * features + 2 * hidden * classes
    # CPU autocast keeps all in 16 bits: the layer norm's input, its mean and 1/std, the softmax's output.
    assert cpu == both + 2 * batch * hidden + 2 * 2 * batch + 2 * batch * hidden
    # CUDA's keeps layer_norm and softmax in float32: the norm's input cast to float32, its mean
    # and 1/std, the softmax's float32 output and the head's 16-bit copy of it.
    assert cuda == both + 4 * batch * hidden + 2 * 4 * batch + 4 * batch * hidden + 2 * batch * hidden


def test_planned_for_cuda_attention_saves_what_a_gpu_kernel_saves():
    """Without a GPU, torch's choice of attention kernel takes the math path, which saves the whole
    attention matrix; a GPU's fused kernels save the inputs, the output and the log-sum-exp."""
    batch, length, width, heads = 4, 256, 64, 4
    saved = saved_on("cuda", lambda: CausalSelfAttention(width, heads), torch.zeros(batch, length, width),
                     torch.zeros(batch, dtype=torch.long))
    # The projections' input; q, k and v; the attention's output and log-sum-exp (float32), its
    # random seed and offset (two int64); the output projection's input (a copy, heads merged).
    for precision, size in (("float32", 4), ("autocast_16bit_parameters", 2)):
        assert saved[precision]["total"] == 5 * size * batch * length * width + 4 * batch * heads * length + 16


class LanguageModelHead(ClassifierModule):
    """Features [B, T, width] -> logits over a vocabulary [B, T, vocabulary], cross-entropy."""

    def __init__(self, width: int, vocabulary: int) -> None:
        super().__init__()
        self.head = nn.Linear(width, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_the_loss_backward_over_a_large_vocabulary_is_counted_by_the_devices_rules():
    batch, length, width, vocabulary = 4, 16, 8, 4096
    logits = batch * length * vocabulary
    inputs, targets = torch.zeros(batch, length, width), torch.zeros(batch, length, dtype=torch.long)
    cpu, cuda = (saved_on(device, lambda: LanguageModelHead(width, vocabulary), inputs, targets)
                 for device in ("cpu", "cuda"))
    # In float32, and under CPU autocast (which casts cross-entropy's input to float32 first): at
    # the start of backward the gradients of nll_loss's input and of log-softmax's, both float32.
    for split in (cpu["float32"], cpu["autocast"], cuda["float32"]):
        assert split["loss_backward"] == pytest.approx(2 * 4 * logits, rel=1e-3)
        assert split["loss_backward_fixed"] == 0  # it grows with the batch
    # CUDA autocast computes log-softmax in 16 bits (saved) and casts it to float32 for nll_loss
    # (saved too): 2 bytes a logit more saved than CPU's float32 log-softmax; in backward nll_loss's
    # float32 gradient, its float32 input freed before the 16-bit gradients come.
    assert cuda["autocast"]["total"] - cpu["autocast"]["total"] == 2 * logits
    assert cuda["autocast"]["loss_backward"] == pytest.approx(4 * logits, rel=1e-3)


def split(**parts: float) -> dict:
    """Facts.saved's split of one precision: these parts (the others 0), none fixed."""
    return {**{part: 0 for part in SAVED_PARTS}, **{f"{part}_fixed": 0 for part in SAVED_PARTS}, **parts}


@pytest.mark.parametrize("loss", [300, 50], ids=["the_loss_backward_is_larger", "a_rebuild_is_larger"])
def test_the_loss_backward_comes_on_top_of_everything_saved(loss):
    parts = dict(total=1000, head=100, in_blocks=800, block_inputs=80, largest_block=200, loss_backward=loss)
    facts = Facts(parameters=0, optimizer="sgd", blocks=4, has_loss=True, activation_bytes=1000, batch_size=8,
                  world_size=2, saved={precision: split(**parts) for precision in SAVED_PRECISIONS})

    def activations(**strategies) -> float:
        return estimate(facts, {name: schemas()[name](**knobs) for name, knobs in strategies.items()})[0].activations

    assert activations() == 1000 + loss
    assert activations(gradient_merge={"k_steps": 2}) == (1000 + loss) / 2
    # Recompute: the blocks' inputs in place of their own, then the larger of the two moments:
    # the loss's backward, or one block rebuilt once the head's saved tensors are freed.
    assert activations(recompute={}) == 1000 - 800 + 80 + max(loss, 200 - 100)
    # Pipeline (2 stages, 4 micro-batches, 1F1B: 2 alive): half the layers of two micro-batches,
    # and each one's stage output the schedule holds (a block's output, of 4 blocks' inputs 80);
    # the last stage computes the whole loss of one micro-batch, not half of it.
    assert activations(pipeline={}) == 0.5 * 2 * 1000 / 4 + 2 * 80 / 4 / 4 + loss / 4


def test_estimate_for_plans_the_composed_run_for_its_accelerator():
    """bench/auto_memory.py's estimate_for, for the GPU benchmark: on this machine without a GPU,
    trainer.accelerator=gpu plans for CUDA."""
    gpt = ["model=gpt", "data=language_model", "strategy=[amp]"]
    on_gpu, on_cpu = (estimate_for([*gpt, f"trainer.accelerator={accelerator}"]) for accelerator in ("gpu", "cpu"))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPTDecoder(vocab_size=64, seq_len=32, d_model=64, n_heads=4,
                                                       n_layers=2).parameters())
    assert on_gpu["parameters"] == on_gpu["gradients"] == 4 * parameters and on_gpu["optimizer_states"] == 8 * parameters
    assert on_gpu["total"] == pytest.approx(sum(on_gpu[kind] for kind in
                                                ("parameters", "gradients", "optimizer_states", "activations")))
    # The loss over the 32 x 32 tokens' 64 logits (conf/model/gpt.yaml, conf/data/language_model.yaml):
    # CUDA's autocast saves the 16-bit log-softmax and its float32 copy (6 bytes a logit, CPU's 4),
    # and its backward holds one float32 gradient beyond them (4 bytes a logit, CPU's two: 8).
    assert on_cpu["activations"] - on_gpu["activations"] == pytest.approx(2 * 32 * 32 * 64, rel=0.01)
    # Gradient merging trains data.batch_size a micro-batch: the same activations as without it.
    merged = estimate_for([*gpt, "strategy=[amp,gradient_merge]", "strategy.gradient_merge.k_steps=2",
                           "trainer.accelerator=gpu"])
    assert merged["activations"] == pytest.approx(on_gpu["activations"], rel=0.01)
