"""Fleet's own rules for combining strategies, read from Paddle 3.3.1's static-graph
meta-optimizers, as JSON on stdout:

    python tests/paddle/meta_optimizers.py

- `meta_optimizers`: every meta-optimizer Fleet instantiates (MetaOptimizerFactory, each around
  an inner optimizer), by class name: its `white_list` (the meta-optimizers it may wrap: Fleet's
  StrategyCompiler chains A -> B when B's class name is in A's list), its `black_list`, and
  `graph_optimizer` (whether it is one of the graph optimizers, which are chained apart and are
  the only thing the black lists are checked against).
- `kept`: for each DistributedStrategy switch of SWITCHES alone and each pair of them (keys
  "a" and "a+b"), and for each inner optimizer of INNER_OPTIMIZERS, the meta-optimizers Fleet
  keeps as it does in `fleet.distributed_optimizer(...).minimize` (static graph, 2 collective
  workers): those whose `_can_apply` holds, chained by StrategyCompiler, outermost first. Fleet
  turns off, without a word, any meta-optimizer that applies but is left out of the chain.
"""
from __future__ import annotations

import itertools
import json
from typing import Callable, Dict, List

# Each switch with the configs it needs to apply: recompute needs checkpoints, gradient_merge
# k_steps > 1; the others apply on their defaults.
SWITCHES: Dict[str, Dict[str, object]] = {
    "amp": {},
    "recompute": {"recompute_configs": {"checkpoints": ["x"]}},
    "pipeline": {},
    "gradient_merge": {"gradient_merge_configs": {"k_steps": 2}},
    "lars": {},
    "lamb": {},
    "localsgd": {},
    "adaptive_localsgd": {},
    "dgc": {},
    "fp16_allreduce": {},
    "sharding": {},
}
WORKERS = ["127.0.0.1:6170", "127.0.0.1:6171"]  # dgc, localsgd and sharding apply only with 2 or more


def inner_optimizers() -> Dict[str, Callable]:
    """Some meta-optimizers apply only around one inner optimizer (lars, dgc: Momentum; lamb:
    Adam; localsgd: SGD or Momentum), so each selection is tried around each."""
    import paddle

    return {"SGD": lambda: paddle.optimizer.SGD(learning_rate=0.1),
            "Momentum": lambda: paddle.optimizer.Momentum(learning_rate=0.1),
            "Adam": lambda: paddle.optimizer.Adam(learning_rate=0.1)}


def meta_optimizer_lists() -> Dict[str, Dict[str, object]]:
    """Each meta-optimizer's lists, by class name (built around SGD: the lists do not depend on it)."""
    import paddle
    from paddle.distributed.fleet.base.meta_optimizer_factory import MetaOptimizerFactory

    return {type(meta).__name__: {"white_list": list(meta.meta_optimizers_white_list),
                                  "black_list": list(meta.meta_optimizers_black_list),
                                  "graph_optimizer": meta._is_graph_out()}
            for meta in MetaOptimizerFactory()._get_valid_meta_optimizers(paddle.optimizer.SGD(learning_rate=0.1))}


def kept(switches: List[str], make_inner: Callable) -> List[str]:
    """The meta-optimizers Fleet applies with `switches` on (fleet.py's static `minimize`, up to
    building the program)."""
    from paddle.distributed import fleet
    from paddle.distributed.fleet.base.meta_optimizer_factory import MetaOptimizerFactory
    from paddle.distributed.fleet.base.strategy_compiler import StrategyCompiler

    strategy = fleet.DistributedStrategy()
    for switch in switches:
        setattr(strategy, switch, True)
        for attribute, value in SWITCHES[switch].items():
            setattr(strategy, attribute, value)
    role_maker = fleet.UserDefinedRoleMaker(is_collective=True, current_id=0, worker_endpoints=WORKERS)
    inner = make_inner()
    candidates = MetaOptimizerFactory()._get_valid_meta_optimizers(inner)
    for meta in candidates:
        meta._set_basic_info(None, role_maker, inner, strategy)  # the loss only matters when building
    applying = [meta for meta in candidates if meta._can_apply()]
    compiler = StrategyCompiler()
    compiler.generate_optimizer(None, role_maker, inner, strategy,
                                [meta for meta in applying if not meta._is_graph_out()],
                                [meta for meta in applying if meta._is_graph_out()])
    return compiler._get_applied_meta_list()


def main() -> None:
    import paddle

    paddle.enable_static()  # meta-optimizers are Fleet's static-graph path
    selections = [[switch] for switch in SWITCHES] + [list(pair) for pair in itertools.combinations(SWITCHES, 2)]
    print(json.dumps({
        "meta_optimizers": meta_optimizer_lists(),
        "kept": {"+".join(selection): {name: kept(selection, make) for name, make in inner_optimizers().items()}
                 for selection in selections},
    }, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
