"""plugins.amp: Fleet loss scaling, float16/bfloat16 training and white/black lists, with real
Lightning training on CPU (overflows are injected by writing inf into a gradient); loss scaling
and the lists' overlap check side by side with Paddle 3.3.1's (tests/paddle/loss_scaling.py)."""
from __future__ import annotations

import copy
import json
import math
import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from tests.helpers.paddle_reference import run_paddle
from plugins.amp import FleetGradScaler, apply_precision_lists, build_precision
from plugins.transforms import ModelContext
from runner.data import SyntheticClassificationData
from runner.core.errors import ConfigError
from runner.models import MLPClassifier
from runner.strategies.amp import AmpConfig

INF = float("inf")


def fleet_scales(init: float, overflow_steps: frozenset[int], num_steps: int, incr_every_n_steps: int,
                 decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float) -> list[float]:
    """Reference: the scale after each step by Paddle's update_loss_scaling rule, in plain Python."""
    scale, good, bad, scales = init, 0, 0, []
    for step in range(num_steps):
        if step in overflow_steps:
            good, bad = 0, bad + 1
            if bad == decr_every_n_nan_or_inf:
                scale, bad = max(scale * decr_ratio, 1.0), 0
        else:
            good, bad = good + 1, 0
            if good == incr_every_n_steps:
                grown = scale * incr_ratio
                scale, good = (grown if grown != INF else scale), 0
        scales.append(scale)
    return scales


class Recorder(pl.Callback):
    """Writes inf into a gradient on `overflow_steps`; records per step the scale after the
    update, whether the parameters changed, and the loss."""

    def __init__(self, overflow_steps: frozenset[int] = frozenset()) -> None:
        self.overflow_steps = overflow_steps
        self.before: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.updated: list[bool] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.overflow_steps:
            next(pl_module.parameters()).grad.view(-1)[0] = INF

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else None)
        self.updated.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))
        self.losses.append(outputs["loss"].item())


def fit(precision, max_steps: int, callbacks=(), model=None, ckpt_path=None) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", plugins=[precision], max_steps=max_steps, callbacks=list(callbacks),
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model or MLPClassifier(), SyntheticClassificationData(), ckpt_path=ckpt_path)
    return trainer


def loss_scaling(**changes: Any) -> dict[str, Any]:
    """FleetGradScaler's knobs, which are Fleet's amp_configs keys: these defaults with `changes`."""
    return {"init_loss_scaling": 2.0, "use_dynamic_loss_scaling": True, "incr_every_n_steps": 3,
            "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.5, **changes}


def fp16(init_loss_scaling: float = 2.0, use_dynamic_loss_scaling: bool = True, incr_every_n_steps: int = 3):
    return build_precision("cpu", "float16", **loss_scaling(init_loss_scaling=init_loss_scaling,
                                                            use_dynamic_loss_scaling=use_dynamic_loss_scaling,
                                                            incr_every_n_steps=incr_every_n_steps))


def test_dynamic_scale_follows_fleet_rule_and_skips_overflow_steps():
    # Growth after 3 good steps, back-off after 2 consecutive overflows, a lone overflow
    # that only resets the good-step count, and back-off floored at 1.
    overflow_steps = frozenset({3, 4, 7, 9, 10, 11, 12})
    recorder = Recorder(overflow_steps)
    fit(fp16(init_loss_scaling=2.0), max_steps=14, callbacks=[recorder])

    expected = fleet_scales(2.0, overflow_steps, 14, incr_every_n_steps=3, decr_every_n_nan_or_inf=2,
                            incr_ratio=2.0, decr_ratio=0.5)
    assert expected == [2, 2, 4, 4, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1]  # the reference itself, spelled out
    assert recorder.scales == expected
    assert recorder.updated == [step not in overflow_steps for step in range(14)]


def test_growth_that_would_overflow_keeps_the_scale():
    scaler = FleetGradScaler("cpu", 2.0 ** 127, True, incr_every_n_steps=1, decr_every_n_nan_or_inf=2,
                             incr_ratio=2.0, decr_ratio=0.5)
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler.scale((weight * 1e-30).sum()).backward()  # scaled gradient ~1.7e8: finite
    scaler.step(optimizer)
    scaler.update()

    assert weight.item() == pytest.approx(-1e-30)  # a good step
    state = scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["bad_steps"]) == (2.0 ** 127, 0, 0)


def test_static_scale_stays_and_overflow_steps_are_skipped():
    overflow_steps = frozenset({1, 4})
    recorder = Recorder(overflow_steps)
    fit(fp16(init_loss_scaling=8.0, use_dynamic_loss_scaling=False, incr_every_n_steps=1), max_steps=6,
        callbacks=[recorder])

    assert recorder.scales == [8.0] * 6
    assert recorder.updated == [step not in overflow_steps for step in range(6)]


def test_float16_autocast_is_in_use():
    model = MLPClassifier()
    dtypes = []
    model.blocks[0].net[1].register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    fit(fp16(), max_steps=2, model=model)

    assert dtypes == [torch.float16, torch.float16]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights


def test_bfloat16_trains_without_scaler():
    pl.seed_everything(0, verbose=False)
    model = MLPClassifier()
    dtypes = []
    model.blocks[0].net[1].register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    recorder = Recorder()
    trainer = fit(build_precision("cpu", "bfloat16", init_loss_scaling=2.0), max_steps=30,
                  callbacks=[recorder], model=model)

    assert trainer.precision_plugin.scaler is None
    assert set(dtypes) == {torch.bfloat16}
    first, last = recorder.losses[:5], recorder.losses[-5:]
    assert sum(last) / 5 < 0.7 * sum(first) / 5, recorder.losses


def test_bfloat16_clips_gradients_beside_a_fused_optimizer_step_as_beside_a_foreach_one():
    # Lightning refuses clipping with any fused step (a float16 loss scale would be clipped
    # unscaled); bfloat16 has no scale. GPT-2's recipe: bf16, clip 1.0, fused AdamW on CUDA.
    def trained(fused: bool, clip: float) -> list:
        pl.seed_everything(0, verbose=False)
        model = MLPClassifier(optimizer=lambda parameters: torch.optim.AdamW(parameters, lr=0.05, fused=fused,
                                                                             foreach=not fused))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, gradient_clip_val=clip, limit_val_batches=0,
                             plugins=[build_precision("cpu", "bfloat16")], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, SyntheticClassificationData(batch_size=16, num_workers=0))
        return [parameter.detach().clone() for parameter in model.parameters()]

    fused, foreach, unclipped = trained(True, 0.01), trained(False, 0.01), trained(True, 0.0)
    for ours, theirs, free in zip(fused, foreach, unclipped):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(ours, free) for ours, free in zip(fused, unclipped))  # the clipping acted


def test_white_and_black_lists_set_module_precision_and_keep_training():
    model = MLPClassifier()
    keys = list(model.state_dict())
    # LayerNorm runs in float32 under autocast and Linear in float16: the lists invert that.
    changed = apply_precision_lists(model, ModelContext(model), "float16", custom_white_list=["blocks.1.net.0"],
                                    custom_black_list=["head.*", "Linear"])
    assert changed == sorted(["blocks.1.net.0", "head.0", "head.1", "stem"]
                             + [f"blocks.{i}.net.{j}" for i in range(3) for j in (1, 3)])
    assert list(model.state_dict()) == keys

    dtypes: dict[str, set] = {}
    for name in ("blocks.1.net.0", "blocks.0.net.0", "head.1", "blocks.0.net.2"):
        model.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: dtypes.setdefault(name, set()).add(output.dtype))
    listed = [model.get_submodule(name).weight for name in ("blocks.1.net.0", "head.1")]
    before = [p.detach().clone() for p in listed]
    fit(fp16(), max_steps=2, model=model)

    assert dtypes == {"blocks.1.net.0": {torch.float16},   # white-listed LayerNorm
                      "blocks.0.net.0": {torch.float32},   # LayerNorm, left to autocast
                      "head.1": {torch.float32},           # black-listed Linear
                      "blocks.0.net.2": {torch.float32}}   # GELU after a black-listed Linear
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(b, p) for b, p in zip(before, listed))  # gradients reached them


def test_list_forward_hooks_run_once_and_copies_stay_independent():
    model = MLPClassifier()
    apply_precision_lists(model, ModelContext(model), "bfloat16", custom_white_list=["head.1"], custom_black_list=[])
    calls = []
    model.head[1].register_forward_hook(lambda module, args, output: calls.append(output.dtype))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.head[1].weight.zero_()
        clone.head[1].bias.zero_()

    inputs = torch.randn(2, 32)
    assert model(inputs).dtype == torch.bfloat16
    assert calls == [torch.bfloat16]
    assert torch.count_nonzero(clone(inputs)) == 0  # the copy's forward uses the copy's weights


def test_unknown_list_entry_is_refused_with_a_suggestion():
    model = MLPClassifier()
    with pytest.raises(ConfigError, match=r"strategy\.amp\.custom_black_list='LayerNrom'.*did you mean LayerNorm"):
        apply_precision_lists(model, ModelContext(model), "float16", [], ["LayerNrom"])
    with pytest.raises(ConfigError, match=r"custom_white_list='blocks\.0\.net\.7'.*did you mean blocks\.0\.net"):
        apply_precision_lists(model, ModelContext(model), "float16", ["blocks.0.net.7"], [])
    with pytest.raises(ConfigError, match="also matched by custom_black_list"):
        apply_precision_lists(model, ModelContext(model), "float16", ["LayerNorm"], ["head.0"])


def test_scaler_state_survives_a_checkpoint(tmp_path):
    # 6 steps ending in one overflow: saved with scale 4 (grown at step 2), bad_steps 1.
    first = Recorder(frozenset({5}))
    trainer = fit(fp16(init_loss_scaling=2.0), max_steps=6, callbacks=[first])
    path = tmp_path / "amp.ckpt"
    trainer.save_checkpoint(path)
    saved = trainer.precision_plugin.scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"], saved["bad_steps"]) == (4.0, 0, 1)

    restored = fp16(init_loss_scaling=1024.0)
    restored.load_state_dict(torch.load(path, weights_only=True)["MixedPrecision"])
    assert restored.scaler.state_dict() == saved
    copied = pickle.loads(pickle.dumps(trainer.precision_plugin.scaler))
    copied.scale(torch.ones(()))  # re-creates the counters as tensors
    assert copied.state_dict() == saved

    # Resuming: the overflow at step 6 is the second in a row only if bad_steps was restored.
    second = Recorder(frozenset({6}))
    fit(fp16(init_loss_scaling=1024.0), max_steps=8, callbacks=[second], ckpt_path=str(path))
    assert second.scales == fleet_scales(2.0, frozenset({5, 6}), 8, 3, 2, 2.0, 0.5)[6:] == [2.0, 2.0]


# --------------------------------------------------------------------------- Paddle as the reference


@dataclass(frozen=True)
class ScalingRun:
    """Steps of one weight w (two zeros) on the loss mean(w * x) with SGD at lr 1 (with `momentum`):
    x is [1, 1], or [1, inf] on an overflow step."""

    knobs: dict[str, Any]
    overflow_steps: frozenset[int]
    num_steps: int
    momentum: float = 0.0

    def inputs(self) -> list[list[float]]:
        return [[1.0, INF if step in self.overflow_steps else 1.0] for step in range(self.num_steps)]


SCALING_RUNS = {
    # Growth after 3 good steps, back-off after 2 overflows in a row, a lone overflow (7) that
    # resets the good steps, a good step (8) that resets the bad ones, back-off floored at 1 (12).
    "rule": ScalingRun(loss_scaling(), frozenset({3, 4, 7, 9, 10, 11, 12}), 14),
    # Fleet's default scale and a ratio inexact in binary: the scale's float32 rounding.
    "float32-rounding": ScalingRun(loss_scaling(init_loss_scaling=32768.0, incr_every_n_steps=2,
                                                decr_every_n_nan_or_inf=1, decr_ratio=0.8),
                                   frozenset({0, 1, 2, 5, 8, 9}), 12),
    # 2**126 * 4 is past float32's max. (2**127 would make 1 / scale a float32 subnormal.)
    "growth-past-float32-max": ScalingRun(loss_scaling(init_loss_scaling=2.0 ** 126, incr_every_n_steps=1,
                                                       decr_every_n_nan_or_inf=1, incr_ratio=4.0), frozenset(), 3),
    "static": ScalingRun(loss_scaling(init_loss_scaling=8.0, use_dynamic_loss_scaling=False), frozenset({1, 4}), 6),
    "momentum": ScalingRun(loss_scaling(init_loss_scaling=4.0, incr_every_n_steps=100, decr_every_n_nan_or_inf=1),
                           frozenset({2}), 5, momentum=0.5),
}
DYNAMIC_RUNS = [name for name, run in SCALING_RUNS.items() if run.knobs["use_dynamic_loss_scaling"]]
# (custom_white_list, custom_black_list): Paddle op names, which Paddle does not check against its ops.
LIST_PAIRS = [(["layer_norm"], ["layer_norm"]), (["matmul_v2", "softmax"], ["softmax", "layer_norm"]),
              (["matmul_v2"], ["layer_norm"]), ([], ["layer_norm"])]


@pytest.fixture(scope="module")
def paddle_amp(tmp_path_factory) -> dict[str, Any]:
    """Paddle's side of SCALING_RUNS (by name: `fleet` and `grad_scaler`, per step the scale, the
    good and bad steps and w after it) and of LIST_PAIRS (in order: `fleet` and `auto_cast`, the
    refusal's message or None). One Paddle run."""
    folder = tmp_path_factory.mktemp("paddle_amp")
    cases = {"scaling": [{"knobs": run.knobs, "lr": 1.0, "momentum": run.momentum, "inputs": run.inputs()}
                         for run in SCALING_RUNS.values()],
             "lists": LIST_PAIRS}
    (folder / "cases.json").write_text(json.dumps(cases))
    run_paddle("loss_scaling", str(folder / "cases.json"), str(folder / "paddle.json"))
    result = json.loads((folder / "paddle.json").read_text())
    return {"scaling": dict(zip(SCALING_RUNS, result["scaling"], strict=True)), "lists": result["lists"]}


def our_steps(run: ScalingRun) -> list[dict[str, Any]]:
    """The run with FleetGradScaler and torch's SGD; per step the scale, good and bad steps and w after it."""
    scaler = FleetGradScaler("cpu", **run.knobs)
    weight = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=1.0, momentum=run.momentum)
    steps = []
    for inputs in run.inputs():
        scaler.scale((weight * torch.tensor(inputs)).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        state = scaler.state_dict()
        steps.append({"scale": state["scale"], "good": state["_growth_tracker"], "bad": state["bad_steps"],
                      "w": weight.tolist()})
    return steps


def column(steps: list[dict[str, Any]], *keys: str) -> list[tuple]:
    """Per step, the values of `keys`."""
    return [tuple(step[key] for key in keys) for step in steps]


@pytest.mark.parametrize("name", DYNAMIC_RUNS)
def test_scale_and_counters_follow_fleets_update_loss_scaling(name, paddle_amp):
    """Exactly Fleet's scale (float32) and good/bad steps after every step; with plain SGD also its w:
    Fleet's update_loss_scaling zeroes an overflowing step's gradients, so SGD leaves w as ours skips it."""
    run, fleet = SCALING_RUNS[name], paddle_amp["scaling"][name]["fleet"]
    ours = our_steps(run)
    assert column(ours, "scale", "good", "bad") == column(fleet, "scale", "good", "bad")
    if not run.momentum:  # momentum: test_fleets_static_amp_still_steps_on_an_overflow_unlike_ours
        assert column(ours, "w") == column(fleet, "w")


@pytest.mark.parametrize("name", [name for name in SCALING_RUNS if name != "growth-past-float32-max"])
def test_overflow_steps_are_skipped_as_paddles_grad_scaler_skips_them(name, paddle_amp):
    """Ours and Paddle's dygraph GradScaler skip the whole optimizer step on exactly the overflow
    steps (momentum included), and count good and bad steps alike."""
    run, grad_scaler = SCALING_RUNS[name], paddle_amp["scaling"][name]["grad_scaler"]
    ours = our_steps(run)
    assert column(ours, "w", "good", "bad") == column(grad_scaler, "w", "good", "bad")
    unchanged = [after["w"] == before["w"] for before, after in zip([{"w": [0.0, 0.0]}, *ours], ours)]
    assert unchanged == [step in run.overflow_steps for step in range(run.num_steps)]


def test_paddles_grad_scaler_departs_from_fleets_rule_at_both_ends(paddle_amp):
    """docs/strategies.md: Paddle's dygraph GradScaler backs off below 1 and grows past float32's max,
    where Fleet's update_loss_scaling (and ours) floors at 1 and keeps the scale."""
    rule = paddle_amp["scaling"]["rule"]
    assert column(rule["fleet"], "scale") == [(s,) for s in (2, 2, 4, 4, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1)]
    assert column(rule["grad_scaler"], "scale") == [(s,) for s in (2, 2, 4, 4, 2, 2, 2, 2, 2, 2, 1, 1, 0.5, 0.5)]

    past = paddle_amp["scaling"]["growth-past-float32-max"]
    assert column(past["fleet"], "scale") == column(our_steps(SCALING_RUNS["growth-past-float32-max"]), "scale") \
        == [(2.0 ** 126,)] * 3
    # An infinite scale makes every later gradient overflow: GradScaler skips every step after.
    assert column(past["grad_scaler"], "scale") == [(INF,)] * 3
    assert column(past["grad_scaler"], "w") == [([-0.5, -0.5],)] * 3


def test_fleets_static_amp_still_steps_on_an_overflow_unlike_ours(paddle_amp):
    """docs/strategies.md: Fleet's static program runs the inner optimizer on an overflow step too;
    ours skips it, as Paddle's dygraph GradScaler does
    (test_overflow_steps_are_skipped_as_paddles_grad_scaler_skips_them)."""
    # Without dynamic scaling nothing zeroes the gradients: SGD writes the overflow into w.
    static, ours = paddle_amp["scaling"]["static"]["fleet"], our_steps(SCALING_RUNS["static"])
    assert column(static, "scale") == column(ours, "scale") == [(8.0,)] * 6
    assert [all(map(math.isfinite, step["w"])) for step in static] == [True] + [False] * 5
    # Zeroed gradients still take a momentum step: the velocity moves w on overflow step 2.
    momentum, ours = paddle_amp["scaling"]["momentum"]["fleet"], our_steps(SCALING_RUNS["momentum"])
    assert momentum[2]["w"] != momentum[1]["w"]
    assert ours[2]["w"] == ours[1]["w"]


def test_a_name_in_both_lists_is_refused_as_paddle_refuses_it(paddle_amp):
    """Fleet's amp (AutoMixedPrecisionLists) and dygraph auto_cast refuse an op name in both custom
    lists with a ValueError; strategy.amp refuses the same names with a ConfigError."""
    def refused(white: list[str], black: list[str]) -> bool:
        try:
            AmpConfig(custom_white_list=white, custom_black_list=black)
        except ConfigError:
            return True
        return False

    ours = [refused(white, black) for white, black in LIST_PAIRS]
    paddle_refusals = paddle_amp["lists"]
    assert [refusal["fleet"] is not None for refusal in paddle_refusals] == ours == [True, True, False, False]
    assert [refusal["auto_cast"] is not None for refusal in paddle_refusals] == ours
    assert "overlaps custom_black_list with < layer_norm >" in paddle_refusals[0]["fleet"]


# One launch, 2 processes, DDP with float16 loss scaling: an inf written into rank 0's gradient
# after DDP's all-reduce is seen by rank 0 only.
TWO_RANKS_SCRIPT = """
import pytorch_lightning as pl
import torch
import torch.distributed as dist

from tests.helpers.distributed import save
from plugins.amp import build_precision
from plugins.ddp import build_ddp
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier

torch.set_num_threads(1)
OVERFLOW_STEP = 2


class Recorder(pl.Callback):
    def __init__(self):
        self.scales, self.updated = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == OVERFLOW_STEP and dist.get_rank() == 0:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.updated.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))


pl.seed_everything(0, verbose=False)
precision = build_precision("cpu", "float16", init_loss_scaling=8.0, use_dynamic_loss_scaling=True,
                            incr_every_n_steps=100, decr_every_n_nan_or_inf=1, incr_ratio=2.0, decr_ratio=0.5)
recorder = Recorder()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=build_ddp(), plugins=[precision], callbacks=[recorder],
                     max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(MLPClassifier(), SyntheticClassificationData())
save("amp", {"scales": recorder.scales, "updated": recorder.updated,
             "params": [p.detach().clone() for p in trainer.lightning_module.parameters()]})
"""


@pytest.mark.slow
def test_an_overflow_on_one_rank_makes_every_rank_skip_and_back_off(tmp_path):
    from tests.helpers.distributed import load_ranks, run_two_ranks

    run_two_ranks(TWO_RANKS_SCRIPT, tmp_path)
    ranks = load_ranks(tmp_path, "amp")
    for rank in ranks:
        assert rank["updated"] == [True, True, False, True]
        assert rank["scales"] == [8.0, 8.0, 4.0, 4.0]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
