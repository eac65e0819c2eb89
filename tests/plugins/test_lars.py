"""plugins.lars: the foreach LARS against the formula written one tensor at a time, the
replacement of the user's momentum SGD, float16 overflow steps, and a real 2-process DDP run."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from plugins.amp import build_precision
from plugins.lars import LARS, replace_optimizer
from plugins.recompute import apply_recompute
from runner.data import SyntheticClassificationData
from runner.errors import ConfigError
from runner.models import MLPClassifier, ResNetClassifier

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-6, atol=1e-6)


class ReferenceLARS:
    """The LARS formula in plain Python, one tensor at a time, in float64; per-tensor hyper-
    parameters `lr[i]` and `wd[i]` (0 for excluded tensors)."""

    def __init__(self, params, lr, wd, momentum, lars_coeff, epsilon):
        self.params = [p.detach().double().clone() for p in params]
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.lr, self.wd = lr, wd
        self.momentum, self.lars_coeff, self.epsilon = momentum, lars_coeff, epsilon

    def step(self, grads):
        for i, (w, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            g = g.double()
            w_norm, g_norm = w.norm().item(), g.norm().item()
            if w_norm > 0 and g_norm > 0:
                local_lr = self.lr[i] * self.lars_coeff * w_norm / (g_norm + self.wd[i] * w_norm + self.epsilon)
            else:
                local_lr = self.lr[i]
            self.buffers[i] = self.momentum * self.buffers[i] + local_lr * (g + self.wd[i] * w)
            self.params[i] = w - self.buffers[i]


def real_grads(model, batch, zero=(), drop=()):
    """Backward of the model's loss on `batch`; then the gradients of parameters in `zero` are
    zeros and those in `drop` None (a frozen parameter). Returns the gradients, in order."""
    model.zero_grad(set_to_none=True)
    inputs, targets = batch
    F.cross_entropy(model(inputs), targets).backward()
    for p in zero:
        p.grad.zero_()
    for p in drop:
        p.grad = None
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_matches(optimizer, params, reference):
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach().double(), reference.params[i], **TOL)
        if optimizer.state[p]:
            torch.testing.assert_close(optimizer.state[p]["momentum_buffer"].double(), reference.buffers[i], **TOL)


# On the CPU the tensors are updated in chunks of about CPU_CHUNK_NUMEL elements: a small
# chunk size splits this model's lists too.
@pytest.mark.parametrize("chunk_numel", [None, 300], ids=["whole-lists", "chunked"])
def test_steps_match_the_formula_per_tensor(chunk_numel, monkeypatch):
    if chunk_numel is not None:
        monkeypatch.setattr("plugins.lars.CPU_CHUNK_NUMEL", chunk_numel)
    torch.manual_seed(0)
    model = MLPClassifier(input_dim=8, hidden_dim=16, num_blocks=2)
    params = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        model.head[1].bias.zero_()               # ||w|| = 0 at the first step: local_lr = lr
    zero_grad = [model.blocks[1].net[3].bias]    # ||g|| = 0 at every step: local_lr = lr
    frozen = [model.stem.bias]                   # no gradient: left alone, no state
    in_blocks = [name.startswith("blocks.") for name in names]
    no_decay = [name.endswith(".bias") for name, b in zip(names, in_blocks) if not b]
    optimizer = LARS([{"params": [p for p, b in zip(params, in_blocks) if b]},
                      {"params": [p for p, b in zip(params, in_blocks) if not b], "lr": 0.2,
                       "lars_weight_decay": 0.05, "no_weight_decay": no_decay}],
                     lr=0.5, momentum=0.9, lars_coeff=0.02, lars_weight_decay=0.01, epsilon=1e-4)
    reference = ReferenceLARS(params, lr=[0.5 if b else 0.2 for b in in_blocks],
                              wd=[0.01 if b else 0.0 if n.endswith(".bias") else 0.05
                                  for n, b in zip(names, in_blocks)],
                              momentum=0.9, lars_coeff=0.02, epsilon=1e-4)
    batch = (torch.randn(32, 8), torch.randint(4, (32,)))
    frozen_before = frozen[0].detach().clone()

    for _ in range(5):
        grads = real_grads(model, batch, zero=zero_grad, drop=frozen)
        optimizer.step()
        reference.step(grads)
        assert_matches(optimizer, params, reference)

    assert torch.equal(frozen[0], frozen_before) and not optimizer.state[frozen[0]]
    assert torch.count_nonzero(model.head[1].bias) > 0  # the zero weight did move


def test_excluded_names_get_no_weight_decay_also_inside_recomputed_blocks():
    torch.manual_seed(0)
    model = ResNetClassifier()
    apply_recompute(model, "cpu", checkpoints=[], enable_offload=False)
    names = [name for name, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in name for name in names)
    excluded = [("bias" in name or "bn" in name) for name in names]
    assert 0 < sum(excluded) < len(names)
    params = list(model.parameters())

    optimizer = replace_optimizer(torch.optim.SGD(params, lr=0.4, momentum=0.9), model=model, lars_coeff=0.02,
                                  lars_weight_decay=0.05, exclude_from_weight_decay=["bias", "bn"])
    assert optimizer.param_groups[0]["no_weight_decay"] == excluded
    reference = ReferenceLARS(params, lr=[0.4] * len(params), wd=[0.0 if e else 0.05 for e in excluded],
                              momentum=0.9, lars_coeff=0.02, epsilon=0.0)
    batch = (torch.randn(8, 3, 16, 16), torch.randint(4, (8,)))
    for _ in range(3):
        grads = real_grads(model, batch)
        optimizer.step()
        reference.step(grads)
        assert_matches(optimizer, params, reference)


# The scheduler wrapped the replaced optimizer's step to check the call order; the new one's is
# not wrapped, so torch warns once. Harmless: the order check is all it loses.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_replacement_keeps_groups_and_the_scheduler_follows():
    model = MLPClassifier()
    blocks = list(model.blocks.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    sgd = torch.optim.SGD([{"params": blocks, "lr": 0.05, "name": "blocks"}, {"params": rest, "momentum": 0.8}],
                          lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(sgd, [lambda epoch: 0.5 ** epoch, lambda epoch: 0.1 ** epoch])

    lars = replace_optimizer(sgd, model=model, lars_coeff=0.01, exclude_from_weight_decay=["bias"])
    assert len(lars.param_groups) == len(sgd.param_groups)
    for old, new in zip(sgd.param_groups, lars.param_groups):
        assert {k: v for k, v in new.items() if k in old} == old  # every key kept: lr, initial_lr, momentum, ...
        assert (new["lars_coeff"], new["lars_weight_decay"], new["epsilon"]) == (0.01, 0.0005, 0.0)
    assert [g["momentum"] for g in lars.param_groups] == [0.9, 0.8]
    assert lars.param_groups[0]["name"] == "blocks"

    scheduler.optimizer = lars
    real_grads(model, (torch.randn(16, 32), torch.randint(4, (16,))))
    lars.step()
    scheduler.step()
    assert [g["lr"] for g in lars.param_groups] == pytest.approx([0.025, 0.01])
    scheduler.step()
    assert [g["lr"] for g in lars.param_groups] == pytest.approx([0.0125, 0.001])


def test_wrong_base_optimizer_is_refused():
    model = MLPClassifier()
    allowed = r"lars needs momentum SGD \(torch\.optim\.SGD with momentum > 0\)"
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='Adam': {allowed}$"):
        replace_optimizer(torch.optim.Adam(model.parameters()), model=model)
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='SGD': {allowed}$"):
        replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(ConfigError, match="model.optimizer='SGD'"):  # one group without momentum is enough
        replace_optimizer(torch.optim.SGD([{"params": model.stem.parameters(), "momentum": 0.0},
                                           {"params": model.head.parameters()}], lr=0.1, momentum=0.9), model=model)


def test_state_dict_round_trips():
    torch.manual_seed(0)
    model = MLPClassifier()
    optimizer = replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model=model,
                                  lars_coeff=0.02, exclude_from_weight_decay=["bias"])
    batch = (torch.randn(16, 32), torch.randint(4, (16,)))
    for _ in range(2):
        real_grads(model, batch)
        optimizer.step()

    twin = copy.deepcopy(model)
    restored = LARS(twin.parameters(), lr=1.0, momentum=0.1, lars_coeff=1.0)  # overwritten by the load
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as from a checkpoint: no shared tensors
    assert restored.param_groups[0]["no_weight_decay"] == optimizer.param_groups[0]["no_weight_decay"]
    assert all("momentum_buffer" in restored.state[p] for p in twin.parameters())
    for m, opt in ((model, optimizer), (twin, restored)):
        real_grads(m, batch)
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(optimizer.state[a]["momentum_buffer"], restored.state[b]["momentum_buffer"], **TOL)


class LARSClassifier(MLPClassifier):
    """The built-in MLP with its default momentum SGD replaced, as build does."""

    def configure_optimizers(self):
        return replace_optimizer(super().configure_optimizers(), model=self, lars_coeff=0.05,
                                 exclude_from_weight_decay=["bias"])


class OverflowWatch(pl.Callback):
    """Writes inf into a gradient on `overflow_steps`; records per step whether the parameters
    and the optimizer state changed."""

    def __init__(self, overflow_steps: frozenset[int]) -> None:
        self.overflow_steps = overflow_steps
        self.params_changed: list[bool] = []
        self.state_changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.params = [p.detach().clone() for p in pl_module.parameters()]
        self.state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.overflow_steps:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params_changed.append(any(not torch.equal(a, p) for a, p in zip(self.params, pl_module.parameters())))
        state = trainer.optimizers[0].state_dict()["state"]
        same = state.keys() == self.state.keys() and all(
            s.keys() == self.state[i].keys() and all(torch.equal(s[k], self.state[i][k]) for k in s)
            for i, s in state.items())
        self.state_changed.append(not same)


def test_float16_overflow_steps_leave_params_and_state_untouched():
    overflow_steps = frozenset({0, 3})
    watch = OverflowWatch(overflow_steps)
    precision = build_precision("cpu", "float16", init_loss_scaling=2.0 ** 10, use_dynamic_loss_scaling=True,
                                incr_every_n_steps=100, decr_every_n_nan_or_inf=2, incr_ratio=2.0, decr_ratio=0.5)
    trainer = pl.Trainer(accelerator="cpu", plugins=[precision], max_steps=6, callbacks=[watch], limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(LARSClassifier(), SyntheticClassificationData())

    assert isinstance(trainer.optimizers[0], LARS)
    expected = [step not in overflow_steps for step in range(6)]
    assert watch.params_changed == expected
    assert watch.state_changed == expected


DDP_SCRIPT = '''
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from plugins.lars import replace_optimizer
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier


class Model(MLPClassifier):
    def __init__(self):
        super().__init__()  # its default optimizer: SGD(lr=0.1, momentum=0.9)
        self.losses = []

    def configure_optimizers(self):
        return replace_optimizer(super().configure_optimizers(), model=self, lars_coeff=0.05,
                                 exclude_from_weight_decay=["bias", "net.0"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


torch.set_num_threads(1)
pl.seed_everything(0, verbose=False)
model = Model()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=20, limit_val_batches=0, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, SyntheticClassificationData())
optimizer = trainer.optimizers[0]
torch.save({"optimizer": type(optimizer).__name__, "params": model.state_dict(),
            "state": optimizer.state_dict(), "losses": model.losses},
           Path(sys.argv[1]) / f"rank{trainer.global_rank}.pt")
'''


def test_two_process_ddp_trains_and_ranks_agree(tmp_path):
    script = tmp_path / "train_lars.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "SLURM_PROCID"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert [r["optimizer"] for r in ranks] == ["LARS", "LARS"]
    for rank in ranks:
        losses = rank["losses"]
        assert len(losses) == 20
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], **TOL)
    torch.testing.assert_close(ranks[0]["state"]["state"], ranks[1]["state"]["state"], **TOL)
    assert len(ranks[0]["state"]["state"]) == len(ranks[0]["params"])  # a momentum buffer for every parameter
