"""Sharding (ZeRO stages 1-3) in real 2-process training (gloo on CPU, no mocks): what each rank
holds, equality with plain DDP, offload, sharded checkpoints and their export, LAMB on sharded
parameters, accumulation, HSDP, and tensor parallelism through the runner. (The degree product is
checked before any process starts: tests/runner/test_plan.py and test_cli.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.commands import PROJECT_ROOT
from tests.helpers.distributed import load_ranks, run_two_ranks
from plugins.layerwise import NO_WEIGHT_DECAY
from plugins.sharding import shard_units
from runner.models import GPTDecoder, MLPClassifier
from tests.helpers.strategies import SEGMENT_MB

STEPS, HALF, LAMB_STEPS = 20, 8, 5
EXCLUDED = ["bias", "net.0"]  # LAMB's exclude_from_weight_decay: biases and the blocks' LayerNorms

# One launch, several fits in the same 2 processes (each a new model and Trainer). AdamW, fp32,
# 512 samples / 2 ranks / 64 per batch = 4 steps per epoch (HALF ends epoch 2: the resumed run
# starts a fresh epoch, as the uninterrupted one does).
SCRIPT = """
import functools
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import save
from plugins.amp import build_precision
from plugins.lamb import replace_optimizer
from runner.rank.resume import GlobalPosition
from plugins.transforms import transform_in_configure_model
from runner.rank.build import lightning_strategy, model_transforms
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier
from runner.config.collective import LIGHTFLEET_DDP
from runner.core.plan import make_plan
from runner.config.schema import TrainerConfig
from runner.strategies.sharding import ShardingConfig

OUT = Path(sys.argv[1])
torch.set_num_threads(1)
PROBE = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


def held(tensors):
    # Bytes of the distinct storages behind `tensors` (a DTensor: its local shard's).
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def local_optimizer(trainer):
    optimizer = trainer.optimizers[0]
    return getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own share


class Probe(pl.Callback):
    def __init__(self):
        self.losses, self.memory = [], []
        self.grads = None  # set at optimizer steps only (not on accumulation micro-steps)

    def on_before_backward(self, trainer, pl_module, loss):
        # After forward: the parameters gathered as full tensors (FSDP registers them in place of shards).
        self.gathered = held(p for p in pl_module.parameters() if not isinstance(p, DTensor))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = held(p.grad for p in pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        state = [t for s in local_optimizer(trainer).state.values() for t in s.values() if torch.is_tensor(t)]
        self.memory.append({"params": held(pl_module.parameters()), "gathered": self.gathered,
                            "grads": self.grads, "optimizer": held(state),
                            "optimizer_devices": sorted({t.device.type for t in state})})


class ReduceScatterCount:
    # Counts FSDP2's gradient reduce-scatters and notes the dtypes they reduce in (the real
    # collective runs): FSDP calls torch.distributed.reduce_scatter_single through the module attribute.

    def __init__(self):
        self.calls = 0
        self.dtypes = set()
        self._real = dist.reduce_scatter_single
        dist.reduce_scatter_single = self._count

    def _count(self, *args, **kwargs):
        self.calls += 1
        self.dtypes.update(str(arg.dtype) for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor))
        return self._real(*args, **kwargs)


REDUCE_SCATTERS = ReduceScatterCount()


def run(name, plan, max_steps=STEPS, lamb=False, ckpt_path=None, checkpoint_dir=None, precision=None,
        accumulate_grad_batches=1):
    # plan: the runner's plan for this many processes and these strategies (DDP when none).
    pl.seed_everything(0, verbose=False)
    model = MLPClassifier(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01))
    changed = []  # by each model transform: the FSDP units come last
    transform_in_configure_model(model, model_transforms(plan), changed.extend)
    if lamb:
        configure = model.configure_optimizers
        model.configure_optimizers = lambda: replace_optimizer(configure(), model, lamb_weight_decay=0.1,
                                                               exclude_from_weight_decay=EXCLUDED, always_adapt=False)
    probe = Probe()
    REDUCE_SCATTERS.calls, REDUCE_SCATTERS.dtypes = 0, set()
    callbacks = [probe, GlobalPosition()]  # as lightfleet's runs have
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=OUT / checkpoint_dir, filename="half", every_n_train_steps=HALF))
    dtypes = set()
    model.blocks[0].net[1].register_forward_hook(lambda module, args, output: dtypes.add(output.dtype))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_strategy(plan), callbacks=callbacks,
                         max_steps=max_steps,
                         limit_val_batches=0, logger=False, enable_checkpointing=bool(checkpoint_dir),
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT,
                         plugins=[precision] if precision else None, accumulate_grad_batches=accumulate_grad_batches)
    trainer.fit(model, SyntheticClassificationData(num_train=512, batch_size=64), ckpt_path=ckpt_path)
    optimizer = local_optimizer(trainer)
    names = {id(p): n for n, p in model.named_parameters()}
    record = {"losses": probe.losses, "memory": probe.memory, "reduce_scatters": REDUCE_SCATTERS.calls,
              "reduce_dtypes": sorted(REDUCE_SCATTERS.dtypes),
              "params": {n: full(p) for n, p in model.named_parameters()},
              "numel": sum(full(p).numel() for p in model.parameters()),
              "dtypes": sorted(map(str, dtypes)), "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "units": [unit.split("+") for unit in changed[-1]] if changed else None,
              "offload": [type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                          for m in model.modules() if hasattr(m, "_get_fsdp_state")
                          and m._get_fsdp_state()._fsdp_param_group is not None],
              "groups": [{"names": [names[id(p)] for p in g["params"]], "flags": g.get(NO_WEIGHT_DECAY)}
                         for g in optimizer.param_groups]}
    with torch.no_grad():  # last: at stage 2 the parameters stay gathered after a forward without backward
        record["outputs"] = model(PROBE)
    save(name, record)


def sharding(stage, degree=2, dp_degree=1, offload=False):
    knobs = ShardingConfig(stage=stage, degree=degree, dp_degree=dp_degree, optimize_offload=offload,
                           segment_broadcast_MB=SEGMENT_MB)
    return make_plan({"sharding": knobs}, TrainerConfig(devices=2), data_parallel=LIGHTFLEET_DDP)


DDP = make_plan({}, TrainerConfig(devices=2), data_parallel=LIGHTFLEET_DDP)
run("ddp", DDP)
run("stage1", sharding(1))
run("stage2", sharding(2))
run("stage3", sharding(3))
run("offload", sharding(3, offload=True))
run("hybrid", sharding(2, degree=1, dp_degree=2))
run("first2", sharding(2), max_steps=HALF, checkpoint_dir="ckpt2")
run("resumed2", sharding(2), ckpt_path=OUT / "ckpt2" / "half.ckpt")
run("first1", sharding(1), max_steps=HALF, checkpoint_dir="ckpt1")
run("resumed1", sharding(1), ckpt_path=OUT / "ckpt1" / "half.ckpt")
run("lamb_ddp", DDP, max_steps=LAMB_STEPS, lamb=True)
run("lamb_stage1", sharding(1), max_steps=LAMB_STEPS, lamb=True)
run("lamb_stage3", sharding(3), max_steps=LAMB_STEPS, lamb=True)
run("accumulate_ddp", DDP, max_steps=4, accumulate_grad_batches=2)
run("accumulate_stage3", sharding(3), max_steps=4, accumulate_grad_batches=2)
run("fp16_stage2", sharding(2), max_steps=4, precision=build_precision(
    "cpu", "float16", init_loss_scaling=1024.0, use_dynamic_loss_scaling=True, incr_every_n_steps=1000,
    decr_every_n_nan_or_inf=2, incr_ratio=2.0, decr_ratio=0.5))
"""
SCRIPT = "".join(f"{name} = {value!r}\n" for name, value in dict(
    STEPS=STEPS, HALF=HALF, LAMB_STEPS=LAMB_STEPS, SEGMENT_MB=SEGMENT_MB, EXCLUDED=EXCLUDED,
    NO_WEIGHT_DECAY=NO_WEIGHT_DECAY).items()) + SCRIPT
RUNS = ("ddp", "stage1", "stage2", "stage3", "offload", "hybrid", "first2", "resumed2", "first1", "resumed1",
        "lamb_ddp", "lamb_stage1", "lamb_stage3", "accumulate_ddp", "accumulate_stage3", "fp16_stage2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: [rank 0's record, rank 1's record]}, and the launch's directory under "dir"."""
    tmp_path = tmp_path_factory.mktemp("sharding")
    run_two_ranks(SCRIPT, tmp_path, timeout=300)
    return {"dir": tmp_path, **{name: load_ranks(tmp_path, name) for name in RUNS}}


# --------------------------------------------------------------------------- in-process


def test_units_group_consecutive_modules_up_to_the_segment_size():
    assert shard_units(MLPClassifier(), SEGMENT_MB * 2 ** 20) == [["stem", "blocks.0"], ["blocks.1", "blocks.2"],
                                                                  ["head"]]
    # A block larger than the segment is split into its children; parameter-free modules are skipped.
    gpt = GPTDecoder(d_model=64, n_layers=2)
    units = shard_units(gpt, 0.1 * 2 ** 20)  # a block: 200 KB, its attention 66 KB, its MLP 132 KB
    assert [name for unit in units for name in unit][:7] == [
        "token_embedding", "position_embedding", "blocks.0.ln1", "blocks.0.attn", "blocks.0.ln2", "blocks.0.mlp.0",
        "blocks.0.mlp.2"]
    assert sum(len(unit) for unit in units) == 2 + 2 * 5 + 2
    # The block list is cut into its blocks, which the forward calls, however large the segment.
    assert shard_units(gpt, 2 ** 30) == [["token_embedding", "position_embedding", "blocks.0", "blocks.1", "ln_f",
                                          "head"]]


def test_units_never_stop_at_a_module_whose_forward_the_model_skips():
    """A model that calls its library model's parts in a loop (as runner/models/causal_lm.py does):
    the wrapper holding the blocks is never a unit of its own, whose forward would never run."""

    class Library(torch.nn.Module):  # a library model's container, never called itself
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.library = Library()
            self.head = torch.nn.Linear(8, 4)

    assert shard_units(Model(), 2 ** 30) == [["library.embed", "library.layers.0", "library.layers.1",
                                              "library.layers.2", "head"]]


def test_a_tied_parameter_is_one_units():
    """FSDP2 shards a parameter in one unit only: a head tied to the token embedding joins the
    embedding's unit (torch refuses at the first forward a tied parameter that two units hold)."""
    gpt = GPTDecoder(d_model=64, n_layers=2)
    gpt.head.weight = gpt.token_embedding.weight
    units = shard_units(gpt, 0.1 * 2 ** 20)
    holding = [unit for unit in units if "token_embedding" in unit or "head" in unit]
    assert len(holding) == 1 and holding[0][-1] == "head"
    assert [name for unit in units for name in unit if name != "head"][-1] == "ln_f"


# --------------------------------------------------------------------------- 2 processes


@pytest.mark.slow
def test_per_rank_bytes_follow_the_zero_formulas(runs):
    """fp32 AdamW, P parameters, N = 2 ranks, bytes per rank (within 5%):

    stage 1: params 4P, grads 4P (views into DDP's buckets), optimizer state 8P/N (whole tensors
    given out greedily by size: a few percent off even);
    stage 2: params at rest (outside forward/backward, after the step) 4P/N; after forward the
    gathered parameters, 4P, stay until backward (reshard_after_forward=False); grads 4P/N
    (reduce-scattered); optimizer state 8P/N;
    stage 3: as stage 2, but after forward nothing stays gathered (every parameter is in a unit,
    the root holds none of its own). Every tensor of MLPClassifier splits evenly in 2: no padding.
    Adam's `step` scalars add 4 bytes per tensor (0.1%).
    """
    P, N = runs["ddp"][0]["numel"], 2
    expected = {"stage1": dict(params=4 * P, gathered=4 * P, grads=4 * P, optimizer=8 * P / N),
                "stage2": dict(params=4 * P / N, gathered=4 * P, grads=4 * P / N, optimizer=8 * P / N),
                "stage3": dict(params=4 * P / N, gathered=0, grads=4 * P / N, optimizer=8 * P / N)}
    for name, formulas in expected.items():
        for rank in runs[name]:
            for step in rank["memory"]:
                for kind, value in formulas.items():
                    assert step[kind] == pytest.approx(value, rel=0.05, abs=1), (name, kind, step[kind], value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage1", "stage2", "stage3", "offload", "hybrid"])
def test_losses_equal_plain_ddp(runs, name):
    for mine, ddp in zip(runs[name], runs["ddp"], strict=True):
        assert len(mine["losses"]) == STEPS
        assert mine["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
        for key, value in ddp["params"].items():
            torch.testing.assert_close(mine["params"][key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_units_and_hybrid_layout(runs):
    assert runs["stage2"][0]["units"] == [["stem", "blocks.0"], ["blocks.1", "blocks.2"], ["head"]]
    # dp_degree=2, degree=1: parameters replicated, not sharded; both ranks hold everything.
    P = runs["ddp"][0]["numel"]
    assert all(step["params"] == 4 * P for rank in runs["hybrid"] for step in rank["memory"])


@pytest.mark.slow
def test_offload_policy_keeps_optimizer_state_in_host_memory(runs):
    for rank in runs["offload"]:
        assert set(rank["offload"]) == {"CPUOffloadPolicy"}  # every unit and the root
        assert all(step["optimizer_devices"] == ["cpu"] for step in rank["memory"])
    assert all(set(rank["offload"]) == {"OffloadPolicy"} for rank in runs["stage3"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_resumes_to_the_uninterrupted_run_and_exports_to_one_file(runs, stage):
    for first, resumed, full in zip(runs[f"first{stage}"], runs[f"resumed{stage}"], runs[f"stage{stage}"]):
        assert first["losses"] == full["losses"][:HALF]
        assert resumed["losses"] == pytest.approx(full["losses"][HALF:], abs=1e-6)
        for key, value in full["params"].items():
            torch.testing.assert_close(resumed["params"][key], value, rtol=1e-6, atol=1e-6)

    checkpoint = runs["dir"] / f"ckpt{stage}" / "half.ckpt"
    assert checkpoint.is_dir() == (stage == 2)  # stage 2/3: one shard file per rank; stage 1: one file
    out = runs["dir"] / f"exported{stage}.pt"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run([sys.executable, "-m", "plugins.sharding", "export", str(checkpoint), str(out)],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Plain tensors and containers only: loadable by torch alone, into the plain model.
    exported = torch.load(out, weights_only=True)
    model = MLPClassifier()
    assert list(exported["state_dict"]) == list(model.state_dict())
    model.load_state_dict(exported["state_dict"], strict=True)
    assert exported["global_step"] == HALF and len(exported["optimizer_states"]) == 1
    with torch.no_grad():
        outputs = model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(outputs, runs[f"first{stage}"][0]["outputs"], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lamb_stage1", "lamb_stage3"])
def test_lamb_on_sharded_parameters_uses_full_tensor_norms(runs, name):
    for mine, ddp in zip(runs[name], runs["lamb_ddp"], strict=True):
        for key, value in ddp["params"].items():
            torch.testing.assert_close(mine["params"][key], value, rtol=1e-5, atol=1e-5)
        # Weight-decay exclusion: each (local) group's flags still name the excluded parameters.
        groups = mine["groups"]
        held = [n for group in groups for n in group["names"]]
        if name == "lamb_stage3":  # FSDP: every rank's optimizer steps (its shards of) every parameter
            assert sorted(held) == sorted(ddp["params"])
        else:  # ZeRO stage 1: each rank's optimizer steps a share of the parameters, each once
            assert held and len(set(held)) == len(held) and set(held) < set(ddp["params"]), held
        for group in groups:
            assert group["flags"] == [any(pattern in n for pattern in EXCLUDED) for n in group["names"]]
    # ZeRO gives each rank its own whole tensors: the shares are disjoint and together every parameter once.
    if name == "lamb_stage1":
        shares = [{n for g in rank["groups"] for n in g["names"]} for rank in runs[name]]
        assert not shares[0] & shares[1], shares[0] & shares[1]
        names = [n for rank in runs[name] for g in rank["groups"] for n in g["names"]]
        assert sorted(names) == sorted(runs["lamb_ddp"][0]["params"])


@pytest.mark.slow
def test_gradient_accumulation_reduces_once_per_step_and_equals_ddp(runs):
    # block_backward_sync turns FSDP's gradient sync off on the first micro-step of each pair:
    # 4 optimizer steps of 2 micro-batches reduce-scatter as often per step as 20 plain steps.
    per_step = runs["stage3"][0]["reduce_scatters"] / STEPS
    assert per_step >= 1
    for mine, ddp in zip(runs["accumulate_stage3"], runs["accumulate_ddp"], strict=True):
        assert mine["reduce_scatters"] == 4 * per_step
        assert len(mine["losses"]) == 8  # micro-batches: 4 optimizer steps x 2
        for key, value in ddp["params"].items():
            torch.testing.assert_close(mine["params"][key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_float16_amp_gathers_half_parameters_keeps_float32_shards_and_reduces_in_float32(runs):
    for rank in runs["fp16_stage2"]:
        assert rank["dtypes"] == ["torch.float16"]
        assert rank["param_dtypes"] == ["torch.float32"]
        assert rank["reduce_dtypes"] == ["torch.float32"]  # float16 sums of gradients would lose precision
        assert all(torch.isfinite(torch.tensor(rank["losses"])))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_keeps_optimizer_state_on_the_host_while_computing_on_cuda(tmp_path):
    import pytorch_lightning as pl

    from plugins.transforms import transform_in_configure_model
    from runner.rank.build import lightning_strategy, model_transforms
    from runner.data import SyntheticClassificationData
    from runner.core.plan import make_plan
    from runner.config.schema import TrainerConfig
    from runner.strategies.sharding import ShardingConfig

    seen = {}

    class Check(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen["loss"] = loss.device.type

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state = trainer.optimizers[0].state.values()
            seen["state"] = {t.device.type for s in state for t in s.values() if torch.is_tensor(t) and t.dim()}
            seen["params"] = {p.device.type for p in pl_module.parameters()}

    plan = make_plan({"sharding": ShardingConfig(stage=3, optimize_offload=True, segment_broadcast_MB=SEGMENT_MB)},
                     TrainerConfig(devices=1))
    model = MLPClassifier(optimizer=torch.optim.AdamW)
    transform_in_configure_model(model, model_transforms(plan))
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=lightning_strategy(plan), callbacks=[Check()],
                         max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, SyntheticClassificationData())
    assert seen == {"loss": "cuda", "state": {"cpu"}, "params": {"cpu"}}


@pytest.mark.slow
def test_tensor_parallel_gpt_under_stage_2_trains_like_one_process(lightfleet, tmp_path):
    """mp_degree=2 through the whole runner (plan, launcher, Lightning, FSDP2 over a 1-rank shard
    group): the 2 ranks split every block and read the same batches, so the losses are those of
    one process training the whole model with the same strategy. Plain SGD: Adam would turn the rounding noise in the
    key bias's (exactly zero) gradient into full steps that differ between the runs."""
    common = ["model=gpt", "data=language_model", "model/optimizer=sgd", "model.optimizer.momentum=0",  # as gpt's AdamW's
              "model.optimizer.lr=3e-3", "model.optimizer.weight_decay=0.01",
              "trainer.use_distributed_sampler=false", "trainer.max_steps=8", "trainer.log_every_n_steps=1",
              "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.limit_val_batches=0"]
    split = lightfleet("strategy=[sharding]", "strategy.sharding.stage=2", "strategy.sharding.mp_degree=2",
                       "trainer.devices=2", "paths.output_dir=split", *common)
    assert split.returncode == 0, split.stderr[-3000:]
    # The same strategy in one process: Lightning's model-parallel setup re-seeds the RNG, which
    # decides the data order, so a run without it would read other batches.
    whole = lightfleet("strategy=[sharding]", "strategy.sharding.stage=2", "paths.output_dir=whole", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]

    def losses(run: str) -> list:
        rows = (tmp_path / run / "csv" / "metrics.csv").read_text().splitlines()
        column = rows[0].split(",").index("train_loss")
        return [float(row.split(",")[column]) for row in rows[1:] if row.split(",")[column]]

    assert len(losses("split")) == 8
    assert losses("split") == pytest.approx(losses("whole"), abs=1e-5)
