"""plugins.lamb: the foreach LAMB against the formula written one tensor at a time, the
replacement of the user's Adam/AdamW, float16 overflow steps, and a real 2-process DDP run."""
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
from plugins.lamb import LAMB, replace_optimizer
from plugins.recompute import apply_recompute
from runner.data import SyntheticClassificationData
from runner.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier, ResNetClassifier

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-6, atol=1e-6)


class ReferenceLAMB:
    """The LAMB formula in plain Python, one tensor at a time, in float64; per-tensor hyper-
    parameters `lr[i]` and `wd[i]` (0 for excluded tensors)."""

    def __init__(self, params, lr, wd, betas, eps):
        self.params = [p.detach().double().clone() for p in params]
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * len(self.params)
        self.lr, self.wd, self.betas, self.eps = lr, wd, betas, eps

    def step(self, grads):
        beta1, beta2 = self.betas
        for i, (w, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            g = g.double()
            self.steps[i] += 1
            t = self.steps[i]
            self.exp_avgs[i] = beta1 * self.exp_avgs[i] + (1 - beta1) * g
            self.exp_avg_sqs[i] = beta2 * self.exp_avg_sqs[i] + (1 - beta2) * g * g
            m_hat = self.exp_avgs[i] / (1 - beta1 ** t)
            v_hat = self.exp_avg_sqs[i] / (1 - beta2 ** t)
            r = m_hat / (v_hat.sqrt() + self.eps) + self.wd[i] * w
            w_norm, r_norm = w.norm().item(), r.norm().item()
            trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            self.params[i] = w - self.lr[i] * trust * r


def real_grads(model, batch, zero=(), drop=()):
    """Backward of the model's loss on `batch`; then the gradients of parameters in `zero` are
    zeros and those in `drop` None (a frozen parameter). Returns the gradients, in order."""
    model.zero_grad(set_to_none=True)
    inputs, targets = batch
    logits = model(inputs)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
    for p in zero:
        p.grad.zero_()
    for p in drop:
        p.grad = None
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_matches(optimizer, params, reference):
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach().double(), reference.params[i], **TOL)
        state = optimizer.state[p]
        if state:
            assert state["step"].item() == reference.steps[i]
            torch.testing.assert_close(state["exp_avg"].double(), reference.exp_avgs[i], **TOL)
            torch.testing.assert_close(state["exp_avg_sq"].double(), reference.exp_avg_sqs[i], **TOL)


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
    zero_weight = model.head[1].bias              # ||w|| = 0 at the first step: trust = 1
    zero_both = model.blocks[1].net[3].bias       # zero weight and gradient: ||r|| = 0, trust = 1, no nan
    zero_grad = model.blocks[0].net[3].weight     # ||g|| = 0 but ||w|| > 0: r = wd * w
    frozen = model.stem.bias                      # no gradient: left alone, no state
    with torch.no_grad():
        zero_weight.zero_()
        zero_both.zero_()
    in_blocks = [name.startswith("blocks.") for name in names]
    no_decay = [name.endswith(".bias") for name, b in zip(names, in_blocks) if not b]
    optimizer = LAMB([{"params": [p for p, b in zip(params, in_blocks) if b]},
                      {"params": [p for p, b in zip(params, in_blocks) if not b], "lr": 0.02,
                       "lamb_weight_decay": 0.1, "no_weight_decay": no_decay}],
                     lr=0.05, betas=(0.8, 0.99), eps=1e-6, lamb_weight_decay=0.01)
    reference = ReferenceLAMB(params, lr=[0.05 if b else 0.02 for b in in_blocks],
                              wd=[0.01 if b else 0.0 if n.endswith(".bias") else 0.1 for n, b in zip(names, in_blocks)],
                              betas=(0.8, 0.99), eps=1e-6)
    batch = (torch.randn(32, 8), torch.randint(4, (32,)))
    frozen_before = frozen.detach().clone()

    for _ in range(5):
        grads = real_grads(model, batch, zero=[zero_both, zero_grad], drop=[frozen])
        optimizer.step()
        reference.step(grads)
        assert_matches(optimizer, params, reference)

    assert torch.equal(frozen, frozen_before) and not optimizer.state[frozen]
    assert torch.count_nonzero(zero_weight) > 0                # the zero weight did move
    assert torch.count_nonzero(zero_both) == 0                 # nothing to move it, and no nan
    assert all(torch.isfinite(p).all() for p in params)


def test_excluded_names_get_no_weight_decay_also_inside_recomputed_blocks():
    torch.manual_seed(0)
    model = ResNetClassifier()
    apply_recompute(model, "cpu", checkpoints=[], enable_offload=False)
    names = [name for name, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in name for name in names)
    excluded = [("bias" in name or "bn" in name) for name in names]
    assert 0 < sum(excluded) < len(names)
    params = list(model.parameters())

    optimizer = replace_optimizer(torch.optim.Adam(params, lr=0.01, eps=1e-6), model=model, lamb_weight_decay=0.1,
                                  exclude_from_weight_decay=["bias", "bn"])
    assert optimizer.param_groups[0]["no_weight_decay"] == excluded
    reference = ReferenceLAMB(params, lr=[0.01] * len(params), wd=[0.0 if e else 0.1 for e in excluded],
                              betas=(0.9, 0.999), eps=1e-6)
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
    model = GPTDecoder()
    blocks = list(model.blocks.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    adamw = torch.optim.AdamW([{"params": blocks, "lr": 3e-3, "name": "blocks"}, {"params": rest, "betas": (0.8, 0.9)}],
                              lr=1e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, [lambda epoch: 0.5 ** epoch, lambda epoch: 0.1 ** epoch])

    lamb = replace_optimizer(adamw, model=model, lamb_weight_decay=0.02, exclude_from_weight_decay=["ln", "bias"])
    assert len(lamb.param_groups) == len(adamw.param_groups)
    for old, new in zip(adamw.param_groups, lamb.param_groups):
        assert {k: v for k, v in new.items() if k in old} == old  # every key kept: lr, initial_lr, betas, eps, ...
        assert new["lamb_weight_decay"] == 0.02
    assert [(g["betas"], g["eps"]) for g in lamb.param_groups] == [((0.9, 0.98), 1e-7), ((0.8, 0.9), 1e-7)]
    assert lamb.param_groups[0]["name"] == "blocks"
    names = [n for n, _ in model.named_parameters() if n.startswith("blocks.")]
    assert lamb.param_groups[0]["no_weight_decay"] == [".ln" in n or n.endswith("bias") for n in names]

    scheduler.optimizer = lamb
    tokens = torch.randint(64, (4, 33))
    real_grads(model, (tokens[:, :-1], tokens[:, 1:]))
    lamb.step()
    scheduler.step()
    assert [g["lr"] for g in lamb.param_groups] == pytest.approx([1.5e-3, 1e-4])
    scheduler.step()
    assert [g["lr"] for g in lamb.param_groups] == pytest.approx([7.5e-4, 1e-5])


def test_wrong_base_optimizer_is_refused():
    model = MLPClassifier()
    allowed = r"lamb needs an Adam-family optimizer \(torch\.optim\.Adam or torch\.optim\.AdamW\)"
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='SGD': {allowed}$"):
        replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='Adagrad': {allowed}$"):
        replace_optimizer(torch.optim.Adagrad(model.parameters()), model=model)
    assert isinstance(replace_optimizer(torch.optim.Adam(model.parameters()), model=model), LAMB)


def test_state_dict_round_trips():
    torch.manual_seed(0)
    model = MLPClassifier()
    optimizer = replace_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model=model,
                                  exclude_from_weight_decay=["bias"])
    batch = (torch.randn(16, 32), torch.randint(4, (16,)))
    for _ in range(2):
        real_grads(model, batch)
        optimizer.step()

    twin = copy.deepcopy(model)
    restored = LAMB(twin.parameters(), lr=1.0, betas=(0.5, 0.5))  # overwritten by the load
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as from a checkpoint: no shared tensors
    assert restored.param_groups[0]["no_weight_decay"] == optimizer.param_groups[0]["no_weight_decay"]
    assert all(restored.state[p]["step"].item() == 2 for p in twin.parameters())
    for m, opt in ((model, optimizer), (twin, restored)):
        real_grads(m, batch)
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, **TOL)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[a][key], restored.state[b][key], **TOL)


class LAMBClassifier(MLPClassifier):
    """The built-in MLP on AdamW, replaced by LAMB as build does."""

    def __init__(self) -> None:
        super().__init__(optimizer=lambda params: torch.optim.AdamW(params, lr=0.01))

    def configure_optimizers(self):
        return replace_optimizer(super().configure_optimizers(), model=self, exclude_from_weight_decay=["bias"])


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
    trainer.fit(LAMBClassifier(), SyntheticClassificationData())

    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, LAMB)
    expected = [step not in overflow_steps for step in range(6)]
    assert watch.params_changed == expected
    assert watch.state_changed == expected
    assert {state["step"].item() for state in optimizer.state.values()} == {4.0}  # 6 steps, 2 skipped


DDP_SCRIPT = '''
import functools
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from plugins.lamb import replace_optimizer
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier


class Model(MLPClassifier):
    def __init__(self):
        super().__init__(optimizer=functools.partial(torch.optim.AdamW, lr=0.01))
        self.losses = []

    def configure_optimizers(self):
        return replace_optimizer(super().configure_optimizers(), model=self,
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
    script = tmp_path / "train_lamb.py"
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
    assert [r["optimizer"] for r in ranks] == ["LAMB", "LAMB"]
    for rank in ranks:
        losses = rank["losses"]
        assert len(losses) == 20
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], **TOL)
    torch.testing.assert_close(ranks[0]["state"]["state"], ranks[1]["state"]["state"], **TOL)
    assert {s["step"].item() for s in ranks[0]["state"]["state"].values()} == {20.0}
