"""Pipeline parallelism in real 2-process training (2 stages or 2 x 2 interleaved, gloo on CPU, no
mocks): the schedules' gradients and losses are single-process training's, validation losses the
unsplit model's in eval mode (batch norm too, its statistics left alone), 1F1B holds fewer
activations than GPipe, checkpoints resume, amp and recompute train; refusals in-process. In
4 processes (2 stages x 2 data-parallel replicas, optionally ZeRO stage 1): training on the
replicas' global batch, validation averaged over them, sharded optimizer states, one gradient
reduction a step, resume."""
from __future__ import annotations

import functools

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers.distributed import load_ranks, run_two_ranks
from plugins.pipeline_split import balanced_cuts, stage_ranks, stage_split_points
from runner.core.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier, ResNetClassifier

LR, MOMENTUM, MICRO, ACCUMULATE, STEPS, TRAIN_STEPS, ADAMW_LR, GAMMA = 0.1, 0.9, 4, 4, 4, 25, 0.01, 0.5
VAL_EVERY, VAL_BATCHES = 2, 2  # validating runs: 2 batches every 2 steps
IMAGE = (3, 16, 16)  # ResNetClassifier's input shape (batch norm)
EXACT = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2}  # schedule -> stages per process
REPLICAS = 2  # data-parallel replicas of the 2-stage pipeline in the 4-process runs

# The rank side of every launch: each fit is a new model, Trainer and strategy training
# MLPClassifier(num_blocks=4) (or ResNetClassifier on images) on batches of MICRO * ACCUMULATE
# samples per replica.
RANK_SIDE = """
import functools
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from bench.pipeline import SavedActivationBytes
from tests.helpers.distributed import save
from plugins.amp import build_precision
from plugins.pipeline import build_pipeline, split_stages
from runner.rank.resume import GlobalPosition
from plugins.recompute import apply_recompute
from plugins.transforms import transform_in_configure_model
from runner.data import SyntheticClassificationData
from runner.core.errors import ConfigError
from runner.models import MLPClassifier, ResNetClassifier

OUT = Path(sys.argv[1])
torch.set_num_threads(1)


class Recorder(pl.Callback):
    # Per step: the batch, this rank's gradients and (after the step) parameters by name, the
    # loss, the peak bytes of activations saved for backward, the gradient reductions of the
    # stages' DDP, the dtypes of the floating outputs of the stages' modules (training only), and
    # the state of the optimizer over this rank's share by parameter name. Per validation: its
    # batches, this rank's buffers before it, its state_dict after, the logged val_loss.
    def __init__(self):
        self.steps = []
        self.validations = []
        self.reductions = 0
        self.hooks = None
        self.computing = False  # within a training batch: the stages' output dtypes are recorded

    def on_train_start(self, trainer, pl_module):
        self.initial = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        for stage in trainer.strategy.stages:
            if isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel):
                stage.submod.register_comm_hook(stage.submod.process_group, self.reduce)
            # The traced stages are what runs (the LightningModule's own modules are not called).
            for module in stage.submod.modules():
                module.register_forward_hook(self.output_dtypes)

    def output_dtypes(self, module, args, output):
        if self.computing:
            self.steps[-1]["dtypes"].update(str(t.dtype) for t in torch.utils._pytree.tree_leaves(output)
                                            if torch.is_tensor(t) and t.is_floating_point())

    def reduce(self, group, bucket):
        self.reductions += 1
        return allreduce_hook(group, bucket)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter = SavedActivationBytes(list(pl_module.parameters()))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
        self.hooks.__enter__()
        self.steps.append({"batch": [t.clone() for t in batch], "reductions": self.reductions, "dtypes": set()})
        self.computing = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[-1]["grads"] = {name: p.grad.clone() for name, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.stop_metering()
        self.computing = False
        names = {id(p): name for name, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]
        state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer's is its share's
        self.steps[-1].update(loss=float(outputs["loss"]), peak_bytes=self.meter.peak,
                              logged=float(trainer.callback_metrics["train_loss"]),
                              reductions=self.reductions - self.steps[-1]["reductions"],
                              params={name: p.detach().clone() for name, p in pl_module.named_parameters()},
                              state={names[id(p)]: {key: v.clone() for key, v in values.items() if torch.is_tensor(v)}
                                     for p, values in state.items()})

    def on_exception(self, trainer, pl_module, exception):
        self.stop_metering()  # a refused training batch ends no batch: the next fit must not be metered
        self.computing = False

    def stop_metering(self):
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None

    def on_validation_start(self, trainer, pl_module):
        self.validations.append({"batches": [], "buffers": {name: b.clone() for name, b in pl_module.named_buffers()}})

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.validations[-1]["batches"].append([t.clone() for t in batch])

    def on_validation_end(self, trainer, pl_module):
        self.validations[-1].update(val_loss=float(trainer.callback_metrics["val_loss"]),
                                    state={name: t.clone() for name, t in pl_module.state_dict().items()})


class DecayingLR(MLPClassifier):
    # The learning rate falls by GAMMA every step: the optimizer's hyper-parameters change.
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run(name, schedule, steps, vpp=1, micro=MICRO, accumulate=ACCUMULATE, batch_size=None, precision=None,
        recompute=False, checkpoint_dir=None, ckpt_path=None, num_train=2048, momentum=MOMENTUM, replicas=1,
        shard=False, decaying_adamw=False, val_batches=0, val_every=None, sanity=0, num_val=512, images=False):
    # val_batches validation batches (None: all) every val_every steps (None: at the epoch's end),
    # `sanity` before training; images: ResNetClassifier (batch norm) on IMAGE-shaped inputs.
    pl.seed_everything(0, verbose=False)
    sgd = functools.partial(torch.optim.SGD, lr=LR, momentum=momentum)
    if decaying_adamw:
        model = DecayingLR(num_blocks=4, optimizer=functools.partial(torch.optim.AdamW, lr=ADAMW_LR))
    elif images:
        model = ResNetClassifier(optimizer=sgd)
    else:
        model = MLPClassifier(num_blocks=4, optimizer=sgd)
    # The plan's model transforms: the split, then recompute of the stages' blocks.
    transforms = [(split_stages, {"split_points": [], "num_stages": 2 * vpp})]
    if recompute:
        transforms.append((apply_recompute, {"checkpoints": [], "enable_offload": False}))
    transform_in_configure_model(model, transforms)
    recorder = Recorder()
    callbacks = [recorder, GlobalPosition()]  # as lightfleet's runs have
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=OUT / checkpoint_dir, every_n_train_steps=steps, save_last=True))
    layout = {"dp_replicate": 1, "dp_shard": replicas, "pp": 2, "tp": 1}
    strategy = build_pipeline(schedule, micro, accumulate, vpp, layout, shard_optimizer_states=shard)
    trainer = pl.Trainer(accelerator="cpu", devices=2 * replicas, strategy=strategy,
                         plugins=[precision] if precision else [], callbacks=callbacks, max_steps=steps,
                         limit_val_batches=val_batches, val_check_interval=val_every, num_sanity_val_steps=sanity,
                         logger=False, enable_checkpointing=bool(checkpoint_dir),
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT)
    data = SyntheticClassificationData(input_shape=IMAGE if images else (32,), num_train=num_train, num_val=num_val,
                                       batch_size=batch_size or micro * accumulate)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except ConfigError as error:
        save(name, {"error": str(error)})
        return
    save(name, {"initial": recorder.initial, "steps": recorder.steps, "stage_ranks": trainer.strategy.stage_ranks,
                "validations": recorder.validations})
"""
CONSTANTS = "".join(f"{name} = {value!r}\n" for name, value in dict(
    LR=LR, MOMENTUM=MOMENTUM, MICRO=MICRO, ACCUMULATE=ACCUMULATE, STEPS=STEPS, TRAIN_STEPS=TRAIN_STEPS,
    ADAMW_LR=ADAMW_LR, GAMMA=GAMMA, EXACT=EXACT, VAL_EVERY=VAL_EVERY, VAL_BATCHES=VAL_BATCHES, IMAGE=IMAGE).items())

# Validating runs: VAL_BATCHES batches after every VAL_EVERY steps.
VALIDATE = f"VALIDATE = dict(val_batches={VAL_BATCHES}, val_every={VAL_EVERY})\n"

# One launch, every fit in the same 2 processes.
SCRIPT = CONSTANTS + RANK_SIDE + VALIDATE + """
for schedule, vpp in EXACT.items():
    run(schedule, schedule, STEPS, vpp, **VALIDATE)
# With a sanity check: validation before the first training step.
run("batch_norm", "1F1B", STEPS, images=True, sanity=VAL_BATCHES, **VALIDATE)
run("mem_1F1B", "1F1B", 1, micro=2, accumulate=8)
run("mem_GPipe", "GPipe", 1, micro=2, accumulate=8)
# 32 samples = 2 steps: "first" ends an epoch and checkpoints there, "resumed" goes on to STEPS.
run("first", "1F1B", 2, num_train=32, checkpoint_dir="ckpt")
run("resumed", "1F1B", STEPS, num_train=32, ckpt_path=OUT / "ckpt" / "last.ckpt")
run("full", "1F1B", STEPS, num_train=32)
# Plain SGD: momentum on batches of 16 is too noisy for a loss that falls within TRAIN_STEPS steps.
run("bf16", "1F1B", TRAIN_STEPS, precision=build_precision("cpu", "bfloat16"), momentum=0)
run("recompute", "1F1B", TRAIN_STEPS, recompute=True, momentum=0)
run("zbv", "ZBVZeroBubble", 1, vpp=2)
run("bad_batch", "1F1B", 1, batch_size=12)
# 32 training samples = 2 steps, then validation on 24 samples: a batch of 16, then one of 8.
run("bad_val_batch", "1F1B", 2, num_train=32, num_val=24, val_batches=None)
"""
RUNS = (*EXACT, "batch_norm", "mem_1F1B", "mem_GPipe", "first", "resumed", "full", "bf16", "recompute", "zbv",
        "bad_batch", "bad_val_batch")

# One launch of 4 processes: 1F1B over 2 stages x REPLICAS replicas with AdamW and a decaying
# learning rate, its optimizer states unsharded ("dp") and sharded over the replicas ("zero"); 64
# samples = 2 steps of both replicas' batches: "zero_first" ends an epoch and checkpoints there,
# "zero_resumed" goes on to STEPS.
DP_SCRIPT = CONSTANTS + RANK_SIDE + VALIDATE + f"""
DP = dict(replicas={REPLICAS}, decaying_adamw=True, num_train=64)
run("dp", "1F1B", STEPS, **VALIDATE, **DP)
run("zero", "1F1B", STEPS, shard=True, **DP)
run("zero_first", "1F1B", 2, shard=True, checkpoint_dir="zero_ckpt", **DP)
run("zero_resumed", "1F1B", STEPS, shard=True, ckpt_path=OUT / "zero_ckpt" / "last.ckpt", **DP)
"""
DP_RUNS = ("dp", "zero", "zero_first", "zero_resumed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: [rank 0's record, rank 1's record]}."""
    tmp_path = tmp_path_factory.mktemp("pipeline")
    run_two_ranks(SCRIPT, tmp_path, timeout=240)
    return {name: load_ranks(tmp_path, name) for name in RUNS}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """{run name: the 4 ranks' records}, rank = replica * 2 + pipeline rank; "dir": the run directory."""
    tmp_path = tmp_path_factory.mktemp("pipeline_dp")
    run_two_ranks(DP_SCRIPT, tmp_path, timeout=240, nproc=2 * REPLICAS)
    return {"dir": tmp_path, **{name: load_ranks(tmp_path, name, nproc=2 * REPLICAS) for name in DP_RUNS}}


# --------------------------------------------------------------------------- in-process


def test_stages_are_placed_in_a_loop_or_a_v():
    assert stage_ranks(2, 1, "1F1B") == [0, 1]
    assert stage_ranks(2, 2, "Interleaved1F1B") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "ZBVZeroBubble") == [0, 1, 2, 3, 3, 2, 1, 0]


def test_blocks_are_balanced_by_parameter_count():
    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_cuts([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    model = MLPClassifier(input_dim=4096, num_blocks=4)  # a heavy stem pulls the first cut forward
    assert stage_split_points(model, [], 2) == ["blocks.1"]
    assert stage_split_points(MLPClassifier(num_blocks=4), [], 2) == ["blocks.2"]
    assert stage_split_points(GPTDecoder(n_layers=4), [], 4) == ["blocks.1", "blocks.2", "blocks.3"]
    assert stage_split_points(MLPClassifier(num_blocks=4), ["blocks.3"], 2) == ["blocks.3"]


@pytest.mark.parametrize("model, split_points, stages, message", [
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [], 2, "has no repeated block list"),
    (MLPClassifier(num_blocks=3), [], 4, "has 3 blocks, fewer than the 4 stages"),
    (MLPClassifier(), ["blocks.7"], 2, "name no module of the model"),
    (MLPClassifier(), ["blocks.1", "blocks.2"], 2, "name 2 stage beginnings; 2 stages need 1"),
])
def test_unsplittable_models_are_refused(model, split_points, stages, message):
    with pytest.raises(ConfigError) as error:
        stage_split_points(model, split_points, stages)
    assert error.value.key == "strategy.pipeline.split_points"
    assert message in str(error.value) and "\n" not in str(error.value)


# A user's model with blocks but no loss(outputs, targets), which the last stage would call.
NO_LOSS_MODEL = """
import pytorch_lightning as pl
import torch
from torch import nn


class NoLoss(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(x))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_model_without_loss_is_refused_in_the_command(lightfleet, tmp_path):
    (tmp_path / "no_loss.py").write_text(NO_LOSS_MODEL)
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "no_loss.yaml").write_text("_target_: no_loss.NoLoss\n")
    done = lightfleet("--config-dir", "configs", "model=no_loss", "strategy=[pipeline]", "trainer.devices=2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("lightfleet: error: model='NoLoss': has no loss(outputs, targets) method")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["configs", "no_loss.py"]  # nothing created


# --------------------------------------------------------------------------- 2 processes


def reference_steps(record: list, steps: int, replicas: int = 1,
                    optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM),
                    gamma: float = 1.0) -> list:
    """Single-process training on the global batches (the replicas' batches, read by their first
    ranks, one after the other): a plain model with the same initial weights, the mean of all
    micro-batch losses, backward, `optimizer` with its learning rate times `gamma` after each
    step; per step (loss, {name: grad}, {name: parameter after the step})."""
    pl.seed_everything(0, verbose=False)
    model = MLPClassifier(num_blocks=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(next(rank["initial"][name] for rank in record if name in rank["initial"]))
    optimizer = optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    results = []
    for step in range(steps):
        batches = [rank["steps"][step]["batch"] for rank in record[:: len(record) // replicas]]
        inputs, targets = (torch.cat(tensors) for tensors in zip(*batches))
        optimizer.zero_grad()
        loss = torch.stack([model.loss(model(x), y) for x, y in zip(inputs.chunk(ACCUMULATE * replicas),
                                                                       targets.chunk(ACCUMULATE * replicas))]).mean()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        scheduler.step()
        results.append((loss.item(), grads, {name: p.detach().clone() for name, p in model.named_parameters()}))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("schedule", EXACT)
def test_schedule_matches_single_process_training(runs, schedule):
    ranks = runs[schedule]
    names = [name for name, _ in MLPClassifier(num_blocks=4).named_parameters()]
    held = [set(rank["initial"]) for rank in ranks]
    assert sorted(held[0] | held[1]) == sorted(names) and not held[0] & held[1]  # each parameter on one rank
    assert len(ranks[0]["stage_ranks"]) == 2 * EXACT[schedule]
    for step, (loss, grads, _) in enumerate(reference_steps(ranks, STEPS)):
        for rank in ranks:
            record = rank["steps"][step]
            assert all(torch.equal(a, b) for a, b in zip(record["batch"], ranks[0]["steps"][step]["batch"]))
            assert record["loss"] == pytest.approx(loss, abs=1e-5) and record["logged"] == record["loss"]
            for name, grad in record["grads"].items():
                torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-5)


def micro_batch_mean_loss(model: nn.Module, batches: list) -> float:
    """`model`'s loss (in its current mode) over the micro-batches of `batches`, averaged."""
    with torch.no_grad():
        losses = [model.loss(model(x), y) for inputs, targets in batches
                  for x, y in zip(inputs.chunk(ACCUMULATE), targets.chunk(ACCUMULATE))]
    return torch.stack(losses).mean().item()


def reference_val_loss(record: list, validation: int, model: nn.Module, replicas: int = 1) -> float:
    """The unsplit `model` in eval mode, with the state the pipeline's ranks held at that
    validation, on the replicas' validation batches (read by their first ranks)."""
    state = {name: t for rank in record[:2] for name, t in rank["validations"][validation]["state"].items()}
    model.load_state_dict(state, strict=True)
    model.eval()
    return micro_batch_mean_loss(model, [batch for rank in record[:: len(record) // replicas]
                                         for batch in rank["validations"][validation]["batches"]])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", EXACT)
def test_validation_logs_the_unsplit_models_eval_loss_on_every_rank(runs, schedule):
    ranks = runs[schedule]
    for validation in range(STEPS // VAL_EVERY):
        assert [len(rank["validations"][validation]["batches"]) for rank in ranks] == [VAL_BATCHES] * 2
        loss = reference_val_loss(ranks, validation, MLPClassifier(num_blocks=4))
        for rank in ranks:
            assert rank["validations"][validation]["val_loss"] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_validation_runs_batch_norm_in_eval_mode(runs):
    """The sanity check before training, then a validation every VAL_EVERY steps: each the unsplit
    model's eval-mode loss, each leaving the batch-norm statistics as training left them."""
    ranks = runs["batch_norm"]
    initial = dict(ResNetClassifier().named_buffers())  # running mean 0, variance 1, 0 batches tracked
    assert [len(rank["validations"]) for rank in ranks] == [1 + STEPS // VAL_EVERY] * 2
    for validation in range(1 + STEPS // VAL_EVERY):
        model = ResNetClassifier()
        loss = reference_val_loss(ranks, validation, model)
        for rank in ranks:
            record = rank["validations"][validation]
            assert record["val_loss"] == pytest.approx(loss, abs=1e-5)
            assert record["buffers"] and record["buffers"].keys() <= record["state"].keys()
            for name, before in record["buffers"].items():
                assert torch.equal(record["state"][name], before), name  # validation left them
                assert torch.equal(before, initial[name]) == (validation == 0), name  # training moved them
        # Batch statistics (train mode) would give another loss on the same micro-batches.
        train_mode = micro_batch_mean_loss(model.train(), ranks[0]["validations"][validation]["batches"])
        assert abs(train_mode - loss) > 1e-3


@pytest.mark.slow
def test_1f1b_holds_fewer_activations_than_gpipe(runs):
    one_f_one_b, gpipe = (runs[name][0]["steps"][0]["peak_bytes"] for name in ("mem_1F1B", "mem_GPipe"))
    # first stage, 8 micro-batches: GPipe keeps all 8 in flight, 1F1B at most 2 (p = 2 stages)
    assert 0 < one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)


@pytest.mark.slow
def test_resume_from_every_stage_checkpoint_gives_the_same_losses(runs):
    for first, resumed, full in zip(runs["first"], runs["resumed"], runs["full"]):
        assert [s["loss"] for s in first["steps"]] == [s["loss"] for s in full["steps"][:2]]
        assert len(resumed["steps"]) == STEPS - 2
        assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"][2:]]
        for mine, reference in zip(resumed["steps"], full["steps"][2:]):
            assert all(torch.equal(mine["grads"][name], g) for name, g in reference["grads"].items())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "recompute"])
def test_trains_with_amp_and_recompute(runs, name):
    losses = [step["loss"] for step in runs[name][0]["steps"]]
    assert len(losses) == TRAIN_STEPS and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


@pytest.mark.slow
def test_bf16_stages_compute_in_bfloat16(runs):
    """Under bf16 amp the traced stages that run compute in bfloat16 (their modules' floating
    outputs) at every training step, on both ranks; in a float32 run they never do."""
    for bf16, fp32 in zip(runs["bf16"], runs["1F1B"], strict=True):
        assert len(bf16["steps"]) == TRAIN_STEPS
        for index, step in enumerate(bf16["steps"]):
            assert "torch.bfloat16" in step["dtypes"], (index, step["dtypes"])
        for index, step in enumerate(fp32["steps"]):
            assert step["dtypes"] == {"torch.float32"}, (index, step["dtypes"])


@pytest.mark.slow
def test_recompute_keeps_only_block_inputs(runs):
    for plain, recomputed in zip(runs["1F1B"], runs["recompute"]):
        # the same first step (same weights, micro-batches, stages): the wrapped blocks save their
        # inputs only, and run again in backward to give the same gradients
        assert recomputed["steps"][0]["peak_bytes"] < 0.5 * plain["steps"][0]["peak_bytes"]
        assert recomputed["steps"][0]["loss"] == plain["steps"][0]["loss"]
        # (the wrappers are in the stages: the model keeps its parameter names)
        assert recomputed["steps"][0]["grads"].keys() == plain["steps"][0]["grads"].keys()
        for name, grad in plain["steps"][0]["grads"].items():
            torch.testing.assert_close(recomputed["steps"][0]["grads"][name], grad, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_runtime_refusals(runs):
    for rank in runs["bad_batch"]:
        assert rank["error"] == ("strategy.pipeline: a training batch of 12 samples is not accumulate_steps * "
                                 "micro_batch_size = 4 * 4 = 16; set data.batch_size=16 and drop a smaller last batch")
    for rank in runs["zbv"]:
        assert rank["error"].startswith("strategy.pipeline.schedule_mode='ZBVZeroBubble': fails on the gloo backend")
    for rank in runs["bad_val_batch"]:
        assert rank["error"] == ("strategy.pipeline: a validation batch of 8 samples is not accumulate_steps * "
                                 "micro_batch_size = 4 * 4 = 16; set data.batch_size=16 and make the validation set "
                                 "a multiple of 16 samples (e.g. data.num_val)")


# --------------------------------------------------------------------------- 4 processes: 2 stages x 2 replicas


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "zero"])
def test_replicas_train_the_pipeline_on_the_global_batch(dp_runs, name):
    ranks = dp_runs[name]
    pipelines = [ranks[replica * 2: replica * 2 + 2] for replica in range(REPLICAS)]
    names = [key for key, _ in MLPClassifier(num_blocks=4).named_parameters()]
    for first, last in pipelines:  # each parameter on one rank of each pipeline, the same one in all
        assert sorted([*first["initial"], *last["initial"]]) == sorted(names)
        assert not first["initial"].keys() & last["initial"].keys()
        assert first["initial"].keys() == pipelines[0][0]["initial"].keys()
        assert first["stage_ranks"] == last["stage_ranks"] == [0, 1]  # ranks within the pipeline
    adamw = functools.partial(torch.optim.AdamW, lr=ADAMW_LR)
    for step, (loss, grads, params) in enumerate(reference_steps(ranks, STEPS, REPLICAS, adamw, GAMMA)):
        records = [rank["steps"][step] for rank in ranks]
        for first, last in pipelines:  # a pipeline's ranks read one batch and log its loss
            assert all(torch.equal(a, b) for a, b in zip(first["steps"][step]["batch"], last["steps"][step]["batch"]))
            assert first["steps"][step]["loss"] == last["steps"][step]["loss"]
        assert not torch.equal(records[0]["batch"][0], records[2]["batch"][0])  # the replicas' differ
        assert sum(record["loss"] for record in records[::2]) / REPLICAS == pytest.approx(loss, abs=1e-5)
        for mine, replica in zip(records[:2], records[2:]):
            assert all(torch.equal(mine["params"][key], p) for key, p in replica["params"].items())
        for record in records:
            assert record["reductions"] == 1  # the stage's gradients, in one bucket, once a step
            for key, grad in record["grads"].items():
                torch.testing.assert_close(grad, grads[key], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(record["params"][key], params[key], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_validation_loss_is_averaged_over_the_replicas(dp_runs):
    ranks = dp_runs["dp"]
    for validation in range(STEPS // VAL_EVERY):
        batches = [rank["validations"][validation]["batches"][0][0] for rank in ranks]
        assert not torch.equal(batches[0], batches[2])  # the replicas validate on different samples
        loss = reference_val_loss(ranks, validation, MLPClassifier(num_blocks=4), REPLICAS)
        for rank in ranks:
            assert rank["validations"][validation]["val_loss"] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_zero_shards_the_optimizer_states_over_the_replicas(dp_runs):
    def state_bytes(record):
        return sum(t.numel() * t.element_size() for values in record["state"].values() for t in values.values())

    for rank in range(2):
        unsharded = dp_runs["dp"][rank]["steps"][-1]
        shares = [dp_runs["zero"][replica * 2 + rank]["steps"][-1] for replica in range(REPLICAS)]
        held = [set(share["state"]) for share in shares]
        assert held[0] | held[1] == set(unsharded["state"]) == set(unsharded["params"]) and not held[0] & held[1]
        for share in shares:  # whole tensors, about half of the stage's states each
            assert all(values["exp_avg"].shape == share["params"][key].shape for key, values in share["state"].items())
            assert 0.3 < state_bytes(share) / state_bytes(unsharded) < 0.7
        assert sum(map(state_bytes, shares)) == state_bytes(unsharded)


@pytest.mark.slow
def test_resume_with_replicas_and_zero_gives_the_same_losses(dp_runs):
    # ZeRO copies the decayed learning rate into each rank's share only when it steps: the
    # checkpoint must hold the decayed one, and resuming must give it back to ZeRO.
    for first, resumed, full in zip(dp_runs["zero_first"], dp_runs["zero_resumed"], dp_runs["zero"]):
        assert [s["loss"] for s in first["steps"]] == [s["loss"] for s in full["steps"][:2]]
        assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"][2:]]
        for mine, reference in zip(resumed["steps"], full["steps"][2:]):
            assert all(torch.equal(mine["params"][key], p) for key, p in reference["params"].items())
    # One directory; what the replicas hold twice (parameters) is written once.
    checkpoint = dp_runs["dir"] / "zero_ckpt" / "last.ckpt"
    metadata = FileSystemReader(checkpoint).read_metadata()
    written = sum(path.stat().st_size for path in checkpoint.glob("*.distcp"))
    assert written == sum(info.length for info in metadata.storage_data.values())
