"""strategy=[auto]'s memory estimates hold: recompute lowers the built-in GPT's, and each
memory strategy's estimate matches what the ranks of a real 2-process run hold (bench/auto_memory.py
measures them), where the estimate without that strategy's memory model would not."""
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
TOLERANCE = 0.2  # recompute keeps the head's activations in its estimate; backward has freed them by the rebuild


def test_recompute_lowers_the_estimate_of_a_model_with_two_blocks():
    facts = gather_facts(GPTDecoder, SyntheticLanguageModelData(), device="cpu", world_size=1, num_nodes=1,
                         batch_size=32, device_memory_gb=None)
    assert facts.blocks == 2
    # The blocks hold most of the activations; their inputs and one block's are what recompute keeps.
    assert 0 < facts.largest_block_bytes < facts.block_activation_bytes < facts.activation_bytes
    assert 0 < facts.block_input_bytes < facts.largest_block_bytes
    plain, _ = estimate(facts, {})
    recomputed, _ = estimate(facts, {"recompute": schemas()["recompute"]()})
    kept = (facts.activation_bytes - facts.block_activation_bytes + facts.block_input_bytes
            + facts.largest_block_bytes)
    assert recomputed.activations == pytest.approx(kept) and recomputed.activations < 0.7 * plain.activations
    # Facts written by hand (no block split measured) keep the even-blocks rule.
    by_hand = dataclasses.replace(facts, block_activation_bytes=None)
    assert estimate(by_hand, {"recompute": schemas()["recompute"]()})[0].activations == plain.activations


def test_amp_estimate_counts_what_autocast_saves():
    facts = gather_facts(GPTDecoder, SyntheticLanguageModelData(), device="cpu", world_size=1, num_nodes=1,
                         batch_size=32, device_memory_gb=None)
    # Not half: the layer norms and the loss stay float32, and the weights' 16-bit copies are saved too.
    assert 0.5 * facts.activation_bytes < facts.amp_activation_bytes < 0.8 * facts.activation_bytes


def test_each_memory_strategy_estimate_matches_two_ranks(tmp_path):
    listed = [entry for entry in estimates("gpt", 2) if entry["label"] in ("none", *CHANGED)]
    measure("gpt", 2, listed, tmp_path, timeout=300)
    plain = next(entry["estimate"] for entry in listed if entry["label"] == "none")  # Memory.of(facts)
    assert {entry["label"] for entry in listed} == {"none", *CHANGED}
    for entry in listed:
        for kind, measured in entry["measured"].items():
            assert entry["estimate"][kind] == pytest.approx(measured, rel=TOLERANCE), (entry["label"], kind)
        for kind in CHANGED.get(entry["label"], ()):
            # Without the strategy's memory model the estimate would be the plain one: off by more.
            assert plain[kind] != pytest.approx(entry["measured"][kind], rel=TOLERANCE), (entry["label"], kind)
