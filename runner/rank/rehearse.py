"""A rehearsed rank (issue 42): one rank of a run of any size, built by the rank's own build in a
fake world on this machine, stepped and measured; its report is the JSON of docs/rehearse.md.

    python -m runner.rank.rehearse RUN_DIR --rank R --steps S --device-type cuda|cpu --out OUT.json

reads RUN_DIR/config.yaml and plan.yaml as a real rank does. One process per rank: a fake
process group is per process. The build is the real one (runner/rank/build.py, Lightning's setup,
the strategies' transforms and wrappers) with fake tensors: its hooks (plugins/rehearsal.py) put
the model on the meta device and make the device meshes on real tensors. Lightning's fit loop is
replaced by `RehearsalLoop` (its `.item()` reads, loss scaler and preemption vote cannot run on
fake tensors): the plan's micro-batches and accumulation, the strategies' callbacks, the
optimizer's step; the last step is measured (the first makes the optimizer's state).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from runner.core.errors import exit_on_user_error, require
from runner.core.plan import Plan
from runner.core.world import World
from runner.records.files import CONFIG_YAML
from runner.records.run_dir import read_plan

DEVICE_TYPES = ("cuda", "cpu")
COMPILE = "plugins.fast_path:compile_model"  # the plan's compile transform, which a rehearsal runs eagerly
# Why a figure is not what the rehearsed step did, per strategy (the report's "formula").
EAGER = "the step is rehearsed eagerly: compile's fused kernels (fewer temporaries, less memory traffic) are not"
CONSOLIDATED = ("checkpoint_peak: ZeroRedundancyOptimizer consolidates on rank 0 through pickled objects, which "
                "fake tensors cannot carry; rank 0's figure adds the other ranks' optimizer state (their shares' "
                "parameter bytes at its own state bytes per parameter byte)")
REPEATED = ("accumulation: micro-batches 2 to the last but one repeat the second's ops and collectives, which are "
            "counted {} times; the first step is one synchronised micro-batch (it makes the optimizer's state)")
ADAPTIVE = ("its averaging period follows the loss, which a rehearsal does not compute: the callbacks are handed a "
            "loss of 0, and the parameters' all-reduce is counted at the steps that period gives")
OFFLOAD = ("offload: host is the shards' bytes (parameters, their gradients, optimizer states); the device's parts "
           "and peak are the step's less them (the gathered parameters and unsharded gradients stay)")
SCALER = ("float16's loss scaler scales the loss as in a run; its unscale, overflow check and skipped steps "
          "are not rehearsed (the check reads the device): the optimizer steps plainly")


def rank_environment(rank: int, world: World) -> Dict[str, str]:
    """What Lightning reads of a launched rank (torchrun's variables): no cluster needed."""
    per_node = world.devices
    return dict(RANK=str(rank), WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(rank % per_node),
                GROUP_RANK=str(rank // per_node), NODE_RANK=str(rank // per_node), LOCAL_WORLD_SIZE=str(per_node),
                TORCHELASTIC_RUN_ID="rehearsal", MASTER_ADDR="localhost", MASTER_PORT="29500")


def for_rehearsal(cfg: DictConfig) -> DictConfig:
    """The run's config as a rehearsal builds it: on the CPU (its fake tensors stand for the target
    device: `rehearse_rank`'s device_type), without the loggers, which would write files."""
    cfg = cfg.copy()
    cfg.trainer.accelerator = "cpu"
    cfg.logger = {}
    return cfg


def rehearse_rank(cfg: DictConfig, plan: Plan, rank: int, steps: int, device_type: str) -> Dict[str, Any]:
    """Rank `rank` of the run `cfg` and `plan` (as the command checked and saved them), built in a
    fake world of the run's size and stepped `steps` (>= 2) times; its report (docs/rehearse.md)."""
    import torch

    from plugins import rehearsal
    from runner.rank.build import build

    started = time.time()
    require(steps >= 2, "--steps", steps, "at least 2: the first step makes the optimizer's state")
    require(device_type in DEVICE_TYPES, "--device-type", device_type, f"one of {', '.join(DEVICE_TYPES)}")
    world = World.of(cfg.trainer)
    size = world.known_size("a rehearsal")
    require(0 <= rank < size, "--rank", rank, f"a rank of the run's {size} processes (0 to {size - 1})")
    os.environ.update(rank_environment(rank, world))
    torch.set_num_threads(1)  # the fake tensors compute nothing; ranks rehearsed side by side share the cores
    rehearsal.join_fake_world(rank, size)
    loop = RehearsalLoop(steps, world.devices, device_type)
    try:
        with tempfile.TemporaryDirectory(prefix="lightfleet-rehearsal-") as scratch, rehearsal.fake_tensors():
            built = build(for_rehearsal(cfg), plan, Path(scratch))
            # The data made on real tensors, as the preflight made it: on fake ones a data set made op
            # by op (synthetic tokens: an op a position) took minutes, and its batch is read real anyway.
            built.datamodule.setup = rehearsal.real_tensors()(built.datamodule.setup)
            built.trainer.fit_loop.run = lambda: loop.run(built.trainer)
            built.trainer.fit(built.model, datamodule=built.datamodule)
    finally:
        torch.distributed.destroy_process_group()
    report = {"rank": rank, "world_size": size, **loop.report, "seconds": round(time.time() - started, 2)}
    if any(claim.component.target == COMPILE for claim in plan.model_transforms):
        report["formula"]["fast_path"] = EAGER
    if "adaptive_localsgd" in plan.strategies:
        report["formula"]["adaptive_localsgd"] = ADAPTIVE
    return report


class RehearsalLoop:
    """Lightning's fit loop, as a rehearsal runs it on fake tensors: each optimizer step is the
    plan's micro-batches (trainer.accumulate_grad_batches; the pipeline's schedule inside its
    training_step), each through the strategy's training_step and backward, gradient sync held
    back until the last as Lightning does, then the strategies' callbacks and the optimizers'
    step. The last step is counted (collectives, FLOPs, memory traffic) and its memory tracked,
    then a checkpoint's state is gathered as the strategy saves it, its memory tracked too."""

    def __init__(self, steps: int, ranks_per_node: int, device_type: str) -> None:
        self.steps = steps
        self.ranks_per_node = ranks_per_node
        self.device_type = device_type
        self.report: Dict[str, Any] = {}
        self.formulas: Dict[str, str] = {}  # per strategy, why a figure is a formula
        self.tracker: Any = None  # the measured step's MemoryTracking, while it runs

    def run(self, trainer: Any) -> None:
        import torch

        from plugins import rehearsal

        model, strategy = trainer.lightning_module, trainer.strategy
        model.log = model.log_dict = lambda *args, **kwargs: None  # Lightning's logging needs its own loop
        callbacks = strategy_callbacks(trainer)
        for callback in callbacks:
            callback.on_train_start(trainer, model)
        with rehearsal.real_tensors():
            batch, accumulation = first_batch(trainer)
            self.outputs = {"loss": torch.zeros(())}  # what callbacks read of a step: a loss no rehearsal knows
        batch = rehearsal.as_fake(batch)
        rules = rehearsal.CudaRulesOnCpu() if self.device_type == "cuda" else contextlib.nullcontext()
        # A CPU run's collectives are gloo's, which copies a reduce-scatter's input (inside the tracker: counted).
        backend = rehearsal.GlooCopies() if self.device_type == "cpu" else contextlib.nullcontext()
        counter = rehearsal.StepCounter(self.ranks_per_node)
        with rules:
            for _ in range(self.steps - 1):  # one synchronised micro-batch makes the optimizer's state
                self.step(trainer, batch, accumulation, callbacks, counter, [(accumulation - 1, 1)])
            self.tracker = rehearsal.MemoryTracking(strategy.model, trainer.optimizers, getattr(strategy, "stages", []))
            with self.tracker, counter, backend:
                self.step(trainer, batch, accumulation, callbacks, counter, micro_batches(accumulation))
            memory, self.tracker = self.tracker.parts(), None
            memory["checkpoint_peak"] = self.checkpoint_peak(trainer)
        if accumulation > len(micro_batches(accumulation)):
            self.formulas["gradient_merge"] = REPEATED.format(accumulation - 2)
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            self.formulas["amp"] = SCALER
        memory["host"] = 0
        self.report.update(kind=kind_of(strategy), memory=memory, collectives=counter.collective_rows(),
                           flops=dict(counter.flops), memory_traffic_bytes=counter.memory_traffic, kernels=counter.kernels,
                           **per_step(batch, accumulation), heaviest_rank=heaviest_rank(trainer.optimizers),
                           formula=self.formulas)
        offloaded(self.report, trainer)

    def step(self, trainer: Any, batch: Any, accumulation: int, callbacks: List[Any], counter: Any,
             micro_batches: List[Tuple[int, int]]) -> None:
        """One optimizer step over `micro_batches` ((index, how many it stands for) of the
        step's `accumulation`), `counter` counting each as that many."""
        from pytorch_lightning.strategies import ParallelStrategy

        model, strategy = trainer.lightning_module, trainer.strategy
        for micro, weight in micro_batches:
            counter.weight = weight
            holds = isinstance(strategy, ParallelStrategy) and micro < accumulation - 1  # as Lightning holds sync
            held = strategy.block_backward_sync() if holds else contextlib.nullcontext()
            with held:
                loss = strategy.training_step(batch, micro)
                loss = loss["loss"] if isinstance(loss, dict) else loss
                if micro == 0:  # as Lightning: the last step's gradients live through this forward
                    for optimizer in trainer.optimizers:
                        optimizer.zero_grad()
                strategy.backward(loss / accumulation, trainer.optimizers[0])  # automatic optimization: one
            if micro < accumulation - 1:
                self.batch_ended(trainer, callbacks, batch, micro)
        counter.weight = 1
        for optimizer in trainer.optimizers:
            for callback in callbacks:
                callback.on_before_optimizer_step(trainer, model, optimizer)
            if trainer.gradient_clip_val:  # as Lightning clips: the model's hook, the precision plugin's clipping
                model.configure_gradient_clipping(optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            optimizer.step()
        steps = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
        steps.increment_ready()
        steps.increment_completed()  # trainer.global_step: localsgd's averaging follows it
        self.batch_ended(trainer, callbacks, batch, accumulation - 1)

    def batch_ended(self, trainer: Any, callbacks: List[Any], batch: Any, micro: int) -> None:
        """The callbacks' on_train_batch_end, handed a real loss (a callback may read its value)."""
        from plugins import rehearsal

        counted = self.tracker.on_real_tensors() if self.tracker is not None else contextlib.nullcontext()
        with rehearsal.real_tensors(), counted:
            for callback in callbacks:
                callback.on_train_batch_end(trainer, trainer.lightning_module, self.outputs, batch, micro)

    def checkpoint_peak(self, trainer: Any) -> int:
        """The most bytes held while the strategy gathers what a checkpoint saves: the module's
        state dict and each optimizer's (FSDP2 gathers as its strategy saves). ZeroRedundancyOptimizer
        consolidates every rank's state on rank 0 through pickled objects, which fake tensors
        cannot carry: there its figure is a formula (`consolidated_bytes`)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from plugins import rehearsal

        strategy = trainer.strategy
        sharded = [optimizer for optimizer in trainer.optimizers if isinstance(optimizer, ZeroRedundancyOptimizer)]
        tracker = rehearsal.MemoryTracking(strategy.model, trainer.optimizers)
        with tracker:
            state = {"state_dict": strategy.lightning_module_state_dict(),
                     "optimizer_states": [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers
                                          if optimizer not in sharded]}
            del state
        if sharded:
            self.formulas["sharding"] = CONSOLIDATED
        gathered = sum(consolidated_bytes(optimizer) for optimizer in sharded) if strategy.is_global_zero else 0
        return tracker.peak() + gathered


def consolidated_bytes(optimizer: Any) -> int:
    """The other ranks' optimizer state that ZeroRedundancyOptimizer.consolidate_state_dict gathers
    on rank 0: their shares' parameter bytes at this rank's state bytes per parameter byte."""
    import torch

    from plugins.rehearsal import zero_shares

    shares = zero_shares(optimizer)
    own = shares[optimizer.rank]
    state = sum(t.numel() * t.element_size() for per_parameter in optimizer.optim.state.values()
                for t in per_parameter.values() if torch.is_tensor(t) and t.dim())
    return round(state / own * (sum(shares) - own)) if own else 0


def micro_batches(accumulation: int) -> List[Tuple[int, int]]:
    """The measured step's micro-batches, (index, how many it stands for): the first (it frees
    the last step's gradients), the second for all up to the last but one (they repeat its ops
    and bytes), and the last (it synchronises the gradients)."""
    if accumulation <= 3:
        return [(micro, 1) for micro in range(accumulation)]
    return [(0, 1), (1, accumulation - 2), (accumulation - 1, 1)]


def strategy_callbacks(trainer: Any) -> List[Any]:
    """The callbacks that carry out strategies (plugins/: gradient merge's sum, localsgd's
    averaging, ...); lightfleet's own and the user's watch a real run, and are left out."""
    return [callback for callback in trainer.callbacks if type(callback).__module__.startswith("plugins.")]


def first_batch(trainer: Any) -> tuple:
    """A micro-batch of the training loader (its collate over the dataset's first samples: any
    world, however large against a small file, gets one) and the micro-batches per optimizer step."""
    loader = trainer.datamodule.train_dataloader()
    batch = loader.collate_fn([loader.dataset[index] for index in range(loader.batch_size)])
    return batch, trainer.accumulate_grad_batches


def per_step(batch: Any, accumulation: int) -> Dict[str, Optional[int]]:
    """This rank's samples and tokens (None: not token ids) per optimizer step (a pipeline's batch
    holds all its micro-batches)."""
    inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
    samples = inputs.shape[0] * accumulation
    tokens = inputs.numel() * accumulation if not inputs.is_floating_point() and inputs.dim() == 2 else None
    return {"samples_per_step": samples, "tokens_per_step": tokens}


def kind_of(strategy: Any) -> str:
    """What this rank is in the layout, e.g. "pipeline stage 1 of 4 (middle), dp_shard 32"."""
    layout = getattr(strategy, "layout", None)
    if layout is None:
        return f"data parallel, {strategy.world_size} processes" if strategy.world_size > 1 else "one process"
    where = layout.coordinates(strategy.global_rank)
    parts = []
    if layout.pp > 1:
        position = "first" if where["pp"] == 0 else "last" if where["pp"] == layout.pp - 1 else "middle"
        parts.append(f"pipeline stage {where['pp']} of {layout.pp} ({position})")
    parts += [f"{dim} {size}" for dim, size in layout.to_dict().items() if dim != "pp" and size > 1]
    return ", ".join(parts) or "one process"


def heaviest_rank(optimizers: List[Any]) -> Optional[int]:
    """ZeRO stage 1: the rank whose share of the optimizer (whole tensors, ZeroRedundancyOptimizer's
    partition, which every rank knows) holds the most parameter bytes, so the most state; None
    for other optimizers (FSDP2's flat shards put the most on the lowest ranks)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sharded = [optimizer for optimizer in optimizers if isinstance(optimizer, ZeroRedundancyOptimizer)]
    if not sharded:
        return None
    from plugins.rehearsal import zero_shares

    held: Dict[int, int] = {}
    for optimizer in sharded:
        for group_rank, share in enumerate(zero_shares(optimizer)):
            rank = dist.get_global_rank(optimizer.process_group, group_rank)
            held[rank] = held.get(rank, 0) + share
    return max(sorted(held), key=held.__getitem__)


def offloaded(report: Dict[str, Any], trainer: Any) -> None:
    """Under FSDP2's CPU offload the shards (parameters, their gradients, the optimizer states) live
    in host memory: counted there, not on the device (a rehearsal's tensors are all on one device)."""
    from plugins import rehearsal

    shards = rehearsal.host_shard_bytes(trainer.strategy.model)
    if not shards:
        return
    memory = report["memory"]
    on_host = {"parameters": shards, "gradients": shards, "optimizer_states": memory["optimizer_states"]}
    for part, size in on_host.items():
        memory[part] -= size
    memory["host"] = sum(on_host.values())
    memory["step_peak"] -= memory["host"]
    report["formula"]["sharding"] = OFFLOAD


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.rank.rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the directory holding config.yaml and plan.yaml")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device-type", default="cuda", choices=DEVICE_TYPES)
    parser.add_argument("--out", type=Path, required=True, help="the report's JSON file")
    args = parser.parse_args(argv)
    # What a rank says is its report, or its one line of refusal: the libraries' notes (devices
    # found, tips, warnings) are about a run on this machine, which a rehearsal is not.
    import pytorch_lightning  # noqa: F401 (it sets its loggers' levels when imported: first, then ours)

    warnings.simplefilter("ignore")
    for library in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(library).setLevel(logging.ERROR)
    with exit_on_user_error():
        cfg = OmegaConf.load(args.run_dir / CONFIG_YAML)
        report = rehearse_rank(cfg, read_plan(args.run_dir), args.rank, args.steps, args.device_type)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    from runner.core.paths import user_code_last
    from runner.rank.parent import tie_to_command

    tie_to_command()  # a rehearsal the command started ends with it
    user_code_last()
    main()
    sys.stdout.flush()
    os._exit(0)  # past torch's teardown of the fake group's threads (runner/train.py says why)
