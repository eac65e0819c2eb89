"""DGC in real 2-process DDP training (gloo on CPU, no mocks): what each rank sends, what it
keeps, the warm-up schedule, exact momentum SGD before it, convergence, and resuming from a
Lightning checkpoint with the residuals.

The hook records nothing itself: the witnesses are spies on `torch.distributed.all_gather` and
`all_reduce` (what each rank hands to the collectives), a wrapper around the hook (the gradient
bucket it is given) and the hook state's `state_dict()` after each step; the algorithm is checked
against a plain-PyTorch recomputation from those."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from tests.helpers.distributed import load_ranks, run_two_ranks
from plugins.ddp import build_ddp
from plugins.dgc import build_hook, replace_optimizer
from plugins.dgc_compression import message_bytes, sparsity_at, top_k
from plugins.dgc_state import DGCState
from runner.core.errors import ConfigError
from runner.models import MLPClassifier
from runner.strategies.dgc import DGCConfig

LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-3
# The exactness run: 3 dense steps, then the sparsity list walked over 6 steps, then 0.999.
BEGIN, RAMPUP, SPARSITY = 3, 6, [0.5, 0.9, 0.999]
STEPS, HALF = 16, 8  # 512 samples / 2 ranks / 64 per batch = 4 steps per epoch: HALF ends epoch 1

# One launch, four fits in the same 2 processes (each fit a new model, Trainer and hook state):
# "full" trains STEPS steps, observed; "first" trains HALF steps and checkpoints; "resumed"
# continues "first" from its checkpoint to STEPS; "converge" trains the synthetic task with DGC.
SCRIPT = """
import functools
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from tests.helpers.distributed import AllGatherSpy, AllReduceSpy, save
from plugins.ddp import FleetDDPStrategy
from plugins.dgc import DGCCheckpoint, build_hook, replace_optimizer
from runner.rank.resume import GlobalPosition
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier

OUT = Path(sys.argv[1])
torch.set_num_threads(1)
ALL_GATHER, ALL_REDUCE = AllGatherSpy(), AllReduceSpy()


class DGCMLP(MLPClassifier):
    # What the build step does: the model's own optimizer, replaced.
    def configure_optimizers(self):
        return replace_optimizer(super().configure_optimizers(), self)


class Recorder(pl.Callback):
    # Per step: the batch, the parameters before and after, the gradient the optimizer steps
    # with, the loss. Observing, also per bucket what the hook was given and handed to
    # all_gather (`observing`), the step's collective traffic, and the hook state after the step.
    def __init__(self, observe):
        self.observe, self.steps, self.restored = observe, [], None

    def on_train_start(self, trainer, pl_module):
        self.restored = trainer.strategy.comm_hook_state.state_dict()  # after DGCCheckpoint loaded one
        self.names = [name for name, _ in pl_module.named_parameters()]
        self.name_of = {id(p): name for name, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"batch": [t.clone() for t in batch], "buckets": [],
                           "before": [p.detach().clone() for p in pl_module.parameters()]})
        if self.observe:
            ALL_GATHER.reset()
            ALL_REDUCE.reset()
            ALL_GATHER.active = ALL_REDUCE.active = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = self.steps[-1]
        step["grad"] = [p.grad.detach().clone() for p in pl_module.parameters()]
        if self.observe:  # DDP has waited for every bucket's future: the state is the step's last
            ALL_GATHER.active = ALL_REDUCE.active = False
            step.update(all_gather_bytes=ALL_GATHER.bytes, all_reduce_bytes=ALL_REDUCE.bytes,
                        state=trainer.strategy.comm_hook_state.state_dict()["buffers"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(after=[p.detach().clone() for p in pl_module.parameters()],
                              loss=float(outputs["loss"]))

    def observing(self, build):
        # The hook factory `build`, its hook wrapped: per call, the bucket's parameter names, the
        # gradient it holds when DDP hands it over, and what the real hook gives all_gather.
        def build_observed():
            hook_state, hook = build()

            def observed_hook(state, bucket):
                entry = {"names": [self.name_of[id(p)] for p in bucket.parameters()],
                         "gradient": bucket.buffer().clone()}
                first = ALL_GATHER.calls
                future = hook(state, bucket)
                entry["gathered"] = ALL_GATHER.sent[first:]
                self.steps[-1]["buckets"].append(entry)
                return future

            return hook_state, observed_hook

        return build_observed


def run(name, max_steps, hook_knobs, num_train, observe=False, ckpt_path=None, checkpoint_dir=None):
    pl.seed_everything(0, verbose=False)
    model = DGCMLP(optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM,
                                               weight_decay=WEIGHT_DECAY))
    data = SyntheticClassificationData(num_train=num_train, batch_size=64)
    recorder = Recorder(observe)
    callbacks = [DGCCheckpoint(), recorder, GlobalPosition()]  # as lightfleet's runs have
    if checkpoint_dir:
        # Saved after the step (the way Lightning resumes an epoch-end checkpoint, it would run
        # only one batch of the next epoch, and the batches would not match the full run's).
        callbacks.append(ModelCheckpoint(dirpath=OUT / checkpoint_dir, every_n_train_steps=HALF, save_last=True))
    build = functools.partial(build_hook, **hook_knobs)
    # Small buckets: several per step, re-laid out by DDP after the first step.
    strategy = FleetDDPStrategy(comm_hook=recorder.observing(build) if observe else build, bucket_cap_mb=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks,
                         max_steps=max_steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=OUT)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    save(name, {"steps": recorder.steps, "names": recorder.names, "restored": recorder.restored,
                "final": trainer.strategy.comm_hook_state.state_dict()})


exact = dict(rampup_begin_step=BEGIN, rampup_step=RAMPUP, sparsity=SPARSITY)
run("full", STEPS, exact, num_train=512, observe=True)
run("first", HALF, exact, num_train=512, checkpoint_dir="ckpt")
run("resumed", STEPS, exact, num_train=512, ckpt_path=OUT / "ckpt" / "last.ckpt")
run("converge", CONVERGE_STEPS, dict(rampup_begin_step=0, rampup_step=10, sparsity=[0.75, 0.9, 0.99]),
    num_train=2048)
"""
CONVERGE_STEPS = 48
SCRIPT = "".join(f"{name} = {value!r}\n" for name, value in dict(
    LR=LR, MOMENTUM=MOMENTUM, WEIGHT_DECAY=WEIGHT_DECAY, BEGIN=BEGIN, RAMPUP=RAMPUP, SPARSITY=SPARSITY,
    STEPS=STEPS, HALF=HALF, CONVERGE_STEPS=CONVERGE_STEPS).items()) + SCRIPT


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"full" | "first" | "resumed" | "converge": [rank 0's record, rank 1's record]}."""
    tmp_path = tmp_path_factory.mktemp("dgc")
    run_two_ranks(SCRIPT, tmp_path, timeout=240)
    return {name: load_ranks(tmp_path, name) for name in ("full", "first", "resumed", "converge")}


def split(flat: torch.Tensor, bucket: dict, shapes: dict) -> dict:
    """A bucket-flat vector -> {parameter name: tensor}."""
    return dict(zip(bucket["names"], flat.split(sizes_of(bucket, shapes))))


def bucket_flat(per_name: dict, bucket: dict) -> torch.Tensor:
    """{parameter name: tensor} -> the bucket-flat vector (its parameters in bucket order)."""
    return torch.cat([per_name[name].reshape(-1) for name in bucket["names"]])


def sizes_of(bucket: dict, shapes: dict) -> list:
    return [math.prod(shapes[name]) for name in bucket["names"]]


def shapes_of(record: dict) -> dict:
    return {name: p.shape for name, p in zip(record["names"], record["steps"][0]["before"])}


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def sent_dense(bucket: dict) -> torch.Tensor:
    """What this rank handed to all_gather for the bucket (values, then indices), scattered into
    the bucket's layout: zero where nothing was sent."""
    values, indices = bucket["gathered"]
    return torch.zeros_like(bucket["gradient"]).index_add_(0, indices.long(), values)


def hook_state_before(record: dict, step: int, shapes: dict) -> tuple[dict, dict]:
    """(momentum, residual) by parameter name as the hook state held them when `step` began."""
    if step == 0:
        zeros = {name: torch.zeros(math.prod(shape)) for name, shape in shapes.items()}
        return zeros, zeros
    buffers = record["steps"][step - 1]["state"]
    return ({name: entry["momentum"] for name, entry in buffers.items()},
            {name: entry["residual"] for name, entry in buffers.items()})


# --------------------------------------------------------------------------- in-process


def test_schedule_is_fleets():
    # Paddle's get_period_sparcity: sparsity[min(len - 1, int((step - begin) * len / rampup_step))].
    assert [sparsity_at(s, 3, 6, [0.5, 0.9, 0.999]) for s in range(12)] == \
        [None] * 3 + [0.5, 0.5, 0.9, 0.9, 0.999, 0.999, 0.999, 0.999, 0.999]
    assert [sparsity_at(s, 0, 1, [0.999]) for s in range(3)] == [0.999] * 3  # Fleet's defaults
    assert [sparsity_at(s, 1, 4, [0.75, 0.9375, 0.984375, 0.996, 0.999]) for s in range(7)] == \
        [None, 0.75, 0.9375, 0.984375, 0.996, 0.999, 0.999]
    assert top_k(1000, 0.999) == 1 and top_k(1000, 0.5) == 500 and top_k(10, 0.999) == 1
    assert message_bytes([100_000], 0.999) == 100 * (4 + 4)  # float32 values + int32 indices
    assert message_bytes([4096, 64], 0.999) == (5 + 1) * 8  # per parameter, at least one each


def attached_model(optimizer_factory, **trainer_args) -> tuple[MLPClassifier, DGCState]:
    """A model attached to a Trainer whose strategy holds a DGC hook state, as in a run after DDP
    registered the hook (no process group is needed to replace the optimizer)."""
    model = MLPClassifier(optimizer=optimizer_factory)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=build_ddp(comm_hook=build_hook), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         **trainer_args)
    state, _ = build_hook(**asdict(DGCConfig()))
    trainer.strategy.comm_hook_state = state
    model.trainer = trainer
    return model, state


@pytest.mark.parametrize("factory, value", [
    (functools.partial(torch.optim.AdamW, lr=1e-3), "AdamW"),
    (functools.partial(torch.optim.SGD, lr=0.1), "SGD"),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True), "SGD(nesterov=True)"),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1), "SGD(dampening=0.1)"),
])
def test_refuses_other_optimizers(factory, value):
    model, _ = attached_model(factory)
    with pytest.raises(ConfigError) as error:
        replace_optimizer(model.configure_optimizers(), model)
    assert error.value.key == "model.optimizer" and error.value.value == value
    if value in ("AdamW", "SGD"):
        assert "dgc needs momentum SGD (torch.optim.SGD with momentum > 0)" in str(error.value)


def test_replacement_is_plain_sgd_and_state_takes_momentum_and_weight_decay():
    model, state = attached_model(None)
    params = list(model.parameters())
    original = torch.optim.SGD([{"params": params[:2], "weight_decay": 0.0, "lr": 0.05},
                                {"params": params[2:], "weight_decay": 1e-4}], lr=0.1, momentum=0.9)
    original.param_groups[1]["initial_lr"] = 0.1  # as an LR scheduler leaves it
    replaced = replace_optimizer(original, model)
    assert type(replaced) is torch.optim.SGD and replaced is not original
    assert [g["momentum"] for g in replaced.param_groups] == [0.0, 0.0]
    assert [g["weight_decay"] for g in replaced.param_groups] == [0.0, 0.0]
    assert [g["lr"] for g in replaced.param_groups] == [0.05, 0.1]
    assert replaced.param_groups[1]["initial_lr"] == 0.1
    assert [g["params"] for g in replaced.param_groups] == [g["params"] for g in original.param_groups]
    assert original.param_groups[0]["momentum"] == 0.9  # the user's optimizer is left alone
    assert state.momentum == 0.9
    assert state.weight_decay == {id(p): (0.0 if i < 2 else 1e-4) for i, p in enumerate(params)}
    assert set(state.names.values()) == {name for name, _ in model.named_parameters()}


def test_refuses_gradient_clipping():
    model, _ = attached_model(None, gradient_clip_val=1.0)
    with pytest.raises(ConfigError) as error:
        replace_optimizer(model.configure_optimizers(), model)
    assert error.value.key == "trainer.gradient_clip_val"


def test_refuses_without_the_hook():
    model = MLPClassifier()
    with pytest.raises(RuntimeError, match="no DGC communication hook"):
        replace_optimizer(model.configure_optimizers(), model)


# --------------------------------------------------------------------------- 2 processes


@pytest.mark.slow
def test_bytes_sent_at_sparsity_0999_are_under_one_percent_of_dense(runs):
    shapes = shapes_of(runs["full"][0])
    for rank in runs["full"]:
        dense = 4 * sum(p.numel() for p in rank["steps"][0]["before"])  # float32, all parameters
        compressed = [s for s in range(STEPS) if sparsity_at(s, BEGIN, RAMPUP, SPARSITY) == 0.999]
        assert len(compressed) >= 5
        for step, record in enumerate(rank["steps"]):
            buckets = record["buckets"]
            # what a dense allreduce would send: the gradient buffers DDP hands the hook
            assert sum(nbytes(bucket["gradient"]) for bucket in buckets) == dense
            # all this rank handed to all_gather in the step is the formula's messages
            sparsity = sparsity_at(step, BEGIN, RAMPUP, SPARSITY)
            assert record["all_gather_bytes"] == (0 if sparsity is None else sum(
                message_bytes(sizes_of(bucket, shapes), sparsity) for bucket in buckets))
            if step not in compressed:
                continue
            assert len(buckets) >= 2  # several buckets per step
            for bucket in buckets:
                values, indices = bucket["gathered"]
                # float32 values and int32 indices on the wire
                assert values.dtype == torch.float32 and indices.dtype == torch.int32
                sent = nbytes(values) + nbytes(indices)
                assert sent == values.numel() * 8
                assert sent == message_bytes(sizes_of(bucket, shapes), 0.999)
            assert record["all_gather_bytes"] <= 0.01 * dense, (step, record["all_gather_bytes"], dense)


def local_gradient(record: dict, step: int) -> dict:
    """Plain PyTorch: this rank's gradient at `step` (its batch, the parameters before the step),
    plus the weight decay term, by parameter name."""
    model = MLPClassifier()
    with torch.no_grad():
        for p, value in zip(model.parameters(), record["steps"][step]["before"], strict=True):
            p.copy_(value)
    F.cross_entropy(model(record["steps"][step]["batch"][0]), record["steps"][step]["batch"][1]).backward()
    return {name: (p.grad + WEIGHT_DECAY * p.detach()).reshape(-1) for name, p in model.named_parameters()}


@pytest.mark.slow
def test_sent_plus_residual_is_the_momentum_corrected_accumulated_gradient(runs):
    # Recomputed in plain PyTorch from the bucket the hook was given and the state before the
    # step, against what it handed to all_gather and the state after the step.
    shapes = shapes_of(runs["full"][0])
    for rank in runs["full"]:
        for step in range(STEPS):
            record = rank["steps"][step]
            buckets = record["buckets"]
            assert sorted(n for b in buckets for n in b["names"]) == sorted(shapes)  # every parameter, once
            if step < BEGIN:
                continue
            sparsity = sparsity_at(step, BEGIN, RAMPUP, SPARSITY)
            momentum, residual = hook_state_before(rank, step, shapes)
            after = record["state"]
            params = dict(zip(rank["names"], record["before"], strict=True))
            reference = local_gradient(rank, step)
            for bucket in buckets:
                # g: this rank's own gradient, weight decay folded in as the hook does (g + wd * p)
                grad = {name: g + WEIGHT_DECAY * params[name].reshape(-1)
                        for name, g in split(bucket["gradient"], bucket, shapes).items()}
                for name in bucket["names"]:
                    torch.testing.assert_close(grad[name], reference[name], rtol=1e-5, atol=1e-6)
                # u = m * u + g; v = v_residual + u, in the hook's order
                corrected = {name: momentum[name] * MOMENTUM + grad[name] for name in bucket["names"]}
                accumulated = bucket_flat({name: residual[name] + corrected[name] for name in bucket["names"]},
                                          bucket)
                residual_after = bucket_flat({n: after[n]["residual"] for n in bucket["names"]}, bucket)
                momentum_after = bucket_flat({n: after[n]["momentum"] for n in bucket["names"]}, bucket)
                indices = bucket["gathered"][1].long()
                sent = sent_dense(bucket)
                # exactly: what was sent and what stays add up to the accumulated gradient
                assert torch.equal(sent + residual_after, accumulated), (step, bucket["names"])
                assert torch.equal(sent[indices], accumulated[indices])
                assert not residual_after[indices].any()  # sent entries leave the residual
                assert not momentum_after[indices].any()  # momentum factor masking ...
                kept = torch.ones_like(accumulated, dtype=torch.bool).index_fill_(0, indices, False)
                assert torch.equal(momentum_after[kept], bucket_flat(corrected, bucket)[kept])  # ... and only there
                # per parameter, its k largest magnitudes are sent
                sent_of, residual_of = split(sent, bucket, shapes), split(residual_after, bucket, shapes)
                sent_mask = split(~kept, bucket, shapes)
                for name in bucket["names"]:
                    picked = sent_of[name][sent_mask[name]]
                    assert picked.numel() == top_k(math.prod(shapes[name]), sparsity)
                    assert picked.abs().min() >= residual_of[name].abs().max()


@pytest.mark.slow
def test_update_is_minus_lr_times_average_of_sent_parts(runs):
    shapes = shapes_of(runs["full"][0])
    names = runs["full"][0]["names"]
    for step in range(BEGIN, STEPS):
        average = {}
        per_rank = [rank["steps"][step]["buckets"] for rank in runs["full"]]
        for b0, b1 in zip(*per_rank, strict=True):
            assert b0["names"] == b1["names"]
            average.update(split((sent_dense(b0) + sent_dense(b1)) / 2, b0, shapes))
        for rank in runs["full"]:
            record = rank["steps"][step]
            for name, grad, before, after in zip(names, record["grad"], record["before"], record["after"]):
                torch.testing.assert_close(grad.reshape(-1), average[name], rtol=0, atol=1e-7)
                # plain SGD: no momentum, no weight decay left in the optimizer
                torch.testing.assert_close(after - before, -LR * grad, rtol=0, atol=1e-7)
    final = [rank["steps"][-1]["after"] for rank in runs["full"]]
    for p0, p1 in zip(*final):
        assert torch.equal(p0, p1)  # every rank applies the same update


@pytest.mark.slow
def test_before_rampup_the_update_is_dense_momentum_sgd(runs):
    ranks = runs["full"]
    model = MLPClassifier()
    with torch.no_grad():
        for p, value in zip(model.parameters(), ranks[0]["steps"][0]["before"], strict=True):
            p.copy_(value)
    reference = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    for step in range(BEGIN + 1):
        for rank in ranks:
            for p, recorded in zip(model.parameters(), rank["steps"][step]["before"], strict=True):
                torch.testing.assert_close(recorded, p.detach(), rtol=0, atol=2e-6)
        if step == BEGIN:
            break
        # The global batch's mean loss (both ranks' batches are the same size).
        loss = sum(F.cross_entropy(model(x), y) for x, y in (rank["steps"][step]["batch"] for rank in ranks)) / 2
        reference.zero_grad()
        loss.backward()
        reference.step()
    # Seen at the collectives: dense float32 all-reduces of every gradient and nothing gathered
    # before the ramp-up, no all-reduce after it; the residual stays empty until then.
    for rank in ranks:
        dense = 4 * sum(p.numel() for p in rank["steps"][0]["before"])
        for step, record in enumerate(rank["steps"]):
            assert record["all_reduce_bytes"] == (dense if step < BEGIN else 0), step
            if step < BEGIN:
                assert record["all_gather_bytes"] == 0, step
                assert not any(entry["residual"].any() for entry in record["state"].values())


@pytest.mark.slow
def test_warmup_walks_the_sparsity_list(runs):
    shapes = shapes_of(runs["full"][0])
    expected = [None] * BEGIN + [0.5, 0.5, 0.9, 0.9, 0.999, 0.999] + [0.999] * (STEPS - BEGIN - RAMPUP)

    def sent_at(bucket: dict, sparsity) -> int:  # ceil(numel * (1 - sparsity)) of each parameter
        if sparsity is None:
            return 0
        return sum(max(1, math.ceil(round(n * (1 - sparsity), 6))) for n in sizes_of(bucket, shapes))

    for rank in runs["full"]:
        seen = []
        for record in rank["steps"]:
            # the one sparsity of the list (or dense) that explains how many values every bucket sent
            sent = [bucket["gathered"][0].numel() if bucket["gathered"] else 0 for bucket in record["buckets"]]
            seen.append([s for s in [None, *SPARSITY]
                         if sent == [sent_at(bucket, s) for bucket in record["buckets"]]])
        assert seen == [[s] for s in expected]
        assert rank["final"]["step"] == STEPS


@pytest.mark.slow
def test_training_converges(runs):
    losses = [step["loss"] for step in runs["converge"][0]["steps"]]
    assert len(losses) == CONVERGE_STEPS
    start, end = sum(losses[:4]) / 4, sum(losses[-8:]) / 8
    assert end < 0.6 * start, (start, end, losses)


@pytest.mark.slow
def test_resume_restores_residuals_and_momentum(runs):
    for rank, (first, resumed, full) in enumerate(zip(runs["first"], runs["resumed"], runs["full"])):
        saved, restored = first["final"], resumed["restored"]
        assert restored["step"] == saved["step"] == HALF
        assert saved["buffers"].keys() == restored["buffers"].keys() == set(first["names"])
        for name, entry in saved["buffers"].items():
            assert entry["residual"].any() or name.endswith("bias")  # there is something to restore
            assert torch.equal(restored["buffers"][name]["residual"], entry["residual"]), name
            assert torch.equal(restored["buffers"][name]["momentum"], entry["momentum"]), name
        # the checkpoint kept each rank's own state: the ranks' residuals differ
        other = runs["first"][1 - rank]["final"]["buffers"]
        assert any(not torch.equal(other[n]["residual"], e["residual"]) for n, e in saved["buffers"].items())
        # and training on from it is the uninterrupted run, step for step
        assert len(resumed["steps"]) == STEPS - HALF
        for mine, reference in zip(resumed["steps"], full["steps"][HALF:], strict=True):
            # bitwise: the same batches, the same per-parameter selections (DDP's first, not yet
            # rebuilt, bucket layout after the restart does not matter)
            assert all(torch.equal(a, b) for a, b in zip(mine["after"], reference["after"], strict=True))
        for name, entry in full["final"]["buffers"].items():
            assert torch.equal(resumed["final"]["buffers"][name]["residual"], entry["residual"]), name
            assert torch.equal(resumed["final"]["buffers"][name]["momentum"], entry["momentum"]), name
