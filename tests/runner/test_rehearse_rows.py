"""Issue 42's memory check on representative rows of conf/compat.yaml (bench/rehearsal.py runs
them all): the rehearsal's parts and step peak against what real 2-process runs hold over their
second step (bench/auto_memory.py's PeakMemory(step=2)), every rank rehearsed: every part and the
step's peak within 15%, on the built-in GPT and on torchvision's ResNet-18 (bench/RESULTS.md,
"Rehearsal against real runs", has every row)."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

pytestmark = pytest.mark.slow

WORLD = 2
CHECKED = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "temporaries", "step_peak")
# (model, label) -> overrides: the plain run, ZeRO stage 3, a pipeline of 2 stages, recompute under
# amp, and DGC with recompute on GPT; on ResNet-18, ZeRO stage 3 under bfloat16 amp (a CPU run's
# reduce-scatter is gloo's, which holds a float32 copy of the whole unit's gradients: the rehearsal
# missed it, -27.7% at the step's peak), local SGD averaging at the second step (its averaging runs
# in a callback, which the rehearsal's tracker did not count: the parameters -50%, the step's peak
# -8.3%) and ZeRO stage 3 with recompute. Each part is taken at its own peak, after every op (it
# was taken at modules' hooks: ResNet-18's recompute+sharding temporaries -59.9%, amp+sharding's
# gradients -17.4%); a recomputed block's forward makes temporaries, checkpoint's aliases of a
# rebuilt tensor are the rebuild's (GPT's recompute rows' temporaries -23% to -31%); DGC's momentum
# and residual made in the first step are temporaries the real run holds, which its measure missed
# (dgc+recompute +20%).
ROWS = {
    ("gpt", "plain"): [],
    ("gpt", "sharding stage 3"): ["strategy=[sharding]", "strategy.sharding.stage=3"],
    ("gpt", "pipeline"): ["strategy=[pipeline]"],
    ("gpt", "amp+recompute"): ["strategy=[amp,recompute]"],
    ("gpt", "dgc+recompute"): ["strategy=[dgc,recompute]", "model/optimizer=sgd"],
    ("resnet18", "amp+sharding stage 3"): ["strategy=[amp,sharding]", "strategy.amp.dtype=bfloat16",
                                           "strategy.sharding.stage=3"],
    ("resnet18", "amp+localsgd"): ["strategy=[amp,localsgd]", "strategy.amp.dtype=bfloat16"],
    ("resnet18", "recompute+sharding stage 3"): ["strategy=[recompute,sharding]", "strategy.sharding.stage=3"],
}


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Dict[tuple, Dict[str, Any]]:
    """Each row run for real and rehearsed (bench/rehearsal.py's way), one set of ranks per model
    for the real runs."""
    from bench.auto_memory import measure
    from bench.rehearsal import MODELS, REAL, deviations, rehearse

    found = {}
    for model in sorted({model for model, _ in ROWS}):
        where = tmp_path_factory.mktemp(model)
        listed: List[Dict[str, Any]] = [{"label": label, "overrides": overrides, "batch_size": 0, "micro_batch": 0}
                                        for (row_model, label), overrides in ROWS.items() if row_model == model]
        measure(model, WORLD, listed, where / "real", quiet=REAL, models=MODELS)
        for index, entry in enumerate(listed):
            rehearse(model, WORLD, entry, where / f"rehearsed{index}")
            assert "failed" not in entry, entry
            entry["deviation"] = deviations(entry)
            found[(model, entry["label"])] = entry
    return found


@pytest.mark.parametrize("row", list(ROWS), ids=[f"{model}-{label}" for model, label in ROWS])
def test_rehearsed_parts_and_peak_are_within_15_percent_of_a_real_run(compared, row):
    entry = compared[row]
    checked = {part: entry["deviation"][part] for part in CHECKED}
    outside = {part: value for part, value in checked.items() if value is None or abs(value) > 0.15}
    assert not outside, (outside, entry["measured"], entry["rehearsed"])
