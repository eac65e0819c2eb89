"""conf/compat.yaml against Fleet's own rules: the pairs of strategies Paddle 3.3.1's static-graph
meta-optimizers compose (their white lists, read from Paddle by tests/paddle/meta_optimizers.py),
the pairs our table allows, and the differences documented in docs/strategies.md ("Combinations,
compared with Paddle's meta-optimizers"). A new difference, on either side, fails here until it
is documented; a documented one that is gone fails too."""
from __future__ import annotations

import itertools
import json
import re
from typing import Dict, Optional, Set, Tuple

import pytest

from tests.helpers.paddle_reference import run_paddle
from runner.config.compat import check, load_table
from tests.helpers.commands import PROJECT_ROOT
from runner.core.errors import Refusal

TABLE = load_table()
# Our strategy -> the meta-optimizer Fleet builds for the DistributedStrategy switch of the same
# name. auto builds none: Fleet acts on `auto` only when no other switch is set (_is_strict_auto).
META_OPTIMIZER: Dict[str, Optional[str]] = {
    "adaptive_localsgd": "AdaptiveLocalSGDOptimizer",
    "amp": "AMPOptimizer",
    "auto": None,
    "dgc": "DGCOptimizer",
    "fp16_allreduce": "FP16AllReduceOptimizer",
    "gradient_merge": "GradientMergeOptimizer",
    "lamb": "LambOptimizer",
    "lars": "LarsOptimizer",
    "localsgd": "LocalSGDOptimizer",
    "pipeline": "PipelineOptimizer",
    "recompute": "RecomputeOptimizer",
    "sharding": "ShardingOptimizer",
}
# Fleet's meta-optimizers with no lightfleet strategy: plain data parallelism (lightfleet's DDP
# without a strategy), sparsity, quantization-aware training, parameter servers, and tensor
# parallelism (in lightfleet a degree of sharding, strategy.sharding.mp_degree).
WITHOUT_COUNTERPART = {"RawProgramOptimizer", "ASPOptimizer", "QATOptimizer", "ParameterServerOptimizer",
                       "TensorParallelOptimizer"}
SECTION = "## Combinations, compared with Paddle's meta-optimizers"
DOCUMENTED_ROW = re.compile(r"^\| `(\w+)` \+ `(\w+)` \| (composed|not composed) \| (allowed|refused) \|", re.M)

Difference = Tuple[str, str, str]  # ("a+b" in alphabetical order, what Paddle's lists say, what our table says)


@pytest.fixture(scope="module")
def paddle() -> dict:
    return json.loads(run_paddle("meta_optimizers"))


def paddle_composes(a: str, b: str, meta_optimizers: dict) -> bool:
    """Fleet's StrategyCompiler chains two meta-optimizers when one names the other in its white
    list (MetaOptimizerBase._can_update); a strategy without a meta-optimizer chains with none."""
    first, second = META_OPTIMIZER[a], META_OPTIMIZER[b]
    if first is None or second is None:
        return False
    return second in meta_optimizers[first]["white_list"] or first in meta_optimizers[second]["white_list"]


def we_allow(a: str, b: str) -> bool:
    try:
        check([a, b], TABLE)
    except Refusal:
        return False
    return True


def difference(a: str, b: str, composes: bool, allows: bool) -> Difference:
    return ("+".join(sorted((a, b))), "composed" if composes else "not composed", "allowed" if allows else "refused")


def documented() -> Set[Difference]:
    text = (PROJECT_ROOT / "docs" / "strategies.md").read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return {difference(a, b, paddle == "composed", ours == "allowed")
            for a, b, paddle, ours in DOCUMENTED_ROW.findall(section)}


def test_every_strategy_and_meta_optimizer_is_mapped(paddle):
    assert set(META_OPTIMIZER) == set(TABLE.known)
    mapped = {name for name in META_OPTIMIZER.values() if name is not None}
    assert set(paddle["meta_optimizers"]) == mapped | WITHOUT_COUNTERPART
    # Black lists only keep graph optimizers out; none of these is one, so white lists decide.
    assert not any(paddle["meta_optimizers"][name]["graph_optimizer"] for name in mapped)


@pytest.mark.parametrize("strategy", sorted(name for name, meta in META_OPTIMIZER.items() if meta is not None))
def test_the_switch_of_our_name_turns_on_the_mapped_meta_optimizer(paddle, strategy):
    assert any(META_OPTIMIZER[strategy] in kept for kept in paddle["kept"][strategy].values())


def test_white_lists_decide_which_pairs_fleet_keeps_together(paddle):
    """Fleet keeps both meta-optimizers of a pair (around some inner optimizer) exactly when the
    white lists chain them: for pairs, the lists are the whole rule."""
    for selection, kept_by_inner in paddle["kept"].items():
        if "+" in selection:
            a, b = selection.split("+")
            both_kept = any({META_OPTIMIZER[a], META_OPTIMIZER[b]} <= set(kept) for kept in kept_by_inner.values())
            assert both_kept == paddle_composes(a, b, paddle["meta_optimizers"]), selection


def test_differences_from_paddle_are_the_documented_ones(paddle):
    differing = set()
    for a, b in itertools.combinations(TABLE.known, 2):
        composes, allows = paddle_composes(a, b, paddle["meta_optimizers"]), we_allow(a, b)
        if composes != allows:
            differing.add(difference(a, b, composes, allows))
    documented_differences = documented()
    assert {"undocumented": sorted(differing - documented_differences),
            "documented but gone": sorted(documented_differences - differing)} == {"undocumented": [],
                                                                                  "documented but gone": []}
