"""Issue 42's memory check on representative rows of conf/compat.yaml (bench/rehearsal.py runs
them all): the rehearsal's parts and step peak against what real 2-process runs hold over their
second step (bench/auto_memory.py's PeakMemory(step=2)), every rank rehearsed: the model state,
the activations and the step's peak within 15%. Temporaries and buffers are compared by the bench,
not here: the two trackers split what is neither model state nor saved for backward differently
(bench/RESULTS.md, "Rehearsal against real runs")."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

pytestmark = pytest.mark.slow

WORLD = 2
CHECKED = ("parameters", "gradients", "optimizer_states", "activations", "step_peak")
# Label -> overrides: the plain run, ZeRO stage 3, a pipeline of 2 stages, recompute under amp.
ROWS = {
    "plain": [],
    "sharding stage 3": ["strategy=[sharding]", "strategy.sharding.stage=3"],
    "pipeline": ["strategy=[pipeline]"],
    "amp+recompute": ["strategy=[amp,recompute]"],
}


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> List[Dict[str, Any]]:
    """Each row run for real and rehearsed (bench/rehearsal.py's way), one set of ranks for the real runs."""
    from bench.auto_memory import measure
    from bench.rehearsal import MODELS, REAL, deviations, rehearse

    where = tmp_path_factory.mktemp("rows")
    listed = [{"label": label, "overrides": overrides, "batch_size": 0, "micro_batch": 0}
              for label, overrides in ROWS.items()]
    measure("gpt", WORLD, listed, where / "real", quiet=REAL, models=MODELS)
    for index, entry in enumerate(listed):
        rehearse("gpt", WORLD, entry, where / f"rehearsed{index}")
        assert "failed" not in entry, entry
        entry["deviation"] = deviations(entry)
    return listed


@pytest.mark.parametrize("label", list(ROWS))
def test_rehearsed_parts_and_peak_are_within_15_percent_of_a_real_run(compared, label):
    entry = next(entry for entry in compared if entry["label"] == label)
    checked = {part: entry["deviation"][part] for part in CHECKED}
    outside = {part: value for part, value in checked.items() if value is None or abs(value) > 0.15}
    assert not outside, (outside, entry["measured"], entry["rehearsed"])
