"""Mutation check: do the tests catch realistic bugs in the strategies?

Copies the project (runner/, plugins/, conf/, experiments/, tests/, bench/, docs/, README.md,
pyproject.toml) into a
temporary directory once, then plants each mutant below there, one at a time (an exact `old` text,
which must occur once in its file, replaced by `new`), runs its pytest selection with cwd and
PYTHONPATH the copy, and restores the file. A mutant is caught when a selected test fails.

    python tests/mutations.py                    every mutant
    python tests/mutations.py ID [ID ...]        some (--list prints them)
    python tests/mutations.py --baseline [ID ...]  their selections on the unmutated copy: all must pass
Results: a markdown table on stdout and JSON in --out (default tests/mutations.json, or
tests/mutations_baseline.json with --baseline). Exit status 0 when every mutant is caught (baseline: passes).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PROJECT_ROOT = Path(__file__).resolve().parent.parent
COPIED = ("runner", "plugins", "conf", "experiments", "tests", "bench", "docs", "README.md", "pyproject.toml")
PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")
TIMEOUT_S = 15 * 60  # per mutant (per selection step with --baseline)

Step = Tuple[str, ...]  # the arguments of one pytest run after PYTEST


def module(strategy: str) -> Step:
    """The strategy's own test module."""
    return (f"tests/plugins/test_{strategy}.py",)


def wiring(expression: str) -> Step:
    return ("tests/test_wiring.py", "-k", expression)


def select(path: str, expression: str = "") -> Step:
    """Tests of one module, those matching `expression` (`-k`) if given."""
    return (path, "-k", expression) if expression else (path,)


def rows(*names: str) -> Step:
    """Rows of tests/test_combinations.py by their ids ("amp+recompute"); `-k`, so a renamed test still matches."""
    return ("tests/test_combinations.py", "-k", " or ".join(f"[{name}]" for name in names))


@dataclass(frozen=True)
class Mutant:
    id: str
    strategy: str
    description: str
    file: str
    old: str
    new: str
    selection: Tuple[Step, ...]  # pytest runs, cheapest first; the first failing one catches the mutant


MUTANTS = [
    # ------------------------------------------------------------------ the harness itself
    Mutant("harness-copy-imported", "harness",
           "python -m runner fails at import: the tests' subprocesses must run the mutated copy",
           "runner/__main__.py", "from runner.command.cli import main\n",
           'raise ImportError("mutations.py: the scratch copy is what runs")\nfrom runner.command.cli import main\n',
           (wiring("lars"),)),
    # ------------------------------------------------------------------ amp
    Mutant("amp-no-autocast", "amp", "float16 autocast on a hard-coded 'cuda' device: CPU layers never autocast",
           "plugins/amp.py",
           'return MixedPrecision("16-mixed", device_type, scaler=FleetGradScaler(device_type, **loss_scaling))',
           'return MixedPrecision("16-mixed", "cuda", scaler=FleetGradScaler(device_type, **loss_scaling))',
           (module("amp"), wiring("amp"), rows("amp+recompute"))),
    Mutant("amp-default-scaler", "amp", "float16 gets Lightning's default GradScaler: Fleet's loss scaling ignored",
           "plugins/amp.py",
           'return MixedPrecision("16-mixed", device_type, scaler=FleetGradScaler(device_type, **loss_scaling))',
           'return MixedPrecision("16-mixed", device_type)',
           (module("amp"), wiring("amp"), rows("amp+recompute"))),
    Mutant("amp-incr-ratio-dropped", "amp", "incr_ratio not passed to the scaler (growth factor fixed at 2)",
           "plugins/amp.py", "growth_factor=incr_ratio,", "growth_factor=2.0,",
           (wiring("amp"), module("amp"), rows("amp+recompute"))),
    Mutant("amp-overflow-not-shared", "amp",
           "overflow flag all-reduced but not written back: ranks skip different steps",
           "plugins/amp.py",
           "            per_device.setdefault(found_inf.device, found_inf)\n"
           "            for device_flag in per_device.values():\n"
           "                device_flag.copy_(flag)\n",
           "            per_device.setdefault(found_inf.device, found_inf)\n",
           (module("amp"), rows("amp+recompute"))),
    # ------------------------------------------------------------------ recompute
    Mutant("recompute-not-wrapped", "recompute", "checkpoint wrappers built but never registered: no block recomputed",
           "plugins/recompute.py",
           "        module.get_submodule(parent_name).register_module(child, checkpointed)\n", "",
           (module("recompute"), wiring("recompute"), rows("amp+recompute"))),
    Mutant("recompute-checkpoints-dropped", "recompute", "checkpoints knob not passed: always the repeated blocks",
           "runner/strategies/recompute.py",
           '{"checkpoints": list(self.checkpoints), "enable_offload": self.enable_offload}',
           '{"checkpoints": [], "enable_offload": self.enable_offload}',
           (wiring("recompute"), module("recompute"), rows("amp+recompute"))),
    # ------------------------------------------------------------------ gradient_merge
    Mutant("gradient-merge-not-accumulating", "gradient_merge",
           "accumulate_grad_batches not set: every micro-step updates",
           "runner/strategies/gradient_merge.py",
           'contribution = Contribution(trainer_args={"accumulate_grad_batches": self.k_steps})',
           "contribution = Contribution()",
           (wiring("gradient_merge"), module("gradient_merge"), rows("amp+gradient_merge+recompute"))),
    Mutant("gradient-merge-avg-inverted", "gradient_merge",
           "GradientSum added when avg is true (average and sum swapped)",
           "runner/strategies/gradient_merge.py", "        if not self.avg:\n", "        if self.avg:\n",
           (wiring("gradient_merge"), module("gradient_merge"), rows("amp+gradient_merge+recompute"))),
    # ------------------------------------------------------------------ lars
    Mutant("lars-returns-original", "lars", "replace_optimizer returns the user's SGD instead of LARS",
           "plugins/lars.py",
           "    return replace_with(LARS, optimizer, model, exclude_from_weight_decay, accepted=accepted,\n"
           '                        requirement=f"lars needs {NEEDED_OPTIMIZER[\'sgd_momentum\']}",\n'
           '                        inherited=("lr", "momentum"), lars_coeff=lars_coeff, '
           "lars_weight_decay=lars_weight_decay,\n"
           "                        epsilon=epsilon)\n",
           "    replace_with(LARS, optimizer, model, exclude_from_weight_decay, accepted=accepted,\n"
           '                 requirement=f"lars needs {NEEDED_OPTIMIZER[\'sgd_momentum\']}",\n'
           '                 inherited=("lr", "momentum"), lars_coeff=lars_coeff, lars_weight_decay=lars_weight_decay,\n'
           "                 epsilon=epsilon)\n"
           "    return optimizer\n",
           (module("lars"), wiring("lars"), rows("lars+recompute", "amp+lars"))),
    Mutant("lars-coeff-constant", "lars", "contribute() passes lars_coeff=0.001 instead of the knob",
           "runner/strategies/lars.py",
           'Component("plugins.lars:replace_optimizer", asdict(self))',
           'Component("plugins.lars:replace_optimizer", {"lars_coeff": 0.001, "lars_weight_decay": '
           'self.lars_weight_decay, "epsilon": self.epsilon, "exclude_from_weight_decay": '
           "list(self.exclude_from_weight_decay)})",
           (wiring("lars"), module("lars"), rows("lars+recompute", "amp+lars"))),
    Mutant("lars-excluded-layerwise", "lars", "tensors without weight decay still take the layer-wise rate (not Paddle's)",
           "plugins/lars.py", "    if weight_decay > 0:  # v += local_lr * g + local_lr * wd * w, in place\n",
           "    if True:\n",
           (("tests/plugins/test_lars.py", "-k", "paddle"),)),
    # ------------------------------------------------------------------ lamb
    Mutant("lamb-returns-original", "lamb", "replace_optimizer returns the user's Adam/AdamW instead of LAMB",
           "plugins/lamb.py",
           "    return replace_with(LAMB, optimizer, model, exclude_from_weight_decay,\n"
           "                        accepted=isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)),\n"
           '                        requirement=f"lamb needs {NEEDED_OPTIMIZER[\'adam\']}",\n'
           '                        inherited=("lr", "betas", "eps"), lamb_weight_decay=lamb_weight_decay,\n'
           "                        always_adapt=always_adapt)\n",
           "    replace_with(LAMB, optimizer, model, exclude_from_weight_decay,\n"
           "                 accepted=isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)),\n"
           '                 requirement=f"lamb needs {NEEDED_OPTIMIZER[\'adam\']}",\n'
           '                 inherited=("lr", "betas", "eps"), lamb_weight_decay=lamb_weight_decay,\n'
           "                 always_adapt=always_adapt)\n"
           "    return optimizer\n",
           (module("lamb"), wiring("lamb"), rows("lamb+recompute", "amp+lamb"))),
    Mutant("lamb-weight-decay-constant", "lamb", "contribute() passes lamb_weight_decay=0.01 instead of the knob",
           "runner/strategies/lamb.py",
           'Component("plugins.lamb:replace_optimizer", asdict(self))',
           'Component("plugins.lamb:replace_optimizer", {"lamb_weight_decay": 0.01, '
           '"exclude_from_weight_decay": list(self.exclude_from_weight_decay), "always_adapt": self.always_adapt})',
           (wiring("lamb"), module("lamb"), rows("lamb+recompute", "amp+lamb"))),
    Mutant("lamb-excluded-adapted", "lamb", "tensors without weight decay still scaled by the trust ratio (not Paddle's)",
           "plugins/lamb.py", 'adapt=weight_decay > 0 or group["always_adapt"])', "adapt=True)",
           (("tests/plugins/test_lamb.py", "-k", "paddle"),)),
    Mutant("lamb-trust-ratio-one", "lamb", "trust ratio fixed at 1: LAMB steps as plain AdamW",
           "plugins/lamb.py", "trust = torch.where((w_norms > 0) & (r_norms > 0), w_norms / r_norms, 1.0)",
           "trust = torch.ones_like(w_norms)",
           (module("lamb"), rows("lamb+recompute"))),
    # ------------------------------------------------------------------ localsgd
    Mutant("localsgd-never-averaged", "localsgd", "the averager's schedule is counted but parameters never averaged",
           "plugins/localsgd.py",
           "        averager.average_parameters(pl_module.parameters())\n        return averages\n",
           "        return averages\n",
           (module("localsgd"), wiring("localsgd and not adaptive"), rows("amp+localsgd"))),
    Mutant("localsgd-k-steps-constant", "localsgd", "contribute() passes k_steps=1 instead of the knob",
           "runner/strategies/localsgd.py",
           'Component("plugins.localsgd:ModelAveraging", self.averaging_knobs())',
           'Component("plugins.localsgd:ModelAveraging", {"k_steps": 1, "begin_step": self.begin_step})',
           (wiring("localsgd and not adaptive"), module("localsgd"), rows("amp+localsgd"))),
    # ------------------------------------------------------------------ adaptive_localsgd
    Mutant("adaptive-localsgd-never-averaged", "adaptive_localsgd",
           "the period is adapted but parameters never averaged",
           "plugins/adaptive_localsgd.py",
           "            average_parameters_or_parameter_groups(pl_module.parameters(), dist.group.WORLD)\n", "",
           (module("adaptive_localsgd"), wiring("adaptive_localsgd"), rows("adaptive_localsgd+amp"))),
    Mutant("adaptive-localsgd-broadcast", "adaptive_localsgd",
           "averaging broadcasts rank 0's parameters instead of taking the mean",
           "plugins/adaptive_localsgd.py",
           "            average_parameters_or_parameter_groups(pl_module.parameters(), dist.group.WORLD)\n",
           "            for parameter in pl_module.parameters():\n"
           "                dist.broadcast(parameter.data, src=0)\n",
           (module("adaptive_localsgd"), wiring("adaptive_localsgd"), rows("adaptive_localsgd+amp"))),
    Mutant("adaptive-localsgd-init-k-constant", "adaptive_localsgd",
           "contribute() passes init_k_steps=1 instead of the knob",
           "runner/strategies/adaptive_localsgd.py",
           'self.averaging_knobs())])',
           '{"init_k_steps": 1, "begin_step": self.begin_step})])',
           (wiring("adaptive_localsgd"), module("adaptive_localsgd"), rows("adaptive_localsgd+amp"))),
    # ------------------------------------------------------------------ dgc
    Mutant("dgc-dense", "dgc", "top-k keeps the sparsity fraction instead of 1 - sparsity: nearly dense",
           "plugins/dgc_compression.py",
           "return min(numel, max(1, math.ceil(round(numel * (1.0 - sparsity), 6))))",
           "return min(numel, max(1, math.ceil(round(numel * sparsity, 6))))",
           (module("dgc"), wiring("dgc"), rows("dgc+recompute"))),
    Mutant("dgc-padded-to-dense", "dgc", "values and indices padded to the bucket's size before all_gather",
           "plugins/dgc.py",
           "    indices = indices.to(index_dtype(v.numel()))\n",
           "    indices = indices.to(index_dtype(v.numel()))\n"
           "    values = torch.cat([values, values.new_zeros(v.numel() - values.numel())])\n"
           "    indices = torch.cat([indices, indices.new_zeros(v.numel() - indices.numel())])\n",
           (module("dgc"), wiring("dgc"), rows("dgc+recompute"))),
    Mutant("dgc-sparsity-constant", "dgc", "contribute() passes sparsity=[0.999] instead of the knob",
           "runner/strategies/dgc.py",
           'comm_hook=Component("plugins.dgc:build_hook", asdict(self))',
           'comm_hook=Component("plugins.dgc:build_hook", {"rampup_begin_step": self.rampup_begin_step, '
           '"rampup_step": self.rampup_step, "sparsity": [0.999]})',
           (wiring("dgc"), module("dgc"), rows("dgc+recompute"))),
    Mutant("dgc-momentum-kept", "dgc", "the replacement SGD keeps the user's momentum: momentum applied twice",
           "plugins/dgc.py",
           'new_groups = [{**group, "params": list(group["params"]), "momentum": 0.0, "weight_decay": 0.0}',
           'new_groups = [{**group, "params": list(group["params"]), "weight_decay": 0.0}',
           (module("dgc"), rows("dgc+recompute"))),
    # ------------------------------------------------------------------ fp16_allreduce
    Mutant("fp16-allreduce-plain-hook", "fp16_allreduce", "float16 maps to torch's plain float32 allreduce hook",
           "plugins/fp16_allreduce.py",
           "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, "
           "fp16_compress_hook\n\nfrom plugins import traffic\n\n\n"
           'HOOKS = {"float16": fp16_compress_hook, "bfloat16": bf16_compress_hook}\n',
           "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook\n\n"
           "from plugins import traffic\n\n\n"
           'HOOKS = {"float16": allreduce_hook, "bfloat16": bf16_compress_hook}\n',
           (module("fp16_allreduce"), wiring("fp16_allreduce"))),
    Mutant("fp16-allreduce-dtype-dropped", "fp16_allreduce", "contribute() passes no dtype: always float16",
           "runner/strategies/fp16_allreduce.py",
           'Component("plugins.fp16_allreduce:build_hook", asdict(self))',
           'Component("plugins.fp16_allreduce:build_hook", {})',
           (wiring("fp16_allreduce"), module("fp16_allreduce"))),
    # ------------------------------------------------------------------ sharding
    Mutant("sharding-stage3-as-stage2", "sharding", "fully_shard never reshards after forward: stage 3 acts as stage 2",
           "plugins/sharding.py",
           "options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,",
           "options = dict(mesh=mesh, reshard_after_forward=False,",
           (wiring("sharding"), module("sharding"), rows("amp+sharding"))),
    Mutant("sharding-zero1-not-applied", "sharding", "stage 1 keeps the plain optimizer: no ZeRO state sharding",
           "plugins/sharding.py",
           "        super().setup_optimizers(trainer)\n"
           '        shard_strategy_optimizers(self, self.device_mesh["dp_shard"].get_group())\n',
           "        super().setup_optimizers(trainer)\n",
           (wiring("sharding"), module("sharding"), rows("amp+sharding"))),
    Mutant("sharding-hybrid-shard-dim-only", "sharding",
           "FSDP on the dp_shard dim only: the dp_degree replicas never synchronise",
           "plugins/sharding.py",
           'dims = ("dp_replicate", "dp_shard") if strategy.layout.dp_replicate > 1 else ("dp_shard",)',
           'dims = ("dp_shard",)',
           (wiring("sharding"), module("sharding"), rows("amp+sharding"))),
    Mutant("sharding-pipeline-zero1-off", "sharding", "with pipeline, the replicas' optimizer states are not sharded",
           "runner/strategies/pipeline.py",
           '"shard_optimizer_states": processes.dp_shard > 1}',
           '"shard_optimizer_states": False}',
           (wiring("sharding"), rows("pipeline+sharding"), module("pipeline"))),
    # ------------------------------------------------------------------ pipeline
    Mutant("pipeline-whole-model", "pipeline", "keep_only_stages not called: every rank keeps the whole model",
           "plugins/pipeline.py",
           "        keep_only_stages(model, [stage.submod for stage in (*self.stages, *self.eval_stages)])\n", "",
           (module("pipeline"), wiring("pipeline"), rows("pipeline+recompute"))),
    Mutant("pipeline-outside-autocast", "pipeline",
           "the schedule runs outside train_step_context: bf16/fp16 stages compute in float32",
           "plugins/pipeline.py",
           "        with self.precision_plugin.train_step_context():\n"
           "            loss = self._run(self.schedule.step, inputs, targets)\n",
           "        loss = self._run(self.schedule.step, inputs, targets)\n",
           (module("pipeline"), rows("amp+pipeline"), wiring("pipeline"))),
    Mutant("pipeline-replicas-not-synced", "pipeline", "stages not wrapped in DDP: the data-parallel replicas drift",
           "plugins/pipeline.py",
           "        if self.layout.dp_shard > 1:\n"
           "            for stage in self.stages:\n"
           '                _replicate(stage, self.device_mesh["dp_shard"].get_group())\n',
           "",
           (module("pipeline"), rows("pipeline+sharding"))),
    Mutant("pipeline-loss-not-scaled", "pipeline", "micro-batch losses not scaled by the float16 loss scaler",
           "plugins/pipeline.py",
           "return loss if scaler is None else scaler.scale(loss)", "return loss",
           (module("pipeline"), rows("amp+pipeline"))),
    # ------------------------------------------------------------------ the runner
    Mutant("export-fleet-default-dropped", "runner",
           "export leaves out knobs at lightfleet's default where Fleet's default differs",
           "runner/fleet/export_fleet.py", "    if value != default or fleet_value != fleet_default(field):\n",
           "    if value != default:\n",
           (select("tests/runner/test_fleet.py", "fleet_reads"),)),
    Mutant("measure-warmup-ignored", "runner", "measure.warmup_steps does not reach the meter (always 5)",
           "runner/rank/callbacks.py", '{"warmup_steps": measure.warmup_steps}', "{}",
           (select("tests/runner/test_measure.py", "single_process"),)),
    Mutant("sharding-amp-reduce-float16", "runner", "FSDP reduces float16 amp gradients in float16",
           "plugins/sharding.py", "reduce_dtype=torch.float32 if param_dtype else None)", "reduce_dtype=None)",
           (module("sharding"), module("batch_norm"))),
    Mutant("ckpt-last-oldest", "runner", "ckpt_path=last takes the oldest checkpoint",
           "runner/records/run_dir.py", "newest = max(ours, key=lambda path: saved_at(path))",
           "newest = min(ours, key=lambda path: saved_at(path))",
           (select("tests/runner/test_records.py", "ckpt_path_last"),)),
    Mutant("ckpt-last-root-dir-ignored", "runner", "ckpt_path=last ignores paths.root_dir",
           "runner/records/run_dir.py", "root = (base / Path(run.paths.root_dir).expanduser()).resolve()",
           "root = base.resolve()",
           (select("tests/runner/test_records.py", "ckpt_path_last"),)),
    Mutant("ckpt-temporary-left", "runner", "a write that fails (a full disk) leaves its temporary file behind",
           "runner/records/checkpoints.py", "        tmp.unlink(missing_ok=True)\n        raise\n", "        raise\n",
           (select("tests/test_checkpoints.py", "full_disk_stops or not_fit"),)),
    Mutant("ckpt-manifest-unchecked", "runner", "ckpt_path's bytes are not checked against its manifest",
           "runner/records/run_dir.py", "    verdict = verify(checkpoint)\n", "    verdict = verify(Path('/nonexistent'))\n",
           (select("tests/test_checkpoints.py", "damaged_checkpoint"),)),
    Mutant("ckpt-loaded-with-code", "runner", "the preflight unpickles ckpt_path with code allowed",
           "runner/records/run_dir.py", 'meta = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)',
           'meta = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)',
           (select("tests/test_checkpoints.py", "crafted"),)),
    Mutant("ckpt-directory-in-place", "runner", "every rank writes a sharded checkpoint straight into its directory",
           "plugins/directory_checkpoint.py", "            _distributed_checkpoint_save(state, written)",
           "            _distributed_checkpoint_save(state, path)",
           (select("tests/test_checkpoints.py", "sharded"),)),
    Mutant("ckpt-last-written-twice", "runner", "last.ckpt of the top-k file's bytes is written again, not linked",
           "runner/records/checkpoints.py", "            if digest != previous.sha256 or not hard_linked(previous.path, tmp):",
           "            if True:",
           (select("tests/runner/test_checkpoint_io.py", "hard_link"),)),
    Mutant("ckpt-background-not-waited", "runner", "a rank leaves while its checkpoints are still written in the background",
           "runner/rank/checkpoint_io.py", "            self._last.result()", "            pass",
           (select("tests/test_preemption.py", "background"),)),
    Mutant("ckpt-background-after-failure", "runner", "the writer goes on after a write the full disk refused",
           "runner/rank/checkpoint_io.py", "        if self._failure is not None:\n            return",
           "        if False:\n            return", (select("tests/runner/test_checkpoint_io.py", "full_disk_refused"),)),
    Mutant("callback-hooks-all-dispatched", "runner", "Lightning calls every batch hook of lightfleet's callbacks",
           "runner/rank/hooks.py", "                setattr(cls, name, None)", "                pass",
           (select("tests/runner/test_hooks.py", "only_for_the_hooks"),)),
    Mutant("seed-ignored", "runner", "the seed knob is ignored: every run seeds 0",
           "runner/rank/build.py", "pl.seed_everything(cfg.seed, workers=True, verbose=False)",
           "pl.seed_everything(0, workers=True, verbose=False)",
           (select("tests/test_runs.py", "seed_decides"),)),
    Mutant("val-loss-rank-0", "runner", "a multi-process run's validation loss is rank 0's alone",
           "runner/models/__init__.py", 'self.log_dict({"val_loss": loss, "val_acc": accuracy}, sync_dist=True)',
           'self.log_dict({"val_loss": loss, "val_acc": accuracy})',
           (select("tests/test_runs.py", "whole_set"),)),
    Mutant("eval-trains", "runner", "lightfleet eval trains instead of evaluating",
           "runner/rank/train.py", "    if cfg.evaluate:  # the weights of ckpt_path, no training\n",
           "    if False:\n",
           (select("tests/test_runs.py", "whole_set"),)),
    Mutant("sweep-refused-scores-zero", "runner", "a refused sweep job gives the sweeper 0.0 instead of its worst value",
           "runner/command/job.py",
           '{"overrides": command, "reason": str(problem)})\n        return no_result()\n',
           '{"overrides": command, "reason": str(problem)})\n        return 0.0\n',
           (select("tests/test_hydra_app.py", "refused_trial"),)),
    Mutant("auto-facts-no-activations", "runner", "auto's facts leave out the activations",
           "plugins/auto.py", "saved = saved_activations(model, first_batch(datamodule), block_list, device)",
           "saved = None",
           (select("tests/plugins/test_auto.py", "activations"),)),
    Mutant("fuse-all-reduce-ignored", "runner", "collective.fuse_all_reduce_ops=false is ignored",
           "runner/config/collective.py", "if self.fuse_all_reduce_ops else UNFUSED_BUCKET_MB",
           "if True else UNFUSED_BUCKET_MB",
           (module("collective"), select("tests/runner/test_plan.py"))),
    # ------------------------------------------------------------------ the fast path
    Mutant("fast-path-optimizer-as-built", "fast_path", "fast_path.fused_optimizer leaves every optimizer as built",
           "plugins/fast_path.py", "    if why_not is None:\n", "    if False:\n",
           (select("tests/plugins/test_fast_path.py", "fused_optimizer_is or fused_step"),)),
    Mutant("fast-path-sgd-fused-on-dtensor", "fast_path", "SGD over DTensor parameters fused: torch has no such kernel",
           "plugins/fast_path.py", "FUSED_ON_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)",
           "FUSED_ON_DTENSOR = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)",
           (select("tests/plugins/test_fast_path.py", "dtensor"),)),
    Mutant("fast-path-attention-any-kernel", "fast_path", "fast_path.attention allows every kernel (torch chooses)",
           "plugins/fast_path.py", "sdpa_kernel([KERNELS[self.kernel]])", "sdpa_kernel(list(KERNELS.values()))",
           (select("tests/plugins/test_fast_path.py", "kernel_runs"),)),
    Mutant("fast-path-fused-with-clipping", "fast_path",
           "a fused step beside float16 loss scaling and clipping (Lightning fails at the first step)",
           "runner/strategies/amp.py", 'if mechanism == "fused_optimizer" and self.dtype == "float16" and clip:',
           'if mechanism == "fused_optimizer" and self.dtype == "float16" and clip and False:',
           (select("tests/plugins/test_fast_path.py", "refused or auto_beside"),)),
    Mutant("mfu-float32-peak", "runner", "MFU of a bf16 or fp16 run taken against the float32 peak",
           "runner/rank/measure.py", "self.peak_flops = peak_flops(self.device, compute_dtype(trainer))",
           "self.peak_flops = peak_flops(self.device, torch.float32)",
           (select("tests/runner/test_measure.py", "mfu"),)),
    Mutant("transforms-before-configure-model", "runner",
           "the plan's transforms run before the user's own configure_model",
           "plugins/transforms.py", "    def configure_model() -> None:\n        own()\n        if done:",
           "    def configure_model() -> None:\n        if done:",
           (select("tests/runner/test_build.py", "configure_model"),)),
    Mutant("transforms-reversed", "runner", "the plan's model transforms applied in reverse phase order",
           "runner/rank/build.py", "for claim in plan.model_transforms]", "for claim in plan.model_transforms[::-1]]",
           (rows("amp+recompute", "pipeline+recompute"),)),
    Mutant("resume-torch-generator-only", "runner", "resume restores torch's generator only (not numpy's, Python's, CUDA's)",
           "runner/rank/resume.py",
           '_set_rng_states(restorable(own(self._loaded, "random generator states", rule)))',
           'torch.set_rng_state(own(self._loaded, "random generator states", rule)["torch"])',
           (select("tests/test_resume.py", "user_model"),)),
    # Resume on another number of processes (issue 41): rank 0's state for every rank, silently.
    Mutant("world-change-rank-0s-average", "runner", "dgc and local SGD take rank 0's state on another number of processes",
           "plugins/ranks.py", "    return Rule(says, lambda ranks, rank: mean(ranks))",
           "    return Rule(says, lambda ranks, rank: ranks[0])",
           (select("tests/test_resume_rules.py", "dgc or local_sgd"),)),
    Mutant("world-change-rank-0s-generators", "runner",
           "the random generators go on from rank 0's on another number of processes",
           "runner/rank/resume.py", "lambda ranks, rank: rederived(seed, step, rank))",
           "lambda ranks, rank: ranks[0])",
           (select("tests/test_resume_rules.py", "dropout"),)),
    Mutant("resume-scaler-state-lost", "runner", "resume drops the float16 loss scaler's state",
           "plugins/amp.py", "        super().load_state_dict(state_dict)\n        if not self._enabled:\n",
           "        if not self._enabled:\n",
           (rows("amp+recompute"), module("amp"))),
    Mutant("report-plot-axes-swapped", "runner", "the report's memory-vs-throughput plot has its axes swapped",
           "runner/records/plots.py",
           'measured = {job.label: (job.results["peak_memory_mb"], job.samples_per_s) for job in jobs',
           'measured = {job.label: (job.samples_per_s, job.results["peak_memory_mb"]) for job in jobs',
           (select("tests/runner/test_report.py", "memory_plot"),)),
    # (Not lars: the file's knobs for lars compose it back in, as a config file's knobs do.)
    Mutant("experiment-loses-strategy", "runner", "a shipped experiment silently loses one of its strategies",
           "experiments/resnet_amp_recompute_lars.yaml", "override /strategy: [amp, recompute, lars]",
           "override /strategy: [amp, lars]",
           (select("tests/runner/test_plan.py", "shipped"),)),
    Mutant("measure-own-rank-only", "runner", "the run's figures are gathered from this rank only",
           "runner/rank/measure.py", "        ranks = gather(mine)\n", "        ranks = [mine]\n",
           (select("tests/runner/test_measure.py", "two_replicas"),)),
    Mutant("knob-wrong-key", "runner", "collective.find_unused_parameters read from fuse_all_reduce_ops",
           "runner/config/collective.py", "find_unused_parameters=self.find_unused_parameters)",
           "find_unused_parameters=self.fuse_all_reduce_ops)",
           (module("collective"), select("tests/runner/test_plan.py"))),
    # ------------------------------------------------------------------ five classes of bugs (issue 35)
    # Per-item randomness collapsing: every item of an epoch draws the same.
    Mutant("imagefolder-one-crop-per-epoch", "data", "every image of an epoch gets the same random crop and flip",
           "runner/data/images.py", "            yield index, int(seeds[index])\n",
           "            yield index, int(seeds[0])\n",
           (select("tests/runner/test_data.py", "independently and imagefolder"),)),
    Mutant("synthetic-one-noise", "data", "the synthetic classification data draws one noise for every sample",
           "runner/data/synthetic.py",
           "return torch.randn(num_samples, *self.input_shape, generator=generator) + prototypes[labels], labels",
           "return torch.randn(1, *self.input_shape, generator=generator) + prototypes[labels], labels",
           (select("tests/runner/test_data.py", "independently and (classification or images)"),)),
    Mutant("language-model-one-first-token", "data", "every synthetic sequence starts with the same token",
           "runner/data/synthetic.py", "tokens[:, 0] = torch.randint(vocab, (num_sequences,), generator=generator)",
           "tokens[:, 0] = torch.randint(vocab, (1,), generator=generator)",
           (select("tests/runner/test_data.py", "independently and language_model"),)),
    Mutant("tokens-random-one-start", "data", "data=tokens' random windows of an epoch all start at one place",
           "runner/data/tokens.py", "return torch.randint(len(data), (count,), generator=generator)",
           "return torch.randint(len(data), (1,), generator=generator).expand(count)",
           (select("tests/runner/test_data.py", "independently and tokens"),)),
    # The global order dealt as DistributedSampler deals: the same samples a step, other micro-batches.
    Mutant("global-order-samples-interleaved", "data", "a rank takes every D-th sample of the global order, not every D-th batch",
           "runner/data/order.py", "yield from units[self.rank :: self.num_replicas].flatten().tolist()",
           "yield from units.flatten()[self.rank :: self.num_replicas].tolist()",
           (select("tests/runner/test_data.py", "1001 and classification"),)),
    # Evaluation that is not deterministic, or not evaluation's.
    Mutant("imagefolder-val-train-transforms", "data", "validation images take the training transforms (random crops and flips)",
           "runner/data/images.py", '"val": image_folder(self.root, val_split, "val_split", evaluate)}',
           '"val": image_folder(self.root, val_split, "val_split", train)}',
           (select("tests/runner/test_data.py", "same_items and imagefolder"),)),
    Mutant("synthetic-val-shuffled", "data", "the synthetic data's validation loader shuffles (the global RNG)",
           "runner/data/synthetic.py", "return self._loader(self.val_set)", "return self._loader(self.val_set, shuffle=True)",
           (select("tests/runner/test_data.py", "same_items and classification"),)),
    Mutant("tokens-test-training-windows", "data", "data=tokens' test split is served as training windows",
           "runner/data/tokens.py", "        return self._evaluation_loader(test)\n",
           "        return self._loader(test, TrainingWindows(test, self.windows, self.samples_per_epoch, "
           "batch_size=self.batch_size, seed=run_seed(), trainer=self.trainer))\n",
           (select("tests/runner/test_data.py", "same_items and tokens"),)),
    # Figures that ignore the input's size.
    Mutant("vision-flops-at-224", "models", "model=vision counts FLOPs at 224 pixels whatever data.image_size is",
           "runner/models/vision.py", "torch.zeros(1, 3, image_size, image_size)", "torch.zeros(1, 3, 224, 224)",
           (select("tests/runner/test_ecosystem_models.py", "vision_flops"),)),
    Mutant("causal-lm-flops-at-1024", "models", "model=causal_lm counts attention over 1,024 positions whatever seq_len is",
           "runner/models/causal_lm.py", "12 * len(self.layers) * hidden * self.seq_len",
           "12 * len(self.layers) * hidden * 1024",
           (select("tests/runner/test_ecosystem_models.py", "causal_lm_flops"),)),
    Mutant("gpt-flops-context-32", "models", "model=gpt counts attention over 32 positions whatever seq_len is",
           "runner/models/__init__.py", "12 * n_layers * d_model * seq_len", "12 * n_layers * d_model * 32",
           (select("tests/runner/test_models.py", "gpt_flops"),)),
    Mutant("tokens-per-sample-fixed", "data", "data=tokens and data=hf_text say 1,024 tokens a sample whatever seq_len is",
           "runner/data/tokens.py", "        return self.seq_len\n", "        return 1024\n",
           (select("tests/runner/test_data.py", "tokens_per_sample"),)),
    Mutant("measure-flops-per-token-as-per-sample", "measure", "the meter takes a model's FLOPs a token as its FLOPs a sample",
           "runner/rank/measure.py", "self.flops_per_sample = (per_token * self.tokens_per_sample if",
           "self.flops_per_sample = (per_token if",
           (select("tests/runner/test_measure.py", "sequence_length"),)),
    # Knobs with no fast test of their own effect.
    Mutant("gpt2-tie-ignored", "models", "model.tie_embeddings=false ignored for GPT-2: the head stays tied",
           "runner/models/causal_lm.py", "attn_pdrop=dropout, tie_word_embeddings=tie_embeddings",
           "attn_pdrop=dropout, tie_word_embeddings=True",
           (select("tests/runner/test_ecosystem_models.py", "tie_embeddings"),)),
    Mutant("gpt2-ffn-dim-ignored", "models", "model.ffn_dim ignored for GPT-2: the MLP stays 4 x d_model",
           "runner/models/causal_lm.py", "n_inner=ffn_dim,", "n_inner=None,",
           (select("tests/runner/test_ecosystem_models.py", "ffn_dim"),)),
    Mutant("vision-label-smoothing-dropped", "models", "model.label_smoothing of model=vision never reaches the loss",
           "runner/models/vision.py", "super().__init__(optimizer, warmup_steps, lr_decay, min_lr_ratio, label_smoothing)",
           "super().__init__(optimizer, warmup_steps, lr_decay, min_lr_ratio)",
           (select("tests/runner/test_ecosystem_models.py", "label_smoothing"),)),
    Mutant("gpt-heads-ignored", "models", "model=gpt's n_heads ignored: always 4 heads",
           "runner/models/__init__.py", "DecoderBlock(d_model, n_heads) for _ in range(n_layers)",
           "DecoderBlock(d_model, 4) for _ in range(n_layers)",
           (select("tests/runner/test_models.py", "n_heads"),)),
    Mutant("imagefolder-min-crop-scale-ignored", "data", "data.min_crop_scale ignored: crops from 8% of the image",
           "runner/data/images.py", "scale=(min_crop_scale, 1.0)", "scale=(0.08, 1.0)",
           (select("tests/runner/test_data.py", "min_crop_scale"),)),
    Mutant("hf-text-eos-token-ignored", "data", "data.eos_token of data=hf_text ignored: the tokenizer's own",
           "runner/data/hf_text.py", "text_tokenizer = load_tokenizer(tokenizer, eos_token)",
           "text_tokenizer = load_tokenizer(tokenizer, None)",
           (select("tests/runner/test_data.py", "eos_token"),)),
    # Command forms nobody ran.
    Mutant("eval-checkpoint-trains", "command", "lightfleet eval ckpt_path=PATH (no run directory) trains",
           "runner/command/cli.py", '        return [*args, "evaluate=true"]\n', "        return [*args]\n",
           (select("tests/runner/test_cli.py", "eval_of"),)),
    Mutant("replay-resumes", "command", "lightfleet replay RUN_DIR resumes from the run's last checkpoint",
           "runner/command/cli.py", '    if command in ("resume", "eval"):\n', '    if command in ("resume", "eval", "replay"):\n',
           (select("tests/runner/test_cli.py", "replay_trains"),)),
    Mutant("sweep-signal-not-passed-on", "command", "a signal to a sweep's command does not reach its launcher's workers",
           "runner/command/sweeps.py", "            if int(worker.name) in below:\n", "            if False:\n",
           (select("tests/test_sweep_stops.py", "joblib"),)),
    Mutant("sweep-resume-restarts-stopped-jobs", "command", "lightfleet resume SWEEP_DIR starts stopped jobs again",
           "runner/command/cli.py", '            extra[number] = [hydra_override("ckpt_path", last)] if last.is_file() else []\n',
           "            extra[number] = []\n", (select("tests/test_sweep_stops.py", "basic"),)),
    Mutant("report-command-takes-its-name", "command", "lightfleet report hands its own name to the report as a path",
           "runner/command/cli.py", 'return main_of(args[0])(args if args[0].endswith("-fleet") else args[1:])',
           'return main_of(args[0])(args if args[0] != "prepare-data" else args[1:])',
           (select("tests/runner/test_cli.py", "report_of"),)),
    Mutant("meter-pauses-before-training", "measure", "the meter pauses what only training starts: lightfleet eval fails",
           "runner/rank/measure.py",
           "        if self.clock is None:  # not training yet: an evaluation, or fit's sanity check\n            return\n",
           "", (select("tests/runner/test_measure.py", "evaluation_and"),)),
    # The ranks forked from the command (runner/command/launch.py).
    Mutant("fork-after-threads", "launch", "the command computes on many threads before it forks: ranks wait forever",
           "runner/command/launch.py", "        torch.set_num_threads(1)\n", "",
           (select("tests/test_forked_ranks.py"),)),
    Mutant("forked-rank-in-the-commands-session", "launch", "a forked rank stays in the command's session: "
           "Ctrl-C reaches it twice and it stops without a checkpoint",
           "runner/rank/parent.py", "    os.setsid()\n", "",
           (select("tests/test_interrupts.py", "ctrl_c_checkpoints"),)),
    # ------------------------------------------------------------------ five classes of bugs (issue 40)
    # A count over the processes where the data does not divide evenly.
    Mutant("epoch-steps-without-accumulation", "plan", "an epoch's optimizer steps leave the accumulation out",
           "runner/config/checks.py", "global_batch = processes * batch_size * accumulation",
           "global_batch = processes * batch_size",
           (select("tests/runner/test_plan.py", "validation_interval_is_at_most"),)),
    # A home-relative path not expanded where a path is taken.
    Mutant("data-path-home-unexpanded", "paths", "the preflight looks for data files and folders at a literal ~",
           "runner/config/values.py", "path = Path(value).expanduser()", "path = Path(value)",
           (select("tests/runner/test_home_paths.py", "path_knob"),)),
    Mutant("run-dir-home-unexpanded", "paths", "resume, replay and eval read RUN_DIR at a literal ~",
           "runner/command/cli.py", "run_dir = user_path(args[0]).resolve()", "run_dir = Path(args[0]).resolve()",
           (select("tests/runner/test_home_paths.py", "paths_of_a_run"),)),
    # The progress bar's clock restarting at each epoch.
    Mutant("progress-clock-per-epoch", "progress", "the bar's clock and rate restart at every epoch",
           "runner/rank/progress.py", "bar.initial, bar.start_t = self.counting_since",
           "bar.initial = self.counting_since[0]",
           (select("tests/runner/test_progress.py"),)),
    Mutant("rich-progress-clock-per-epoch", "progress", "the rich bar's task is reset at every epoch, as Lightning's",
           "runner/rank/progress.py", "        if self.progress is None or self.train_progress_bar_id is None or self._leave:\n",
           "        if True:\n",
           (select("tests/runner/test_progress.py", "rich"),)),
    # A knob of a strategy left out of the list, in an override form the check does not know.
    Mutant("strategy-knob-plain-form-only", "compose", "+key, ++key and ~key of an unselected strategy's knob pass",
           "runner/config/compose.py", 'STRATEGY_KNOB = re.compile(r"^[+~]*(strategy', 'STRATEGY_KNOB = re.compile(r"^(strategy',
           (select("tests/runner/test_preflight.py", "every_override_form"),)),
    # A shipped experiment losing a strategy or a setting.
    Mutant("experiment-drops-recompute", "experiments", "resnet_amp_recompute runs amp alone",
           "experiments/resnet_amp_recompute.yaml", "override /strategy: [amp, recompute]", "override /strategy: [amp]",
           (select("tests/runner/test_plan.py", "shipped"),)),
    Mutant("experiment-setting-lost", "experiments", "mlp_localsgd averages every step (its k_steps line lost)",
           "experiments/mlp_localsgd.yaml", "    k_steps: 4\n", "",
           (select("tests/runner/test_plan.py", "shipped"),)),
    # lightfleet rehearse (issue 42): the ranks it picks, the reserve, the preflight it skips.
    Mutant("rehearse-no-middle-stage", "rehearse", "a pipeline's middle stages are never rehearsed",
           "runner/config/rehearse.py", "places = sorted({0, min(1, layout.pp - 1), layout.pp - 1})",
           "places = sorted({0, layout.pp - 1})",
           (select("tests/runner/test_rehearse_command.py", "one_per_pipeline"),)),
    Mutant("rehearse-checkpoint-peak-ignored", "rehearse", "a checkpoint save that peaks above the step is not held "
           "against the device", "runner/config/rehearse.py", "peak = max(step, checkpoint)", "peak = step",
           (select("tests/runner/test_rehearse_command.py", "reserve"),)),
    Mutant("rehearse-checks-this-machine", "rehearse", "a rehearsal of several nodes asks for the cluster's "
           "rendezvous variables", "runner/command/preflight.py",
           'return self.rehearsal in ("runs", "only") if rehearsal else self.rehearsal != "only"',
           'return self.rehearsal != "only" or rehearsal',
           (select("tests/runner/test_preflight.py", "order_the_design"),
            select("tests/runner/test_rehearse_command.py", "rendezvous"))),
]


def find_mutant_errors(root: Path, mutants: Iterable[Mutant]) -> Dict[str, str]:
    """Mutant id -> why it cannot be planted in `root`'s files (its old text missing or ambiguous)."""
    errors = {}
    for mutant in mutants:
        path = root / mutant.file
        if not path.is_file():
            errors[mutant.id] = f"{mutant.file} does not exist"
            continue
        count = path.read_text().count(mutant.old)
        if count != 1:
            where = "is missing from" if count == 0 else f"occurs {count} times in"
            errors[mutant.id] = f"its old text {where} {mutant.file} (it must occur exactly once): {mutant.old!r}"
    return errors


def make_copy() -> Path:
    copy = Path(tempfile.mkdtemp(prefix="lightfleet-mutations-"))
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        source = PROJECT_ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=skip)
        else:
            shutil.copy2(source, copy / name)
    return copy


def copy_environment(copy: Path) -> Dict[str, str]:
    # No bytecode: a mutant as long as the original, written within the same second, would
    # otherwise run from the original's cached .pyc.
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def check_copy_is_imported(copy: Path, env: Dict[str, str]) -> None:
    """A process started elsewhere (as the tests' subprocesses are) imports runner and plugins from the copy."""
    where = "import plugins, runner; print(runner.__file__); print(plugins.__file__)"
    done = subprocess.run([sys.executable, "-c", where], cwd=tempfile.gettempdir(), env=env, capture_output=True,
                          text=True, check=True)
    outside = [path for path in done.stdout.split() if not Path(path).resolve().is_relative_to(copy.resolve())]
    if outside:
        sys.exit(f"mutations.py: with PYTHONPATH={copy}, Python imports {outside} instead of the copy")


@dataclass
class StepResult:
    args: Step
    returncode: Optional[int]  # None: timed out
    seconds: float
    first_failure: str
    output_tail: str


FAILURE_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
SUMMARY = "short test summary info"


def run_step(step: Step, copy: Path, env: Dict[str, str], timeout: float) -> StepResult:
    """pytest on `step` in the copy; its own process group, killed whole on timeout (tests start ranks)."""
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, *PYTEST, *step], cwd=copy, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=max(timeout, 1))
        returncode: Optional[int] = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    seconds = time.monotonic() - start
    first_failure = ""
    if returncode not in (0, 5, None):
        match = FAILURE_LINE.search(output.rpartition(SUMMARY)[2])
        last_line = next((line for line in reversed(output.splitlines()) if line.strip()), "")
        first_failure = match.group(1) if match else f"pytest exit {returncode}: {last_line.strip()}"
    return StepResult(step, returncode, round(seconds, 1), first_failure, output[-4000:])


def verdict(steps: Sequence[StepResult]) -> Tuple[str, str]:
    """(caught column, by column) from the steps run for one mutant, the last one deciding."""
    last = steps[-1]
    if last.returncode is None:
        return "no (timeout)", "timed out in " + " ".join(last.args)
    if last.returncode == 5:
        return "no (nothing selected)", " ".join(last.args)
    if last.returncode != 0:
        return "yes", last.first_failure
    return "no", ""


def run_mutant(mutant: Mutant, copy: Path, env: Dict[str, str], timeout: float) -> Dict[str, object]:
    path = copy / mutant.file
    original = path.read_text()
    path.write_text(original.replace(mutant.old, mutant.new, 1))
    start = time.monotonic()
    steps: List[StepResult] = []
    try:
        for step in mutant.selection:
            steps.append(run_step(step, copy, env, timeout - (time.monotonic() - start)))
            if steps[-1].returncode != 0:
                break
    finally:
        path.write_text(original)
    caught, by = verdict(steps)
    return {"id": mutant.id, "strategy": mutant.strategy, "description": mutant.description, "file": mutant.file,
            "caught": caught, "by": by, "seconds": round(time.monotonic() - start, 1),
            "steps": [asdict(step) for step in steps]}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def run_mutants(mutants: Sequence[Mutant], errors: Dict[str, str], copy: Path, env: Dict[str, str],
                timeout: float, out: Path) -> bool:
    results = [{"id": m.id, "strategy": m.strategy, "description": m.description, "file": m.file,
                "caught": "refused", "by": errors[m.id], "seconds": 0.0, "steps": []}
               for m in mutants if m.id in errors]
    out.write_text(json.dumps({"mode": "mutants", "results": results}, indent=1))
    for mutant in (m for m in mutants if m.id not in errors):
        print(f"mutant {mutant.id} ...", file=sys.stderr, flush=True)
        results.append(run_mutant(mutant, copy, env, timeout))
        print(f"  caught: {results[-1]['caught']} {results[-1]['by']} ({results[-1]['seconds']} s)",
              file=sys.stderr, flush=True)
        out.write_text(json.dumps({"mode": "mutants", "results": results}, indent=1))
    print(markdown_table(["id", "strategy", "bug", "caught", "by", "seconds"],
                         ([r["id"], r["strategy"], r["description"], r["caught"], r["by"], r["seconds"]]
                          for r in results)))
    return all(r["caught"] == "yes" for r in results)


def run_baseline(mutants: Sequence[Mutant], copy: Path, env: Dict[str, str], timeout: float, out: Path) -> bool:
    """Each distinct selection step of `mutants`, once, on the unmutated copy."""
    steps = list(dict.fromkeys(step for mutant in mutants for step in mutant.selection))
    results = []
    for step in steps:
        print(f"baseline {' '.join(step)} ...", file=sys.stderr, flush=True)
        results.append(run_step(step, copy, env, timeout))
        print(f"  exit {results[-1].returncode} {results[-1].first_failure} ({results[-1].seconds} s)",
              file=sys.stderr, flush=True)
        out.write_text(json.dumps({"mode": "baseline", "results": [asdict(r) for r in results]}, indent=1))
    status = {None: "timeout", 0: "passes", 5: "selects nothing"}
    print(markdown_table(["selection", "result", "first failure", "seconds", "mutants"],
                         ([" ".join(r.args), status.get(r.returncode, "FAILS"), r.first_failure, r.seconds,
                           ", ".join(m.id for m in mutants if r.args in m.selection)] for r in results)))
    return all(r.returncode == 0 for r in results)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and whether each applies")
    parser.add_argument("--baseline", action="store_true",
                        help="run the mutants' selections on the unmutated copy; report failing ones")
    parser.add_argument("--out", type=Path, help="JSON results (default tests/mutations.json, "
                                                 "tests/mutations_baseline.json with --baseline)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per mutant (default %(default)s)")
    args = parser.parse_args(argv)

    by_id = {mutant.id: mutant for mutant in MUTANTS}
    unknown = [i for i in args.ids if i not in by_id]
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; see --list")
    mutants = [by_id[i] for i in args.ids] if args.ids else MUTANTS
    if args.list:
        errors = find_mutant_errors(PROJECT_ROOT, mutants)
        print(markdown_table(["id", "strategy", "bug", "file", "applies"],
                             ([m.id, m.strategy, m.description, m.file, errors.get(m.id, "yes")] for m in mutants)))
        return 1 if errors else 0

    out = args.out or PROJECT_ROOT / "tests" / ("mutations_baseline.json" if args.baseline else "mutations.json")
    copy = make_copy()
    try:
        env = copy_environment(copy)
        check_copy_is_imported(copy, env)
        if args.baseline:
            ok = run_baseline(mutants, copy, env, args.timeout, out)
        else:
            errors = find_mutant_errors(copy, mutants)
            for mutant_id, error in errors.items():
                print(f"mutations.py: refusing mutant {mutant_id}: {error}", file=sys.stderr)
            ok = run_mutants(mutants, errors, copy, env, args.timeout, out)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    print(f"results: {out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
