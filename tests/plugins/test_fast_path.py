"""fast_path.*: each knob is a claim in the plan (`<- fast_path`), refused beside what it cannot
serve in one line, and reaches what carries it out: torch's fused optimizer step (numerics
equal to the foreach step, float16 loss scaling equal to a plain torch loop), the attention
kernel counted in the aten ops each step runs (with recompute's second forward), and real runs
of the command: 2 processes over gloo under DDP, sharding stage 2 and the pipeline, and the
suite's one compiled run (compile with amp and recompute, asked for by fast_path.compile and a
collective fusion flag). tests/test_gpu.py runs the fused step, FlashAttention and compile on CUDA."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.optimizer_checks import ReplacedOptimizerMLP
from plugins.amp import build_precision
from plugins.fast_path import FUSED_ON_DTENSOR, AttentionKernel, fuse_optimizer
from plugins.lars import LARS
from plugins.recompute import apply_recompute
from plugins.transforms import transform_in_configure_model
from runner.command.planning import plan_for
from runner.core.errors import ConfigError
from runner.core.plan import format_plan
from runner.data import SyntheticLanguageModelData
from runner.models import GPTDecoder
from tests.helpers.probe import CountFirstBatch

GPT = ("model=gpt", "data=language_model")
FLASH_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


# --------------------------------------------------------------------------- the plan


def printed(spec_for, *overrides: str) -> List[str]:
    return format_plan(plan_for(spec_for(*overrides))).splitlines()


def test_each_knob_is_a_claim_by_the_fast_path(spec_for):
    lines = printed(spec_for, *GPT, "trainer.accelerator=cpu", "fast_path.compile=true",
                    "fast_path.compile_mode=max-autotune", "fast_path.fused_optimizer=true", "fast_path.attention=math")
    for line in ["  plugins.fast_path:fuse_optimizer()  <- fast_path",
                 "  1. [compile] plugins.fast_path:compile_model(mode='max-autotune')  <- fast_path",
                 "  plugins.fast_path:AttentionKernel(kernel='math')  <- fast_path"]:
        assert line in lines, line


def test_a_fusion_flag_and_compile_make_one_claim_naming_both_in_the_fast_paths_mode(spec_for):
    flag = "collective.build_strategy.fuse_gemm_epilogue=true"
    both = plan_for(spec_for(flag, "fast_path.compile=true", "fast_path.compile_mode=reduce-overhead"))
    assert [(c.by, c.phase, c.component.kwargs) for c in both.model_transforms] == [
        ("collective, fast_path", "compile", {"mode": "reduce-overhead"})]
    alone = plan_for(spec_for(flag)).model_transforms
    assert [(c.by, c.component.target, c.component.kwargs) for c in alone] == [
        ("collective", "plugins.fast_path:compile_model", {"mode": "default"})]
    assert plan_for(spec_for()).model_transforms == []  # the default: no compile


@pytest.mark.parametrize("accelerator, fused", [("gpu", True), ("cpu", False)])
def test_auto_fuses_the_optimizer_on_cuda_and_leaves_it_as_built_elsewhere(spec_for, accelerator, fused):
    transforms = plan_for(spec_for(f"trainer.accelerator={accelerator}")).optimizer_transforms
    assert [(c.by, c.component.target) for c in transforms] == ([("fast_path", "plugins.fast_path:fuse_optimizer")]
                                                                if fused else [])


def test_auto_beside_a_strategy_that_refuses_fusion_leaves_the_optimizer_and_says_why(spec_for):
    plan = plan_for(spec_for("trainer.accelerator=gpu", "strategy=[lars]"))
    assert plan.optimizer_transforms == []
    assert "fast_path.fused_optimizer=auto: the optimizer stays as built: strategy lars replaces the optimizer " \
           "with LARS, which torch has no fused kernel for (it steps on foreach kernels)" in plan.notes
    clipped = plan_for(spec_for("trainer.accelerator=gpu", "strategy=[amp]", "trainer.gradient_clip_val=1.0"))
    assert clipped.optimizer_transforms == [] and "strategy amp with dtype=float16" in clipped.notes[-1]
    # bfloat16 needs no loss scaling: a fused step and clipping combine.
    bf16 = plan_for(spec_for("trainer.accelerator=gpu", "strategy=[amp]", "strategy.amp.dtype=bfloat16",
                             "trainer.gradient_clip_val=1.0"))
    assert [c.component.target for c in bf16.optimizer_transforms] == ["plugins.fast_path:fuse_optimizer"]


def test_the_gpt2_experiment_compiles_and_on_cuda_fuses_its_adamw(spec_for):
    plan = plan_for(spec_for("experiment=gpt2_124m", "trainer.accelerator=gpu"))
    assert [(c.by, c.phase) for c in plan.model_transforms] == [("fast_path", "compile")]
    assert [(c.by, c.component.target) for c in plan.optimizer_transforms] == [
        ("fast_path", "plugins.fast_path:fuse_optimizer")]


@pytest.mark.parametrize("overrides, message", [
    (["fast_path.fused_optimizer=true", "strategy=[lars]"],
     r"^fast_path.fused_optimizer=True: strategy lars replaces the optimizer with LARS, which torch has no fused "
     r"kernel for \(it steps on foreach kernels\); auto or false leave it as built$"),
    (["fast_path.fused_optimizer=true", "strategy=[lamb]"],
     r"^fast_path.fused_optimizer=True: strategy lamb replaces "),
    (["fast_path.fused_optimizer=true", "strategy=[amp]", "trainer.gradient_clip_val=0.5"],
     r"^fast_path.fused_optimizer=True: strategy amp with dtype=float16 lets a fused step unscale the gradients "
     r"itself, so Lightning cannot clip them before it \(trainer.gradient_clip_val=0.5\): use dtype=bfloat16 or no "
     r"clipping; auto or false leave it as built$"),
    (["fast_path.compile=true", "strategy=[recompute]", "strategy.recompute.enable_offload=true"],
     r"^fast_path.compile=True: strategy recompute with enable_offload=true keeps the blocks' inputs on the host "
     r"through save_on_cpu hooks, which torch.compile does not trace"),
    (["collective.build_strategy.fuse_bn_act_ops=true", "strategy=[recompute]",
      "strategy.recompute.enable_offload=true"],
     r"^collective.build_strategy.fuse_bn_act_ops=True: strategy recompute with enable_offload=true"),
    (["fast_path.attention=efficient", "trainer.accelerator=cpu"],
     r"^fast_path.attention='efficient': torch has this kernel on CUDA only; on cpu: flash \(torch's CPU kernel\), "
     r"math or auto$"),
    (["fast_path.attention=cudnn", "trainer.accelerator=cpu"], r"^fast_path.attention='cudnn': torch has this kernel "),
    (["fast_path.attention=flash", "trainer.accelerator=gpu"],
     r"^fast_path.attention='flash': on CUDA this kernel takes float16 or bfloat16 inputs, and the run computes in "
     r"float32: add strategy amp"),
    (["fast_path.compile_mode=max_autotune"], r"^fast_path.compile_mode='max_autotune': allowed: .* \(did you mean "
                                              r"max-autotune"),
    (["fast_path.fused_optimizer=maybe"], r"^fast_path.fused_optimizer='maybe': allowed: auto, true, false$"),
    (["fast_path.fused_optimizer=1"], r"^fast_path.fused_optimizer=1: allowed: auto, true, false$"),
    (["fast_path.attention=flash2"], r"^fast_path.attention='flash2': allowed: .* \(did you mean flash\?\)$"),
])
def test_what_cannot_serve_the_run_is_refused_naming_the_key_the_value_and_why(spec_for, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_for(spec_for(*overrides))


@pytest.mark.parametrize("overrides, claimed", [
    (["fast_path.attention=flash", "trainer.accelerator=gpu", "strategy=[amp]"], "AttentionKernel"),  # 16-bit inputs
    (["fast_path.attention=cudnn", "trainer.accelerator=gpu", "strategy=[amp]", "strategy.amp.dtype=bfloat16"],
     "AttentionKernel"),
    (["fast_path.attention=efficient", "trainer.accelerator=gpu"], "AttentionKernel"),  # float32 too
    (["fast_path.attention=flash", "trainer.accelerator=cpu"], "AttentionKernel"),  # torch's CPU kernel takes float32
    (["fast_path.compile=true", "strategy=[recompute]"], "compile_model"),
    (["fast_path.fused_optimizer=true", "strategy=[dgc]", "trainer.devices=2"], "fuse_optimizer"),  # dgc's SGD fuses
    (["fast_path.fused_optimizer=true", "strategy=[amp]", "trainer.gradient_clip_val=1.0",
      "strategy.amp.dtype=bfloat16"], "fuse_optimizer"),
])
def test_what_combines_is_claimed(spec_for, overrides, claimed):
    plan = plan_for(spec_for(*overrides))
    claims = plan.callbacks + plan.model_transforms + plan.optimizer_transforms
    assert [c.by for c in claims if c.component.target == f"plugins.fast_path:{claimed}"] == ["fast_path"]


def test_a_refusal_on_the_command_line_is_one_line_exit_2_and_creates_nothing(lightfleet, tmp_path):
    done = lightfleet("fast_path.fused_optimizer=true", "strategy=[lars]")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "lightfleet: error: fast_path.fused_optimizer=True: strategy lars replaces the optimizer with LARS, which "
        "torch has no fused kernel for (it steps on foreach kernels); auto or false leave it as built"]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- the fused optimizer


def two_group_adamw(model: torch.nn.Module, **knobs: Any) -> torch.optim.AdamW:
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2,
                             betas=(0.8, 0.95), weight_decay=0.1, **knobs)


def test_the_fused_optimizer_is_the_same_class_and_groups_with_torchs_fused_step():
    model = ReplacedOptimizerMLP(lambda optimizer, model: optimizer)
    built = two_group_adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(built, lambda step: 0.5)  # sets initial_lr in the groups
    fused = fuse_optimizer(built)
    assert type(fused) is torch.optim.AdamW and fused._step_supports_amp_scaling  # torch's own init ran
    for old, new in zip(built.param_groups, fused.param_groups, strict=True):
        assert {**old, "fused": True, "foreach": False} == new  # lr, initial_lr, betas, ... kept
    assert fused.defaults["fused"] is True and fused.defaults["betas"] == (0.8, 0.95)
    assert scheduler.base_lrs == [group["initial_lr"] for group in fused.param_groups]


def test_fused_adamw_steps_as_the_foreach_adamw_it_replaces():
    torch.manual_seed(0)
    model = ReplacedOptimizerMLP(lambda optimizer, model: optimizer)
    twin = copy.deepcopy(model)
    foreach, fused = two_group_adamw(model, foreach=True), fuse_optimizer(two_group_adamw(twin, foreach=True))
    for step in range(5):
        batch = torch.randn(16, 32), torch.randint(4, (16,))
        for m, optimizer in ((model, foreach), (twin, fused)):
            optimizer.zero_grad()
            m.loss(m(batch[0]), batch[1]).backward()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(foreach.state[a]["exp_avg_sq"], fused.state[b]["exp_avg_sq"], rtol=1e-5, atol=1e-8)


def test_an_optimizer_without_a_fused_step_takes_foreach_or_stays_as_built_saying_so(capsys):
    model = torch.nn.Linear(4, 2)
    rmsprop = torch.optim.RMSprop(model.parameters())
    assert fuse_optimizer(rmsprop) is rmsprop and rmsprop.param_groups[0]["foreach"] is True
    lars = LARS(model.parameters(), lr=0.1, momentum=0.9, lars_coeff=0.001, lars_weight_decay=0.0, epsilon=0.0)
    assert fuse_optimizer(lars) is lars
    assert capsys.readouterr().err.splitlines() == [
        "lightfleet: fast_path.fused_optimizer: RMSprop has no fused implementation in torch; its foreach "
        "implementation instead",
        "lightfleet: fast_path.fused_optimizer: LARS has no fused implementation in torch; stepped as built"]


DTENSOR_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from plugins.fast_path import fuse_optimizer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
seen = {}
for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    try:
        cls([param], lr=0.1, fused=True).step()
        torch_fuses = True
    except NotImplementedError:
        torch_fuses = False
    ours = fuse_optimizer(cls([param], lr=0.1))
    ours.step()
    seen[cls.__name__] = [torch_fuses, bool(ours.param_groups[0]["fused"]), ours.param_groups[0]["foreach"]]
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_over_dtensor_parameters_only_the_kernels_torch_dispatches_are_fused(tmp_path):
    """torch 2.14's DTensor runs the fused Adam and AdamW kernels, not SGD's or Adagrad's: the
    fused optimizer follows what torch does (FUSED_ON_DTENSOR), and those two take foreach."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT, str(port)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    fused_on_dtensor = {cls.__name__ for cls in FUSED_ON_DTENSOR}
    assert {name for name, (torch_fuses, _, _) in seen.items() if torch_fuses} == fused_on_dtensor
    assert {name: ours for name, (_, *ours) in seen.items()} == {
        name: [True, False] if name in fused_on_dtensor else [False, True] for name in seen}
    assert "SGD has no fused kernel for DTensor parameters" in done.stderr


class InfAt(pl.Callback):
    """Writes inf into the first parameter's gradient at optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            next(pl_module.parameters()).grad.view(-1)[0] = math.inf


@pytest.mark.parametrize("optimizer, reference_kernel, inf_at", [
    (partial(torch.optim.AdamW, lr=1e-2), {"fused": True}, 1),
    (partial(torch.optim.SGD, lr=0.1, momentum=0.9), {"foreach": True}, 0)], ids=["adamw", "momentum sgd, first step"])
def test_float16_loss_scaling_with_the_fused_step_equals_torchs_own_loop(optimizer, reference_kernel, inf_at):
    """Lightning's float16 precision with FleetGradScaler hands the fused step the scale and the
    overflow flag (it unscales and skips inside its step): the same parameters as a plain torch
    loop with torch's GradScaler over the same batches, an inf gradient at step `inf_at` skipped by
    both (the scale halves: Fleet's rule with decr_every_n_nan_or_inf=1 is torch's). Against
    torch's fused AdamW; against its foreach SGD for momentum SGD, whose fused step torch starts
    from garbage momentum after a skipped first step (ResNet-50 under float16 amp went to NaN on an
    H200): lightfleet starts it at zero."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(16, 32), torch.randint(4, (16,))
    steps = 4  # on one batch: the loss falls
    model = ReplacedOptimizerMLP(lambda built, model: fuse_optimizer(built), optimizer=optimizer)
    reference = copy.deepcopy(model)
    precision = build_precision("cpu", "float16", init_loss_scaling=2.0 ** 10, use_dynamic_loss_scaling=True,
                                incr_every_n_steps=1000, decr_every_n_nan_or_inf=1, incr_ratio=2.0, decr_ratio=0.5)
    trainer = pl.Trainer(accelerator="cpu", plugins=[precision], max_steps=steps, callbacks=[InfAt(inf_at)],
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(inputs.repeat(steps, 1), targets.repeat(steps)), batch_size=16))
    assert trainer.optimizers[0].param_groups[0]["fused"] is True
    assert precision.scaler.get_scale() == 2.0 ** 9

    reference_optimizer = optimizer(reference.parameters(), **reference_kernel)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.loss(reference(inputs), targets)
        scaler.scale(loss).backward()
        if step == inf_at:
            next(reference.parameters()).grad.view(-1)[0] = math.inf
        scaler.step(reference_optimizer)
        scaler.update()
        reference_optimizer.zero_grad()
    assert scaler.get_scale() == 2.0 ** 9
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert model.losses[-1] < model.losses[0]


def test_a_momentum_sgd_with_dampening_is_not_fused():
    # torch's fused SGD would start its momentum wrongly after a skipped first step; zeros are right only without dampening.
    damped = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    assert not fuse_optimizer(damped).param_groups[0]["fused"]


# --------------------------------------------------------------------------- the attention kernel


@pytest.mark.parametrize("kernel, expected", [
    # Two blocks: each runs the kernel's forward twice (the forward, and recompute's again in
    # backward: checkpoint checks that the saved tensors match) and its backward once.
    ("flash", {FLASH_OPS[0]: 4, FLASH_OPS[1]: 2}),
    ("math", {"_safe_softmax": 4, "_softmax_backward_data": 2}),
])
def test_the_kernel_runs_in_every_forward_recomputation_and_backward(kernel, expected):
    model = GPTDecoder()
    transform_in_configure_model(model, [(apply_recompute, {"checkpoints": [], "enable_offload": False})])
    counted = CountFirstBatch()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[AttentionKernel(kernel), counted],
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, SyntheticLanguageModelData(batch_size=4))
    assert counted.counter.attention() == expected
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()  # restored at teardown


# --------------------------------------------------------------------------- real runs


PROBED = ("trainer.enable_progress_bar=false", "paths.output_dir=run", "trainer.accelerator=cpu",
          "+callbacks.probe._target_=tests.helpers.probe.FastPathProbe")


def ranks_saw(lightfleet, tmp_path: Path, *overrides: str, ranks: int = 2) -> List[Dict[str, Any]]:
    done = lightfleet(*PROBED, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / "run" / f"fast_path.rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.slow
def test_fused_adamw_and_the_math_kernel_train_two_ddp_processes_with_recompute(lightfleet, tmp_path):
    ranks = ranks_saw(lightfleet, tmp_path, *GPT, "trainer.devices=2", "trainer.max_steps=20", "strategy=[recompute]",
                      "fast_path.fused_optimizer=true", "fast_path.attention=math", "trainer.limit_val_batches=0")
    for seen in ranks:
        assert (seen["optimizer"], seen["fused"], seen["dtensor"]) == ("AdamW", [True], False)
        assert seen["attention"] == {"_safe_softmax": 4, "_softmax_backward_data": 2}
        assert sum(seen["losses"][-5:]) < 0.7 * sum(seen["losses"][:5]), seen["losses"]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-12)  # DDP kept them equal


@pytest.mark.slow
def test_sharding_stage_2_fuses_adamw_over_dtensors_and_runs_the_flash_kernel(lightfleet, tmp_path):
    ranks = ranks_saw(lightfleet, tmp_path, *GPT, "trainer.devices=2", "trainer.max_steps=3", "strategy=[sharding]",
                      "strategy.sharding.stage=2", "fast_path.fused_optimizer=true", "fast_path.attention=flash",
                      "trainer.limit_val_batches=0")
    for seen in ranks:
        assert (seen["optimizer"], seen["fused"], seen["dtensor"]) == ("AdamW", [True], True)
        assert seen["attention"] == {FLASH_OPS[0]: 2, FLASH_OPS[1]: 2}
        assert all(math.isfinite(loss) for loss in seen["losses"])
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.slow
def test_the_pipelines_stages_run_the_math_kernel_in_each_micro_batchs_forward_recomputation_and_backward(
        lightfleet, tmp_path):
    ranks = ranks_saw(lightfleet, tmp_path, *GPT, "trainer.devices=2", "trainer.max_steps=2",
                      "strategy=[recompute,pipeline]", "fast_path.attention=math", "trainer.limit_val_batches=0")
    for seen in ranks:  # a block per stage, 4 micro-batches
        assert seen["attention"] == {"_safe_softmax": 8, "_softmax_backward_data": 4}


@pytest.mark.slow
@pytest.mark.slow
def test_compile_with_float16_amp_and_recompute_trains_as_one_claim_of_the_fast_path_and_a_fusion_flag(
        lightfleet, tmp_path):
    """The suite's one compiled run (torch.compile takes tens of seconds on a CPU); recompute's
    checkpoints traced by it (plugins/recompute.py passes them no context_fn there)."""
    [seen] = ranks_saw(lightfleet, tmp_path, "collective.build_strategy.fuse_elewise_add_act_ops=true",
                       "fast_path.compile=true", "strategy=[amp,recompute]", "trainer.max_steps=3",
                       "trainer.limit_val_batches=0", "+callbacks.probe.count_attention=false", ranks=1)
    assert seen["compiled"] is True and seen["dynamo_graphs"] >= 1
    assert all(math.isfinite(loss) for loss in seen["losses"])
    run = tmp_path / "run"
    assert OmegaConf.to_container(OmegaConf.load(run / "build.yaml").model_transforms) == [
        {"by": "recompute", "phase": "recompute", "modules": ["blocks.0", "blocks.1", "blocks.2"]},
        {"by": "collective, fast_path", "phase": "compile", "modules": ["MLPClassifier"]}]
    assert OmegaConf.load(run / "plan.yaml").precision.component.kwargs.dtype == "float16"

