"""strategy=[auto]'s memory estimates hold: recompute lowers the built-in GPT's, and each
memory strategy's estimate, alone and where strategies meet, matches what the ranks of a real
2-process run hold (bench/auto_memory.py measures them), where the estimate without that
strategy's memory model would not."""
from __future__ import annotations

import dataclasses

import pytest

from bench.auto_memory import estimates, measure
from plugins.auto import gather_facts
from runner.data import SyntheticLanguageModelData
from runner.models import GPTDecoder
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
    assert estimate(by_hand, {"recompute": schemas()["recompute"]()})[0].activations == plain.activations


def test_amp_estimate_counts_what_autocast_saves():
    facts = gather_facts(GPTDecoder, SyntheticLanguageModelData(), device="cpu", world_size=1, num_nodes=1,
                         batch_size=32, device_memory_gb=None)
    float32, autocast, gathered = (facts.saved[p] for p in ("float32", "autocast", "autocast_16bit_parameters"))
    # Not half: the layer norms and the loss stay float32, and the weights' 16-bit copies are saved
    # too; those do not shrink with the batch. With 16-bit parameters (FSDP2) there are no copies.
    assert 0.5 * float32["total"] < autocast["total"] < 0.8 * float32["total"]
    assert autocast["total_fixed"] > 4 * float32["total_fixed"] and gathered["total_fixed"] == float32["total_fixed"]
    assert gathered["total"] < autocast["total"] - autocast["total_fixed"]


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
