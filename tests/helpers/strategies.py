"""What the suite asks of every strategy besides its own tests, declared here, one section per
strategy (in the registry's order), for the tests that cover them all:

- `wiring`: cases of non-default knobs, each set on the command line of a real run and read back
  off the object that carries it out (tests/test_wiring.py, through tests/helpers/probe.py:Wiring
  in the ranks); a knob without a case fails there.
- `row`: the settings under which the strategy acts in a row of conf/compat.yaml, and `row_effect`:
  what it must visibly do there, asserted over every rank's record of tests/helpers/probe.py:Effects
  (tests/test_combinations.py trains every allowed row). A strategy in no row declares neither.

A strategy's own tests stay in tests/plugins/test_<name>.py; this module imports none of them.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytorch_lightning as pl
import torch
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.optim import ZeroRedundancyOptimizer

from plugins.adaptive_localsgd import AdaptiveModelAveraging
from plugins.gradient_merge import GradientSum
from plugins.localsgd import ModelAveraging
from runner.records.files import AGAIN

Reader = Callable[[pl.Trainer, pl.LightningModule], Any]


@dataclass
class Knob:
    """A knob set to `value` on the command line, and how to read it off the objects of a run."""

    value: Any
    read: Reader
    expected: Any = None  # what `read` must return, when it is not `value` itself

    def override(self, strategy: str, name: str) -> str:
        text = json.dumps(self.value) if not isinstance(self.value, str) else self.value
        return f"strategy.{strategy}.{name}={text.replace(' ', '')}"


@dataclass
class WiringCase:
    """Non-default knobs of one strategy, set together in one run with `overrides`. With
    `from_run_dir`, each knob's `read` takes the run directory after the command ends instead
    (strategy=[auto]: what it tried and chose is written there, and search_only trains nothing)."""

    knobs: Dict[str, Knob]
    overrides: List[str] = field(default_factory=list)
    from_run_dir: bool = False


@dataclass(frozen=True)
class StrategyTests:
    """One strategy's declared test data (see the module's docstring)."""

    wiring: List[WiringCase]
    row: List[str] = field(default_factory=list)
    row_effect: Optional[Callable[[List[Dict[str, Any]]], None]] = None


STRATEGIES: Dict[str, StrategyTests] = {}


# --------------------------------------------------------------------------- readers shared by lars and lamb


def group_key(key: str):
    return lambda trainer, model: trainer.optimizers[0].param_groups[0][key]


def excludes(pattern: str):
    """Reader: whether exactly the parameters named with `pattern` are flagged for no weight decay."""
    def read(trainer, model):
        names = {id(p): name for name, p in model.named_parameters()}
        return all(flag == (pattern in names[id(p)]) for group in trainer.optimizers[0].param_groups
                   for p, flag in zip(group["params"], group["no_weight_decay"]))
    return read


# --------------------------------------------------------------------------- adaptive_localsgd


def adaptive_averaging(trainer):
    return next(c for c in trainer.callbacks if isinstance(c, AdaptiveModelAveraging))


def adaptive_localsgd_row_effect(ranks):
    """The ranks drift apart between averagings and hold the same parameters right after one."""
    syncs = [state["metrics"].get("localsgd_syncs", 0.0) for state in ranks[0]["states"]]
    averaged = [i for i in range(1, len(syncs)) if syncs[i] > syncs[i - 1]]
    assert averaged, "no averaging"
    for i in range(2, len(syncs)):
        same = len({rank["states"][i]["checksum"] for rank in ranks}) == 1
        assert same == (i in averaged), (i, averaged)


STRATEGIES["adaptive_localsgd"] = StrategyTests(
    wiring=[WiringCase({
        "init_k_steps": Knob(3, lambda trainer, model: adaptive_averaging(trainer).init_k_steps),
        "begin_step": Knob(2, lambda trainer, model: [trainer.strategy.comm_hook_state.start_localSGD_iter,
                                                      adaptive_averaging(trainer).begin_step], [2, 2]),
    }, ["trainer.devices=2"])],
    row=["strategy.adaptive_localsgd.init_k_steps=3"],
    row_effect=adaptive_localsgd_row_effect)


# --------------------------------------------------------------------------- amp


def forced(dtype: torch.dtype):
    """Reader: the modules whose forward the precision lists replaced and which compute in `dtype`
    under bfloat16 autocast (a white-listed LayerNorm in bfloat16, a black-listed Linear in float32)."""
    def read(trainer, model):
        names = []
        for name, module in model.named_modules():
            if "forward" in vars(module):
                width = module.in_features if isinstance(module, torch.nn.Linear) else module.normalized_shape[0]
                with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
                    if module(torch.randn(2, width)).dtype == dtype:
                        names.append(name)
        return names
    return read


def scaler_state(key: str):
    return lambda trainer, model: trainer.precision_plugin.scaler.state_dict()[key]


def amp_row_effect(ranks):
    """Layers compute in half precision on every rank."""
    for rank in ranks:
        assert any({"torch.float16", "torch.bfloat16"} & batch["dtypes"] for batch in rank["batches"])


STRATEGIES["amp"] = StrategyTests(
    wiring=[
        WiringCase({"init_loss_scaling": Knob(1024.0, lambda trainer, model:
                                              trainer.precision_plugin.scaler._init_scale),
                    "use_dynamic_loss_scaling": Knob(False, scaler_state("use_dynamic_loss_scaling")),
                    "incr_every_n_steps": Knob(500, scaler_state("growth_interval")),
                    "decr_every_n_nan_or_inf": Knob(3, scaler_state("decr_every_n_nan_or_inf")),
                    "incr_ratio": Knob(4.0, scaler_state("growth_factor")),
                    "decr_ratio": Knob(0.25, scaler_state("backoff_factor"))}),
        WiringCase({"dtype": Knob("bfloat16", lambda trainer, model: trainer.precision_plugin.precision, "bf16-mixed"),
                    "custom_white_list": Knob(["blocks.1.net.0"], forced(torch.bfloat16)),
                    "custom_black_list": Knob(["head.1"], forced(torch.float32))}),
    ],
    row=[],  # float16 with loss scaling
    row_effect=amp_row_effect)


# --------------------------------------------------------------------------- auto


# Readers of what strategy=[auto] wrote in the run directory (tests/plugins/test_auto.py reads it so too).
def read(path: Path):
    return yaml.safe_load(path.read_text())


def candidate_rows(run: Path) -> list:
    with open(run / "auto" / "candidates.csv") as table:
        return list(csv.DictReader(table))


def trials(run: Path) -> list:
    return sorted((run / "auto" / "trials").iterdir()) if (run / "auto" / "trials").exists() else []


# Every knob read off what auto did, from the run directory; auto is in no row of the table.
STRATEGIES["auto"] = StrategyTests(
    wiring=[
        WiringCase({"mode": Knob("rules", lambda run: "search" if trials(run) else "rules"),
                    "allow_numerics_change": Knob(True, lambda run: any(row["strategies"].startswith("lars")
                                                                        for row in candidate_rows(run))),
                    "device_memory_gb": Knob(0.5, lambda run: read(run / "auto" / "choice.yaml")["facts"]
                                             ["device_memory_bytes"] / 2**30)}, from_run_dir=True),
        WiringCase({"trial_steps": Knob(3, lambda run: read(trials(run)[0] / "config.yaml")["trainer"]["max_steps"]),
                    "max_trials": Knob(1, lambda run: len([t for t in trials(run) if not t.name.endswith(AGAIN)])),
                    "search_only": Knob(True, lambda run: not (run / "results.yaml").exists()
                                        and (run / "auto" / "experiment" / "best.yaml").is_file())}, from_run_dir=True),
        # A budget spent at once: the first trial starts, no other.
        WiringCase({"budget_s": Knob(0.001, lambda run: len(trials(run)), expected=1)}, from_run_dir=True),
    ])


# --------------------------------------------------------------------------- dgc


def hook_state(key: str):
    return lambda trainer, model: getattr(trainer.strategy.comm_hook_state, key)


def dgc_row_effect(ranks):
    """What each rank hands to all_gather is under 5% of its dense gradient, and no gradient is all-reduced."""
    for rank in ranks:
        dense = 4 * rank["static"]["numel"]
        for batch in rank["batches"]:
            gathered = sum(size for op, _, size in batch["collectives"] if op == "all_gather")
            assert 0 < gathered < 0.05 * dense, (gathered, dense)
            assert all(size < 0.05 * dense for op, _, size in batch["collectives"] if op == "all_reduce")


STRATEGIES["dgc"] = StrategyTests(
    wiring=[WiringCase({"rampup_begin_step": Knob(1, hook_state("rampup_begin_step")),
                        "rampup_step": Knob(2, hook_state("rampup_step")),
                        "sparsity": Knob([0.5, 0.9], hook_state("sparsity"))}, ["trainer.devices=2"])],
    row=[],  # sparsity 0.999 from the first step
    row_effect=dgc_row_effect)


# --------------------------------------------------------------------------- fp16_allreduce


def wire_dtype(trainer, model):
    """Reader: the wire type of the communication hook DDP registered (torch's fp16/bf16 compress hooks)."""
    ((hook, _),) = trainer.strategy.model._comm_hooks
    return "bfloat16" if "bf16" in hook.__name__ else "float16" if "fp16" in hook.__name__ else hook.__name__


def fp16_allreduce_row_effect(ranks):
    """Every all-reduce of a training batch carries float16 (the gradients), on every rank."""
    for rank in ranks:
        reduced = [dtype for batch in rank["batches"] for op, dtype, _ in batch["collectives"] if op == "all_reduce"]
        assert reduced and set(reduced) == {"torch.float16"}, sorted(set(reduced))


STRATEGIES["fp16_allreduce"] = StrategyTests(
    wiring=[WiringCase({"dtype": Knob("bfloat16", wire_dtype)}, ["trainer.devices=2"])],
    row=[],  # float16
    row_effect=fp16_allreduce_row_effect)


# --------------------------------------------------------------------------- gradient_merge


def gradient_merge_row_effect(ranks):
    """One optimizer step per two batches."""
    for rank in ranks:
        assert [state["global_step"] for state in rank["states"]] == [i // 2 for i in range(len(rank["states"]))]


STRATEGIES["gradient_merge"] = StrategyTests(
    wiring=[WiringCase({
        "k_steps": Knob(3, lambda trainer, model: trainer.accumulate_grad_batches),
        # Summing: GradientSum multiplies Lightning's averaged gradient back by k_steps.
        "avg": Knob(False, lambda trainer, model: not any(isinstance(c, GradientSum) and c.k_steps == 3
                                                         for c in trainer.callbacks)),
    })],
    row=["strategy.gradient_merge.k_steps=2"],
    row_effect=gradient_merge_row_effect)


# --------------------------------------------------------------------------- lamb


def lamb_row_effect(ranks):
    assert {state["optimizer"] for rank in ranks for state in rank["states"]} == {"LAMB"}


STRATEGIES["lamb"] = StrategyTests(
    wiring=[WiringCase({"lamb_weight_decay": Knob(0.02, group_key("lamb_weight_decay")),
                        "exclude_from_weight_decay": Knob(["bias"], excludes("bias"), True),
                        "always_adapt": Knob(True, group_key("always_adapt"))},
                       ["model=gpt", "data=language_model"])],
    row=["model=gpt", "data=language_model"],  # LAMB replaces Adam-family optimizers: the GPT's AdamW
    row_effect=lamb_row_effect)


# --------------------------------------------------------------------------- lars


def lars_row_effect(ranks):
    assert {state["optimizer"] for rank in ranks for state in rank["states"]} == {"LARS"}


STRATEGIES["lars"] = StrategyTests(
    wiring=[WiringCase({"lars_coeff": Knob(0.002, group_key("lars_coeff")),
                        "lars_weight_decay": Knob(0.001, group_key("lars_weight_decay")),
                        "epsilon": Knob(1e-8, group_key("epsilon")),
                        "exclude_from_weight_decay": Knob(["bias"], excludes("bias"), True)})],
    row=[],  # the MLP's momentum SGD is replaced
    row_effect=lars_row_effect)


# --------------------------------------------------------------------------- localsgd


def averaging(trainer):
    return next(c for c in trainer.callbacks if isinstance(c, ModelAveraging))


def localsgd_row_effect(ranks):
    """After begin_step (1) the ranks drift apart, and meet every 3 steps, at the parameters' mean."""
    checksums = {}  # steps done -> each rank's parameter checksum then
    for rank in ranks:
        for state in rank["states"]:
            checksums.setdefault(state["global_step"], []).append(state["checksum"])
    for step, values in checksums.items():
        if step > 1:
            assert (len(set(values)) == 1) == ((step - 1) % 3 == 0), (step, values)


STRATEGIES["localsgd"] = StrategyTests(
    wiring=[WiringCase({
        "k_steps": Knob(3, lambda trainer, model: averaging(trainer).averager.period),
        # Gradients are all-reduced by the hook until begin_step; the averager starts after it.
        "begin_step": Knob(2, lambda trainer, model: [trainer.strategy.comm_hook_state.start_localSGD_iter,
                                                      averaging(trainer).averager.warmup_steps], [2, 4]),
    }, ["trainer.devices=2"])],
    row=["strategy.localsgd.k_steps=3"],
    row_effect=localsgd_row_effect)


# --------------------------------------------------------------------------- pipeline


def schedule_name(trainer, model):
    return type(trainer.strategy.schedule).__name__.removeprefix("Schedule")


def first_block_elsewhere(trainer, model):
    """Reader: on the first rank, where the next stage begins: its first block holding no parameter here."""
    held = {name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("blocks.")}
    return [f"blocks.{next(index for index in range(len(model.blocks)) if str(index) not in held)}"]


PIPELINE = ["trainer.devices=2", "model.num_blocks=4"]


def pipeline_row_effect(ranks):
    """The ranks of a pipeline (consecutive pairs) hold disjoint, non-empty shares of the parameters."""
    for first, second in zip(ranks[::2], ranks[1::2]):
        mine, theirs = set(first["static"]["parameters"]), set(second["static"]["parameters"])
        assert mine and theirs and not mine & theirs


STRATEGIES["pipeline"] = StrategyTests(
    wiring=[
        WiringCase({"schedule_mode": Knob("GPipe", schedule_name),
                    "split_points": Knob(["blocks.3"], first_block_elsewhere),
                    "micro_batch_size": Knob(8, lambda trainer, model: trainer.strategy.micro_batch_size),
                    "accumulate_steps": Knob(2, lambda trainer, model: trainer.strategy.schedule._n_microbatches)},
                   PIPELINE + ["data.batch_size=16"]),
        WiringCase({"schedule_mode": Knob("Interleaved1F1B", schedule_name),
                    "vpp_degree": Knob(2, lambda trainer, model: len(trainer.strategy.stages))}, PIPELINE),
    ],
    row=[],
    row_effect=pipeline_row_effect)


# --------------------------------------------------------------------------- recompute


def wrappers(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)}


def noted(text: str):
    """Reader: whether the run's saved plan carries a note containing `text`."""
    return lambda trainer, model: any(text in note for note in yaml.safe_load(
        (Path(trainer.default_root_dir) / "plan.yaml").read_text())["notes"])


def recompute_row_effect(ranks):
    """Every wrapped block runs twice per micro-batch: forward, and again in backward."""
    for rank in ranks:
        static = rank["static"]
        assert static["wrapped"] > 0
        assert {batch["wrapped_forwards"] for batch in rank["batches"]} == {2 * static["wrapped"] *
                                                                          static["micro_batches"]}


STRATEGIES["recompute"] = StrategyTests(
    wiring=[WiringCase({
        "checkpoints": Knob(["blocks.1"], lambda trainer, model: sorted(wrappers(model))),
        "enable_offload": Knob(True, lambda trainer, model: [w.checkpoint_fn.keywords["offload"]
                                                              for w in wrappers(model).values()] == [True], True),
        # No effect in PyTorch: the plan says so.
        "checkpoint_shape": Knob([4, 8], noted("checkpoint_shape has no effect"), True),
    })],
    row=[],  # the model's repeated blocks
    row_effect=recompute_row_effect)


# --------------------------------------------------------------------------- sharding


SEGMENT_MB = 0.04  # MLPClassifier: units [stem, blocks.0], [blocks.1, blocks.2], [head]


def fsdp_units(model):
    """FSDP2's parameter groups of the units below the root (a unit of several modules has one)."""
    groups = {id(group): group for module in model.modules() if module is not model
              and hasattr(module, "_get_fsdp_state") and (group := module._get_fsdp_state()._fsdp_param_group)}
    return list(groups.values())


def zero_stage(trainer, model):
    """Reader: 1 for ZeRO's optimizer sharding; 2 or 3 for FSDP2, by whether units free their
    gathered parameters after forward."""
    if isinstance(trainer.optimizers[0], ZeroRedundancyOptimizer):
        return 1
    return 3 if all(unit.post_forward_mesh_info is not None for unit in fsdp_units(model)) else 2


def mesh_size(dim: str):
    return lambda trainer, model: trainer.strategy.device_mesh[dim].size()


def tensor_split(trainer, model):
    """Reader: the tensor-parallel mesh, and how many pieces a query weight is split into."""
    weight = model.blocks[0].attn.q.weight
    return [trainer.strategy.device_mesh["tp"].size(), weight.numel() // weight.to_local().numel()]


def sharding_row_effect(ranks):
    """Each rank holds a share: of the parameters (stage 3) or of the optimizer states (stage 1)."""
    for rank in ranks:
        static, last = rank["static"], rank["states"][-1]
        assert static["numel"] < static["global_numel"] or 0 < last["optimizer_state"] < len(static["parameters"])


STRATEGIES["sharding"] = StrategyTests(
    wiring=[
        WiringCase({"stage": Knob(3, zero_stage), "degree": Knob(1, mesh_size("dp_shard")),
                    "dp_degree": Knob(2, mesh_size("dp_replicate")),
                    "optimize_offload": Knob(True, lambda trainer, model: sorted({type(unit.offload_policy).__name__
                                                                                   for unit in fsdp_units(model)}),
                                             ["CPUOffloadPolicy"]),
                    "gradient_merge_acc_step": Knob(2, lambda trainer, model: trainer.accumulate_grad_batches),
                    # MLPClassifier at 0.04 MB: [stem, blocks.0], [blocks.1, blocks.2], [head]
                    "segment_broadcast_MB": Knob(SEGMENT_MB, lambda trainer, model: len(fsdp_units(model)), 3)},
                   ["trainer.devices=2"]),
        WiringCase({"stage": Knob(2, zero_stage), "mp_degree": Knob(2, tensor_split, [2, 2])},
                   ["trainer.devices=2", "model=gpt", "data=language_model"]),
        WiringCase({"pp_degree": Knob(2, mesh_size("pp"))}, ["strategy=[pipeline,sharding]", "trainer.devices=4"]),
    ],
    row=["strategy.sharding.stage=3"],  # the stage that shards the most; with pipeline, stage 1 (test_combinations.py)
    row_effect=sharding_row_effect)
