"""strategy=[auto]'s memory estimates against what each rank holds: for every candidate auto lists
for the built-in GPT and MLP (conf/model) and a user model of this file (nested blocks, batch
norm), in 1 and 2 processes over gloo on the CPU.

    python bench/auto_memory.py                        # bench/auto_memory.json, the table printed
    python bench/auto_memory.py --models gpt --world-sizes 2

On a GPU, `estimate_for(overrides)` (below) gives auto's estimate for one composed run with its own
strategies, planned for trainer.accelerator's device, to set beside torch.cuda.max_memory_allocated:

    estimate_for(["experiment=gpt2_124m", "strategy.gradient_merge.k_steps=1", ...])["total"]  # bytes

Each candidate is a run built as lightfleet builds it: the config composed from overrides, the
plan made by the command's `plan_for`, the Trainer, model and data by the rank's `build`, trained
for one optimizer step with `PeakMemory` (below) among its callbacks. All candidates of one model
and world size run in one set of ranks (torch.distributed.run), one after another. The estimate is
`runner.strategies.auto.candidates` on the facts `plugins.auto.gather_facts` gathers for the run
(`device_memory_gb` set tiny so that nothing fits and gradient merging is listed everywhere).

Measured, per rank, as bench/sharding.py does, in bytes of distinct storages (a DTensor: its local
shard): parameters (the optimizer's and the module's, FSDP2's gathered ones included, registered on
their modules yet or not: FSDP2 fills them before it registers them), gradients, optimizer
states, and saved activations: what autograd saves for backward (saved_tensors_hooks) and still
holds, plus what recompute's rebuild of a block in backward made and still holds (from the rebuild
until the block's backward frees it; at step 2, through any alias: checkpoint hands autograd a new
alias of each rebuilt tensor, which outlives the rebuild's own), what a pipeline's schedule keeps of a stage's forward for
its backward (the stage's outputs), and the gradients the loss's backward made and still holds (not seen inside the pipeline's
schedule, which runs its own backward). Each kind's peak is the largest value seen at any saved-
tensor pack or unpack, after each node of the loss's backward, at the end of every module's forward,
before the optimizer step and after it, over the first optimizer step (all its micro-batches); a
rebuild runs its block's whole forward (checkpoint's early stop off: it would end the rebuild inside
the block, once all the block saves is rebuilt, before the block's forward ends, where the rebuild
is counted; what is saved is the same). The busiest rank's peak is the one reported.

For the rehearsal (bench/rehearsal.py), `PeakMemory(step=2)` watches the second optimizer step
instead (the steady state: the optimizer's state exists, the last step's gradients live through
the first forward; a gradient counts while alive, held by its parameter or not, as a pipeline
holds the last step's through its schedule), samples after every op of that step as well (the optimizer's intermediates
exist only inside its step), and adds three parts (EXTRA): buffers (the modules'),
temporaries (every other tensor the step's ops made and still hold: what the kinds above do not
count, as the loss's logits before backward, an optimizer's intermediate results), and step_peak
(the most bytes of all the distinct storages above together). Tensors torch's C++ makes outside
the dispatcher (DDP's reducer buckets, made before the step) are not seen.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/, plugins/ and bench/ when lightfleet is not installed
from plugins.rehearsal import gathered_parameters, held_tensors, receive_buffers  # noqa: E402
from runner.models import ClassifierModule, OptimizerFactory  # noqa: E402

KINDS = ("parameters", "gradients", "optimizer_states", "activations")
EXTRA = ("buffers", "temporaries", "step_peak")  # PeakMemory(step=2)'s parts besides KINDS
# Overrides of each model's runs: the built-in GPT and MLP with their data, and this file's model.
MODELS = {
    "gpt": ["model=gpt", "data=language_model"],
    "mlp": ["model=mlp", "data=classification"],
    "user": ["model=mlp", "data=classification", "model._target_=bench.auto_memory.NestedBatchNormNet"],
}
QUIET = ["logger=none", "callbacks=none", "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "trainer.limit_val_batches=0", "trainer.max_steps=1",
         "measure.enabled=false", "+callbacks.memory._target_=bench.auto_memory.PeakMemory"]
GOAL_EACH, GOAL_MEDIAN = 0.25, 0.10  # every estimate within 25% of the measured bytes, the median within 10%


class NestedBatchNormNet(ClassifierModule):
    """A user's model: its repeated blocks sit inside a Sequential next to the stem (not at the
    top), each block nests its own Sequential with batch norm. MLPClassifier's arguments, so that
    conf/model/mlp.yaml builds it with `model._target_`."""

    def __init__(self, input_dim: int = 32, hidden_dim: int = 64, num_blocks: int = 3, num_classes: int = 4,
                 optimizer: Optional[OptimizerFactory] = None) -> None:
        super().__init__(optimizer)
        self.trunk = nn.Sequential(OrderedDict(
            stem=nn.Linear(input_dim, hidden_dim),
            blocks=nn.Sequential(*(NormBlock(hidden_dim) for _ in range(num_blocks)))))
        self.head = nn.Linear(hidden_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class NormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 2 * dim), nn.BatchNorm1d(2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim),
                                 nn.BatchNorm1d(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.net(x))


# --------------------------------------------------------------------------- rank side


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storages(tensors: Iterable[torch.Tensor]) -> Dict[int, int]:
    """Data pointer -> bytes of the distinct storages behind `tensors` (meta tensors hold none)."""
    found = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        if tensor.device.type != "meta" and storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


class Outputs(TorchDispatchMode):
    """Keeps weak references to every tensor the ops make while it is on and not `paused`: what a
    block's recomputation in backward makes and still holds. `fresh(address)` is called for each
    storage an op makes anew (not a view of its inputs)."""

    def __init__(self, after_op: Any = None, fresh: Any = None) -> None:
        super().__init__()
        self.made: List[weakref.ref] = []
        self.after_op = after_op
        self.fresh = fresh
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self.fresh is not None:
            given = storages(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            for address in storages(made).keys() - given.keys():
                self.fresh(address)
        if not self.paused:
            self.made += [weakref.ref(t) for t in made]
        if self.after_op is not None:
            self.after_op()
        return out

    def alive(self) -> List[torch.Tensor]:
        self.made = [ref for ref in self.made if ref() is not None]  # a whole step's ops: keep the list short
        return [t for t in (ref() for ref in self.made) if t is not None]


class PeakMemory(pl.Callback):
    """Each kind's peak bytes on this rank over optimizer step `step` (module docstring; the second:
    EXTRA's parts too), written to memory.rank<r>.json in the run directory."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.peak = dict.fromkeys((*KINDS, *EXTRA) if step > 1 else KINDS, 0)
        self.made: Optional[Outputs] = None  # every tensor the step's ops make (step > 1)
        self.gradients: Dict[int, weakref.ref] = {}  # every gradient a parameter held this step, while alive
        self.saved: List[weakref.ref] = []
        self.rebuilding: List[Outputs] = []
        self.rebuilt: List[Outputs] = []  # rebuilds done, what they made held until their block's backward
        # The storages rebuilds made (step > 1), by address: checkpoint's unpacking hands autograd a
        # new alias of a rebuilt tensor, which may outlive every tensor the rebuild made.
        self.rebuilt_storages: set = set()
        self.loss_gradients: List[weakref.ref] = []  # made by the loss's backward, this micro-batch
        self.output: Any = None  # the model's output's autograd node, this micro-batch
        self.hooks: Any = None
        self.handles: List[Any] = []
        self.trainer: Optional[pl.Trainer] = None

    def parameters(self) -> List[torch.Tensor]:
        trained = [p for optimizer in self.trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
        module = self.trainer.lightning_module
        return trained + list(module.parameters()) + gathered_parameters(module)

    def sample(self, optimizer_states: bool = False) -> None:
        parameters = self.parameters()
        for p in parameters:
            if p.grad is not None:
                self.gradients[id(p.grad)] = weakref.ref(p.grad)
        self.gradients = {key: ref for key, ref in self.gradients.items() if ref() is not None}
        held = {"parameters": storages(parameters), "gradients": storages(ref() for ref in self.gradients.values())}
        activations = [t for t in (ref() for ref in self.saved) if t is not None]
        activations += [t for outputs in (*self.rebuilding, *self.rebuilt) for t in outputs.alive()]
        if self.made is not None:
            activations += [t for t in self.made.alive() if local(t).untyped_storage().data_ptr() in self.rebuilt_storages]
        activations += [t for t in (ref() for ref in self.loss_gradients) if t is not None]
        held["activations"] = {ptr: size for ptr, size in storages(activations).items()
                               if ptr not in held["parameters"] and ptr not in held["gradients"]}
        if optimizer_states or self.made is not None:
            held["optimizer_states"] = storages(
                t for optimizer in self.trainer.optimizers for state in getattr(optimizer, "optim", optimizer).state.values()
                for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        if self.made is not None:
            held["buffers"] = storages(self.trainer.lightning_module.buffers())
            counted = {ptr for found in held.values() for ptr in found}
            # Made in an earlier step: a DDP communication hook's state (DGC's momentum and residual),
            # a pipeline stage's buffers for what it receives (its inputs, once its forward saves
            # them, are activations above).
            kept = [*held_tensors(getattr(self.trainer.strategy, "comm_hook_state", None)),
                    *(t for stage in getattr(self.trainer.strategy, "stages", []) for gradients in (False, True)
                      for t in receive_buffers(stage, gradients))]
            held["temporaries"] = {ptr: size for ptr, size in storages([*self.made.alive(), *kept]).items()
                                   if ptr not in counted}
            held["step_peak"] = {ptr: size for found in held.values() for ptr, size in found.items()}
        for kind, found in held.items():
            self.peak[kind] = max(self.peak[kind], sum(found.values()))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved.append(weakref.ref(tensor))
        self.sample()
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sample()
        return tensor

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.made is not None:  # the loader ran since the last micro-batch: not the step's
            self.made.paused = False
        if self.hooks is None and trainer.global_step == self.step - 1 and not self.handles:
            self.watch(trainer, pl_module)
            if self.step > 1:
                # A storage made anew outside a rebuild is not a rebuild's (an address freed and reused).
                self.made = Outputs(after_op=self.sample, fresh=self.rebuilt_storages.discard)  # every op: the optimizer's intermediates too
                self.hooks.enter_context(self.made)
                self.sample()  # the last step's gradients, before anything drops them from the parameters

    def watch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hooks on for the watched step."""
        self.trainer = trainer
        # The pipeline's traced stages run copies of the model's modules (recompute's wrappers among them).
        stages = [stage.submod for stage in getattr(trainer.strategy, "stages", [])]
        for module in {id(m): m for root in (pl_module, *stages) for m in root.modules()}.values():
            self.handles.append(module.register_forward_hook(lambda *_: self.sample()))
            if hasattr(module, "_checkpoint_wrapped_module"):  # recompute's wrapper: watch the rebuild in backward
                inner = module._checkpoint_wrapped_module
                self.handles += [inner.register_forward_pre_hook(lambda *_: self.start_rebuild()),
                                 inner.register_forward_hook(lambda *_: self.end_rebuild())]
        self.handles.append(pl_module.register_forward_hook(self.watch_output))
        for stage in stages:  # the schedule keeps a stage's outputs until their backward: activations
            self.handles.append(stage.register_forward_hook(self.stage_output))
        self.hooks = contextlib.ExitStack()
        self.hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        self.hooks.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))

    def stage_output(self, module: nn.Module, args: Any, output: Any) -> None:
        self.saved += [weakref.ref(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]

    def watch_output(self, module: nn.Module, args: Any, output: Any) -> None:
        # Not a scalar: Lightning may run training_step through the module's call, the loss out.
        if isinstance(output, torch.Tensor) and output.requires_grad and output.dim():
            self.output = output.grad_fn

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Watches the loss's backward: each node from the loss down to the model's output samples
        once it ran, its gradients in and out (and its saved tensors) still held."""
        if self.hooks is None or self.output is None:
            return
        stack, seen = [loss.grad_fn], {self.output}
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                self.handles.append(node.register_hook(self.loss_backward_ran))
                stack += [child for child, _ in node.next_functions]

    def loss_backward_ran(self, gradients_in: Any, gradients_out: Any) -> None:
        self.loss_gradients += [weakref.ref(g) for g in gradients_in if g is not None]
        self.sample()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loss_gradients, self.output, self.rebuilt = [], None, []
        self.rebuilt_storages.clear()  # the step's Outputs holds its `discard`

    def start_rebuild(self) -> None:
        if torch._C._current_graph_task_id() != -1:  # in backward: checkpoint recomputes the block
            # Entered after the step's Outputs: for one op, its `fresh` runs after that one's.
            self.rebuilding.append(Outputs(fresh=self.rebuilt_storages.add if self.made is not None else None))
            self.rebuilding[-1].__enter__()

    def end_rebuild(self) -> None:
        if self.rebuilding and torch._C._current_graph_task_id() != -1:
            self.sample()
            self.rebuilt.append(self.rebuilding.pop())
            self.rebuilt[-1].__exit__(None, None, None)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.hooks is not None:  # the watched step
            self.sample()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step < self.step or self.hooks is None:
            if self.made is not None:  # the next micro-batch's fetch (the loader's indexing of an
                self.made.paused = True  # in-memory dataset views its whole storage): not the step's
            return
        self.sample(optimizer_states=True)
        self.hooks.close()
        self.hooks, self.made = None, None
        for handle in self.handles:
            handle.remove()
        Path(trainer.default_root_dir, f"memory.rank{trainer.global_rank}.json").write_text(json.dumps(self.peak))


def rank_main(runs: Path) -> None:
    """Every candidate listed in runs/candidates.json, one after another, in this rank."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from runner.core.plan import Plan
    from runner.rank.build import build

    torch.set_num_threads(1)
    for name in json.loads((runs / "candidates.json").read_text()):
        run_dir = runs / name
        cfg = OmegaConf.load(run_dir / "config.yaml")
        built = build(cfg, Plan.from_dict(json.loads((run_dir / "plan.json").read_text())), run_dir)
        built.trainer.fit(built.model, datamodule=built.datamodule)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side


def overrides(strategies: Dict[str, Dict[str, Any]]) -> List[str]:
    """The command-line overrides that select `strategies` with their knobs."""
    return [f"strategy=[{','.join(strategies)}]",
            *(f"strategy.{name}.{knob}={value}" for name, knobs in strategies.items() for knob, value in knobs.items())]


def estimates(model: str, world_size: int) -> List[Dict[str, Any]]:
    """auto's candidates for `model` in `world_size` processes: strategies, knobs and estimated bytes by kind."""
    from hydra.utils import instantiate

    from plugins.auto import gather_facts
    from runner.config.checks import validate
    from runner.config.compat import load_table
    from runner.config.compose import compose_config
    from runner.strategies.auto import AutoConfig, candidates, micro_batch

    spec = validate(compose_config([*MODELS[model], f"trainer.devices={world_size}"]))
    facts = gather_facts(lambda: instantiate(spec.cfg.model, _convert_="all"), instantiate(spec.cfg.data),
                         device="cpu", world_size=world_size, num_nodes=1, batch_size=spec.batch_size,
                         device_memory_gb=2**-30)  # one byte: nothing fits, every memory-only variant is listed
    return [{"label": c.label, "strategies": c.strategies, "batch_size": spec.batch_size,
             "micro_batch": micro_batch(spec.batch_size, c.strategies),
             "estimate": {kind: getattr(c.memory, kind) for kind in KINDS}}
            for c in candidates(facts, AutoConfig(), load_table().allowed)]


def estimate_for(overrides: List[str]) -> Dict[str, float]:
    """auto's memory estimate per process, in bytes, of the run these overrides compose with the
    strategies it selects (none chosen: `runner.strategies.auto.estimate` on the facts
    `runner.command.autotune.run_facts` gathers, as `strategy=[auto]` estimates its candidates), by
    kind (KINDS) and in total; planned for trainer.accelerator's device (gpu: cuda) on whatever
    machine runs it. Under gradient merging a run's data.batch_size is one micro-batch of k a
    step, while auto's facts are of the step's batch, which its gradient_merge candidates split:
    the facts are gathered at k x data.batch_size."""
    from runner.command.autotune import run_facts
    from runner.config.checks import validate
    from runner.config.compose import compose_config
    from runner.strategies.auto import estimate

    spec = validate(compose_config(overrides))
    merged = getattr(spec.strategies.get("gradient_merge"), "k_steps", 1)
    if merged > 1:
        spec = validate(compose_config([*overrides, f"data.batch_size={spec.batch_size * merged}"]))
    memory, _ = estimate(run_facts(spec, device_memory_gb=None), spec.strategies)
    return {**{kind: getattr(memory, kind) for kind in KINDS}, "total": memory.total}


def measure(model: str, world_size: int, listed: List[Dict[str, Any]], workdir: Path, timeout: float = 1200,
            quiet: List[str] = QUIET, models: Dict[str, List[str]] = MODELS) -> None:
    """Each candidate's measured peak bytes by kind (the busiest rank's) into its dict, under
    "measured"; one the plan refuses gets "refused" (the reason) instead. A candidate's overrides
    are its "overrides" where it has them, else its "strategies" with their knobs; `quiet`, the
    runs' common ones; `models`, each model's."""
    from omegaconf import OmegaConf

    from runner.config.checks import validate
    from runner.command.planning import plan_for
    from runner.config.compose import compose_config
    from runner.core.errors import ConfigError, Refusal

    names = []
    for index, entry in enumerate(listed):
        name = f"{index:03d}"
        run_dir = workdir / name
        try:
            # As auto runs a candidate: gradient merging's k micro-batches of batch / k.
            batch = [f"data.batch_size={entry['micro_batch']}"] if entry["micro_batch"] != entry["batch_size"] else []
            chosen = entry["overrides"] if "overrides" in entry else overrides(entry["strategies"])
            spec = validate(compose_config([*models[model], f"trainer.devices={world_size}", *quiet, *batch,
                                            *chosen, f"paths.output_dir={run_dir}"]))
            plan = plan_for(spec)
        except (ConfigError, Refusal) as refused:
            entry["refused"] = str(refused).splitlines()[0]
            continue
        run_dir.mkdir(parents=True)
        OmegaConf.save(spec.cfg, run_dir / "config.yaml")
        (run_dir / "plan.json").write_text(json.dumps(plan.to_dict()))
        names.append((name, entry))
    (workdir / "candidates.json").write_text(json.dumps([name for name, _ in names]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world_size}", str(Path(__file__).resolve()), "--rank-side", str(workdir)],
                          env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    for name, entry in names:
        ranks = [json.loads((workdir / name / f"memory.rank{rank}.json").read_text()) for rank in range(world_size)]
        entry["measured"] = {kind: max(rank[kind] for rank in ranks) for kind in ranks[0]}


def ratios(entry: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """estimate / measured by kind and in total (None where nothing was measured)."""
    measured, estimated = entry["measured"], entry["estimate"]
    found = {kind: estimated[kind] / measured[kind] if measured[kind] else None for kind in KINDS}
    found["total"] = sum(estimated.values()) / sum(measured.values())
    return found


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], metavar="N")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "auto_memory.json")
    parser.add_argument("--rank-side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        rank_main(args.rank_side)
        return 0
    from bench.spawning import machine

    record: Dict[str, Any] = {
        "command": " ".join(["python", "bench/auto_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "goal": f"every estimate within {GOAL_EACH:.0%}, the median within {GOAL_MEDIAN:.0%}",
        "results": {}}
    for model in args.models:
        for world_size in args.world_sizes:
            listed = estimates(model, world_size)
            with tempfile.TemporaryDirectory() as tmp:
                measure(model, world_size, listed, Path(tmp))
            for entry in listed:
                if "measured" in entry:
                    entry["estimate_over_measured"] = ratios(entry)
            record["results"][f"{model} x{world_size}"] = listed
            print_table(model, world_size, listed)
    record["summary"] = summary(record["results"])
    print(json.dumps(record["summary"], indent=2))
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def print_table(model: str, world_size: int, listed: List[Dict[str, Any]]) -> None:
    print(f"\n{model}, {world_size} process(es): estimate / measured by kind (measured MB)")
    print(f"{'candidate':<58}" + "".join(f"{kind[:11]:>16}" for kind in (*KINDS, "total")))
    for entry in listed:
        if "refused" in entry:
            print(f"{entry['label']:<58} refused: {entry['refused'][:80]}")
            continue
        found, measured = entry["estimate_over_measured"], entry["measured"]
        cells = [f"{found[kind]:.2f} ({measured[kind] / 2**20:.2f})" if found[kind] is not None else "-"
                 for kind in KINDS]
        cells.append(f"{found['total']:.2f}")
        print(f"{entry['label']:<58}" + "".join(f"{cell:>16}" for cell in cells))


def summary(results: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Over every measured candidate and kind: the median and the worst estimate/measured, and
    which fall outside the goal."""
    cells = [(run, entry["label"], kind, value) for run, listed in results.items() for entry in listed
             if "measured" in entry for kind, value in entry["estimate_over_measured"].items() if value is not None]
    outside = [f"{run} {label} {kind}: {value:.2f}" for run, label, kind, value in cells if abs(value - 1) > GOAL_EACH]
    totals = [value for *_, kind, value in cells if kind == "total"]
    return {"candidates": sum("measured" in entry for listed in results.values() for entry in listed),
            "refused": sum("refused" in entry for listed in results.values() for entry in listed),
            "median_total": statistics.median(totals), "median_all_kinds": statistics.median(v for *_, v in cells),
            "within_25pct": len(cells) - len(outside), "cells": len(cells), "outside_25pct": outside}


if __name__ == "__main__":
    sys.exit(main())
