"""Shared checks for the layer-wise adaptive optimizers (tests/plugins/test_lars.py, test_lamb.py).

- `PerTensorReference`: base of the formulas written one tensor at a time in float64;
  `step_both` steps an optimizer and its reference on real gradients (`real_grads`) and
  `assert_matches` compares parameters and state after every step.
- Setups: `two_group_mlp` (a small MLP in two param groups; `CHUNK_SIZES` runs a test with
  whole lists and with CPU chunks), `recomputed_resnet` (names with recompute's wrapper segment).
- Replacement: `blocks_and_rest`, `assert_groups_kept`, `two_group_scheduler` and
  `assert_scheduler_follows`; `assert_state_dict_round_trips`.
- Paddle as the reference: `steps_equal_paddles` runs the same steps through Paddle 3.3.1's own
  optimizer (tests/paddle/optimizers.py, in a subprocess) and through ours.
- Training: `ReplacedOptimizerMLP` (the built-in MLP whose optimizer is replaced, as build does),
  `fit_float16_with_overflows` (skipped steps leave parameters and state untouched), and
  `run_ddp_fit` with its rank side `fit_ddp_rank` (2 processes: both train, and agree).

The 2-process runs import it as the tests do, `tests.helpers.optimizer_checks`.
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from tests.helpers.distributed import WORLD_SIZE, run_two_ranks
from tests.helpers.paddle_reference import run_paddle
from plugins.amp import build_precision
from plugins.recompute import apply_recompute
from plugins.transforms import ModelContext
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier, ResNetClassifier

TOL = dict(rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- formulas per tensor


class PerTensorReference:
    """An optimizer's formula in plain Python, one tensor at a time, in float64. Subclasses
    implement `update(i, w, g) -> new w` (keeping their own state for tensor i) and
    `state(i) -> {key: expected value of the optimizer's state[key]}`."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = [p.detach().double().clone() for p in params]

    def step(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.params[i] = self.update(i, self.params[i], g.double())

    def update(self, i: int, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state(self, i: int) -> Dict[str, Any]:
        raise NotImplementedError


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


def assert_matches(optimizer, params, reference: PerTensorReference) -> None:
    """Every parameter, and the state of every parameter that has one, as the reference has it."""
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach().double(), reference.params[i], **TOL)
        state = optimizer.state[p]
        if state:
            for key, expected in reference.state(i).items():
                torch.testing.assert_close(state[key].double(), torch.as_tensor(expected, dtype=torch.float64), **TOL)


def step_both(model, optimizer, reference: PerTensorReference, batch, steps: int, zero=(), drop=()) -> None:
    """`steps` times: real gradients (see `real_grads`), a step of each, `assert_matches`."""
    params = list(model.parameters())
    for _ in range(steps):
        grads = real_grads(model, batch, zero=zero, drop=drop)
        optimizer.step()
        reference.step(grads)
        assert_matches(optimizer, params, reference)


# --------------------------------------------------------------------------- setups


# On the CPU the tensors are updated in chunks of about CPU_CHUNK_NUMEL elements: a small
# chunk size splits the lists of `two_group_mlp`'s model too.
CHUNK_SIZES = pytest.mark.parametrize("chunk_numel", [None, 300], ids=["whole-lists", "chunked"])


@dataclass
class TwoGroups:
    model: MLPClassifier
    params: List[torch.nn.Parameter]
    groups: List[Dict[str, Any]]  # param groups for the optimizer
    lrs: List[float]              # per parameter: its group's lr
    weight_decays: List[float]    # per parameter: its group's weight decay, 0.0 where excluded
    batch: Tuple[torch.Tensor, torch.Tensor]


def two_group_mlp(monkeypatch, chunk_numel: Optional[int], lrs: Tuple[float, float],
                  weight_decays: Tuple[float, float], weight_decay_key: str) -> TwoGroups:
    """A small seeded MLP and a batch for it, with the CPU chunk size `chunk_numel` (None: as
    is). Its parameters under `blocks.` form the first group, which takes the optimizer's
    defaults (give it lrs[0] and weight_decays[0]); the rest the second, with lr lrs[1],
    `weight_decay_key` weight_decays[1] and no weight decay for its biases."""
    if chunk_numel is not None:
        monkeypatch.setattr("plugins.layerwise.CPU_CHUNK_NUMEL", chunk_numel)
    torch.manual_seed(0)
    model = MLPClassifier(input_dim=8, hidden_dim=16, num_blocks=2)
    batch = (torch.randn(32, 8), torch.randint(4, (32,)))
    params = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    in_blocks = [name.startswith("blocks.") for name in names]
    no_decay = [name.endswith(".bias") for name, b in zip(names, in_blocks) if not b]
    groups = [{"params": [p for p, b in zip(params, in_blocks) if b]},
              {"params": [p for p, b in zip(params, in_blocks) if not b], "lr": lrs[1],
               weight_decay_key: weight_decays[1], "no_weight_decay": no_decay}]
    return TwoGroups(model, params, groups, lrs=[lrs[0] if b else lrs[1] for b in in_blocks],
                     weight_decays=[weight_decays[0] if b else 0.0 if n.endswith(".bias") else weight_decays[1]
                                    for n, b in zip(names, in_blocks)],
                     batch=batch)


def recomputed_resnet():
    """A seeded ResNetClassifier with every block recomputed (its names carry a
    `_checkpoint_wrapped_module.` segment), its parameters, which of them have "bias" or "bn"
    in their name (some, not all), and a batch for it."""
    torch.manual_seed(0)
    model = ResNetClassifier()
    apply_recompute(model, ModelContext(model), checkpoints=[], enable_offload=False)
    names = [name for name, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in name for name in names)
    excluded = [("bias" in name or "bn" in name) for name in names]
    assert 0 < sum(excluded) < len(names)
    batch = (torch.randn(8, 3, 16, 16), torch.randint(4, (8,)))
    return model, list(model.parameters()), excluded, batch


# --------------------------------------------------------------------------- replacement


# The scheduler wrapped the replaced optimizer's step to check the call order; the new one's is
# not wrapped, so torch warns once. Harmless: the order check is all it loses.
IGNORE_UNWRAPPED_STEP = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def blocks_and_rest(model) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """The model's parameters under `blocks.`, and the others."""
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return list(model.blocks.parameters()), rest


def two_group_scheduler(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """lr * 0.5 ** epoch for the first group, lr * 0.1 ** epoch for the second."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda epoch: 0.5 ** epoch, lambda epoch: 0.1 ** epoch])


def assert_groups_kept(old, new) -> None:
    assert len(new.param_groups) == len(old.param_groups)
    for old_group, new_group in zip(old.param_groups, new.param_groups):
        # every key kept: lr, initial_lr, momentum or betas, eps, ...
        assert {k: v for k, v in new_group.items() if k in old_group} == old_group


def assert_scheduler_follows(scheduler, optimizer, model, batch, expected_lrs: Sequence[Sequence[float]]) -> None:
    """Point `scheduler` at `optimizer`, take a step, then per scheduler step the groups' lrs."""
    scheduler.optimizer = optimizer
    real_grads(model, batch)
    optimizer.step()
    for lrs in expected_lrs:
        scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(lrs)


def assert_state_dict_round_trips(replaced: Callable[[MLPClassifier], torch.optim.Optimizer],
                                  blank: Callable[[Any], torch.optim.Optimizer],
                                  loaded: Callable[[Dict[str, Any]], bool]) -> None:
    """Two steps of `replaced(model)` on a seeded MLP; `blank(twin's params)` loads its state
    dict, deep-copied as from a checkpoint (`loaded(state)` holds for each parameter's state);
    one more step of each leaves both with the same parameters and state."""
    torch.manual_seed(0)
    model = MLPClassifier()
    optimizer = replaced(model)
    batch = (torch.randn(16, 32), torch.randint(4, (16,)))
    for _ in range(2):
        real_grads(model, batch)
        optimizer.step()

    twin = copy.deepcopy(model)
    restored = blank(twin.parameters())  # its hyper-parameters are overwritten by the load
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # no shared tensors
    assert restored.param_groups[0]["no_weight_decay"] == optimizer.param_groups[0]["no_weight_decay"]
    assert all(loaded(restored.state[p]) for p in twin.parameters())
    for m, opt in ((model, optimizer), (twin, restored)):
        real_grads(m, batch)
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, **TOL)
        for key in optimizer.state[a]:
            torch.testing.assert_close(optimizer.state[a][key], restored.state[b][key], **TOL)


# --------------------------------------------------------------------------- training


class ReplacedOptimizerMLP(MLPClassifier):
    """The built-in MLP on `optimizer` (default: its momentum SGD), replaced by
    `replace(optimizer, model=self, **knobs)` as build does; records its training losses."""

    def __init__(self, replace: Callable[..., torch.optim.Optimizer], optimizer=None, **knobs: Any) -> None:
        super().__init__(optimizer=optimizer)
        self.replace = replace
        self.knobs = knobs
        self.losses: List[float] = []

    def configure_optimizers(self):
        return self.replace(super().configure_optimizers(), model=self, **self.knobs)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


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


def fit_float16_with_overflows(model: pl.LightningModule) -> torch.optim.Optimizer:
    """6 steps of `model` in float16 with dynamic loss scaling, an inf gradient at steps 0 and
    3: those two, and only those, leave the parameters and the optimizer state untouched.
    Returns the trainer's optimizer."""
    overflow_steps = frozenset({0, 3})
    watch = OverflowWatch(overflow_steps)
    precision = build_precision("cpu", "float16", init_loss_scaling=2.0 ** 10, use_dynamic_loss_scaling=True,
                                incr_every_n_steps=100, decr_every_n_nan_or_inf=2, incr_ratio=2.0, decr_ratio=0.5)
    trainer = pl.Trainer(accelerator="cpu", plugins=[precision], max_steps=6, callbacks=[watch], limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, SyntheticClassificationData())

    expected = [step not in overflow_steps for step in range(6)]
    assert watch.params_changed == expected
    assert watch.state_changed == expected
    return trainer.optimizers[0]


def fit_ddp_rank(replace: Callable[..., torch.optim.Optimizer], optimizer=None, **knobs: Any) -> None:
    """Rank side of `run_ddp_fit`: 20 steps of `ReplacedOptimizerMLP(replace, optimizer,
    **knobs)` under Lightning's "ddp" on 2 CPU processes; saves the optimizer's class name,
    the parameters, the optimizer state and the losses to rank{N}.pt in sys.argv[1]."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = ReplacedOptimizerMLP(replace, optimizer, **knobs)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=20, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, SyntheticClassificationData())
    replaced = trainer.optimizers[0]
    torch.save({"optimizer": type(replaced).__name__, "params": model.state_dict(),
                "state": replaced.state_dict(), "losses": model.losses},
               Path(sys.argv[1]) / f"rank{trainer.global_rank}.pt")


def run_ddp_fit(script: str, tmp_path: Path) -> List[Dict[str, Any]]:
    """Run `script` (it calls `fit_ddp_rank`) in 2 processes; assert that each rank's loss fell
    and that the ranks end with the same parameters and optimizer state; return what they saved."""
    run_two_ranks(script, tmp_path, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    for rank in ranks:
        losses = rank["losses"]
        assert len(losses) == 20
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], **TOL)
    torch.testing.assert_close(ranks[0]["state"]["state"], ranks[1]["state"]["state"], **TOL)
    return ranks


# --------------------------------------------------------------------------- Paddle as the reference

# Three tensors, one step of gradients each: a layer's weight and bias, and a weight whose
# gradient is zero (||g|| = 0: the layer-wise rate must fall back, as Paddle's kernels do).
PADDLE_SHAPES = {"layer.weight": (6, 5), "layer.bias": (5,), "still.weight": (3, 4)}


def steps_equal_paddles(tmp_path: Path, optimizer: str, dtype: str, knobs: Dict[str, Any],
                        ours: Callable[[List[Dict[str, Any]]], torch.optim.Optimizer], steps: int = 5) -> None:
    """Run `steps` steps of Paddle's `optimizer` (lamb or lars, with Paddle's `knobs` and
    `excluded`, the name substrings without weight decay) and of `ours(groups)` on the same
    parameters and gradients, and compare the parameters: to float64 rounding in float64, to
    float32's in float32. The hyper-parameters should be exact in float32 (Paddle's attributes are)."""
    rng = np.random.default_rng(0)
    init = {name: rng.standard_normal(shape).astype(dtype) for name, shape in PADDLE_SHAPES.items()}
    grads = [{name: (rng.standard_normal(shape) if name != "still.weight" else np.zeros(shape)).astype(dtype)
              for name, shape in PADDLE_SHAPES.items()} for _ in range(steps)]
    case = tmp_path / "case.npz"
    np.savez(case, optimizer=optimizer, dtype=dtype, knobs=json.dumps(knobs),
             **{f"init/{name}": value for name, value in init.items()},
             **{f"grad/{step}/{name}": value for step, grad in enumerate(grads) for name, value in grad.items()})
    run_paddle("optimizers", str(case), str(tmp_path / "paddle.npz"))
    expected = np.load(tmp_path / "paddle.npz")
    params = {name: torch.nn.Parameter(torch.from_numpy(value.copy())) for name, value in init.items()}
    excluded = [any(pattern in name for pattern in knobs["excluded"]) for name in params]
    mine = ours([{"params": list(params.values()), "no_weight_decay": excluded}])
    for grad in grads:
        for name, param in params.items():
            param.grad = torch.from_numpy(grad[name].copy())
        mine.step()
    tolerance = dict(rtol=1e-13, atol=1e-15) if dtype == "float64" else dict(rtol=2e-6, atol=1e-7)
    for name, param in params.items():
        torch.testing.assert_close(param.detach(), torch.from_numpy(expected[name]), **tolerance, msg=name)
