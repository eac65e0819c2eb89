"""Resume on another number of processes, the exact rows (issue 41; docs/reliability.md, "Resume on
another number of processes"): a single process and plain DDP, sharding stages 1-3, recompute,
gradient_merge, lars and lamb, in float32 on a model without run-time randomness (the built-in MLP,
with a learning-rate schedule).

Per row, one uninterrupted run of 40 steps on 2 processes and one chain of runs, each resumed
from the one before: 2 processes (the uninterrupted run's checkpoint at step 10; for the plain
row, a run of its own stopped by SIGTERM) -> 1 process to step 20 -> 2 processes to step 30 -> 3
processes to step 40. Every link but the last is interrupted mid-epoch (2,048 samples make 21
global batches of 96 an epoch, so steps 10, 20 and 30 fall inside one), either by SIGTERM or by
the user's code failing one step after its checkpoint (tests/helpers/probe.py:FailingStep). Each
link trains every global step on exactly the samples the uninterrupted run trained on at that
step (tests/helpers/probe.py:SampleIds), and the chain ends with the uninterrupted run's schedule
state, and with parameters within 1e-5 of its (relative L2). Not bit for bit: a global batch's
gradient is summed in another order on another number of processes (2 x 3 micro-batches of 16,
each averaged, then averaged across the processes, against 1 x 6), and float32 addition is not
associative; the chains here end about 1e-7 apart.

The global batch G = 96 = 6 x 16 divides among 1, 2 and 3 processes: the accumulation is 6, 3, 2,
set by each strategy's knob: by hand for the uninterrupted run, by the command for every resume
(runner/command/resume_world.py), whose plan line the test reads.
"""
from __future__ import annotations

import pytest
import torch

from plugins.gradient_merge import GradientSum
from plugins.sharding import export
from tests.helpers.preemption import REACHED, start, wait_for
from tests.helpers.probe import samples_per_step

STEPS = 40
BATCH = 16
GLOBAL_BATCH = 6 * BATCH
FIRST = 2  # processes of the uninterrupted run and of the chain's first link, interrupted at step 10
# The resumed links: processes, the step each is interrupted at (the last one runs to the end).
CHAIN = ((1, 20), (2, 30), (3, STEPS))

# The built-in MLP with a learning-rate schedule (warm-up, then cosine decay over trainer.max_steps),
# as a user's model brought by `model._target_`: the schedule's state follows too.
SCHEDULED_MLP = '''
from runner.models import MLPClassifier


class ScheduledMLP(MLPClassifier):
    def __init__(self, warmup_steps, lr_decay, **kwargs):
        super().__init__(**kwargs)
        self.warmup_steps, self.lr_decay = warmup_steps, lr_decay  # runner.models.ClassifierModule's schedule
'''

# Every run: the scheduled MLP, 40 steps, each global step's sample ids recorded, a checkpoint every
# 10 steps, one thread a process (2 cores run up to 3 processes).
RUN = ("model._target_=user_code.ScheduledMLP", "+model.warmup_steps=5", "+model.lr_decay=cosine",
       "data.num_train=2048", f"data.batch_size={BATCH}", f"trainer.max_steps={STEPS}",
       "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
       "collective.execution_strategy.num_threads=1", "+callbacks.ids._target_=tests.helpers.probe.SampleIds",
       "+callbacks.model_checkpoint.every_n_train_steps=10", "+callbacks.model_checkpoint.save_top_k=-1")
# Hydra's ++ adds the key or sets it: the callback that interrupts a link, at its step.
FAILING = "++callbacks.fail._target_=tests.helpers.probe.FailingStep"


def sharding(stage: int) -> tuple:
    return "strategy.sharding.gradient_merge_acc_step", ["strategy=[sharding]", f"strategy.sharding.stage={stage}"]


# Row: (the knob that sets the accumulation, the row's overrides).
ROWS = {
    "plain": ("trainer.accumulate_grad_batches", []),
    "sharding_stage1": sharding(1),
    "sharding_stage2": sharding(2),
    "sharding_stage3": sharding(3),
    "recompute": ("trainer.accumulate_grad_batches", ["strategy=[recompute]"]),
    # avg=false: the sum of a replica's micro-batch gradients (avg=true is Lightning's accumulation,
    # the plain row's, set by k_steps), whose factor the resumed runs keep (plugins/gradient_merge.py).
    "gradient_merge": ("strategy.gradient_merge.k_steps",
                       ["strategy=[gradient_merge]", "strategy.gradient_merge.avg=false"]),
    "lars": ("trainer.accumulate_grad_batches", ["strategy=[lars]", "strategy.lars.exclude_from_weight_decay=[bias]"]),
    "lamb": ("trainer.accumulate_grad_batches",
             ["strategy=[lamb]", "model/optimizer=adam", "strategy.lamb.exclude_from_weight_decay=[bias]"]),
}


def accumulation(knob: str, processes: int) -> str:
    return f"{knob}={GLOBAL_BATCH // (processes * BATCH)}"


def last_checkpoint(run) -> dict:
    """The run's checkpoint at its last step, as one file's (gathered from a sharded one)."""
    (checkpoint,) = run.glob(f"checkpoints/*-step={STEPS}.ckpt")
    export(checkpoint, run / "whole.pt")
    return torch.load(run / "whole.pt", weights_only=True)


def parameters(checkpoint: dict) -> torch.Tensor:
    """The whole model's parameters, as one float64 vector."""
    state = checkpoint["state_dict"]
    return torch.cat([state[key].flatten().double() for key in sorted(state)])


def interrupted_by_sigterm(tmp_path, knob: str, row: list) -> int:
    """The chain's first link, on FIRST processes, stopped by SIGTERM mid-epoch; the step its
    checkpoint (last.ckpt) holds."""
    process = start(tmp_path, *RUN, *row, f"trainer.devices={FIRST}", accumulation(knob, FIRST),
                    "paths.output_dir=link0")
    wait_for(tmp_path / "link0" / REACHED, process)
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-3000:]
    return torch.load(tmp_path / "link0" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ROWS)
def test_a_chain_of_resumes_on_2_1_2_3_processes_trains_on_the_samples_and_ends_at_the_parameters_of_the_run(
        name, lightfleet, tmp_path):
    knob, row = ROWS[name]
    (tmp_path / "user_code.py").write_text(SCHEDULED_MLP)
    full = lightfleet(*RUN, *row, f"trainer.devices={FIRST}", accumulation(knob, FIRST), "paths.output_dir=full")
    assert full.returncode == 0, full.stderr[-3000:]
    expected = samples_per_step(tmp_path / "full")
    assert sorted(expected) == list(range(STEPS))
    assert all(sum(samples.values()) == GLOBAL_BATCH for samples in expected.values())

    # Where the chain starts: the uninterrupted run's checkpoint at step 10, or for the plain row a
    # run of its own preempted by SIGTERM (resumed by `lightfleet resume RUN`, as a user would).
    if name == "plain":
        stopped = interrupted_by_sigterm(tmp_path, knob, row)
        assert 3 <= stopped < CHAIN[0][1]
        links = [("link0", 0, stopped)]
        resume_from = ["link0", "~callbacks.slow", FAILING]
    else:
        links = [("full", 0, 10)]
        (checkpoint,) = (tmp_path / "full" / "checkpoints").glob("*-step=10.ckpt")
        resume_from = ["full", f"ckpt_path='{checkpoint}'", FAILING]
    for processes, until in CHAIN:
        failing = [f"++callbacks.fail.at_step={until}"] if until < STEPS else ["~callbacks.fail"]
        # The command sets the accumulation that keeps the global batch, through the row's knob.
        resumed = lightfleet("resume", *resume_from, f"trainer.devices={processes}", *failing,
                             f"paths.output_dir=link{processes}")
        assert f"x {GLOBAL_BATCH // (processes * BATCH)} ({accumulation(knob, processes)})" in resumed.stdout, \
            resumed.stdout[-3000:]
        run = f"link{processes}"
        links.append((run, links[-1][2], until))
        if until < STEPS:
            assert resumed.returncode != 0 and f"failed at step {until}" in resumed.stderr, resumed.stderr[-3000:]
            (checkpoint,) = (tmp_path / run / "checkpoints").glob(f"*-step={until}.ckpt")
            resume_from = [run, f"ckpt_path='{checkpoint}'"]
        else:
            assert resumed.returncode == 0, resumed.stderr[-3000:]

    for run, begin, end in links:
        trained = {step: samples for step, samples in samples_per_step(tmp_path / run).items() if begin <= step < end}
        assert trained == {step: expected[step] for step in range(begin, end)}, f"{run} trained on other samples"
    reference, resumed = (last_checkpoint(tmp_path / run) for run in ("full", links[-1][0]))
    assert resumed["lr_schedulers"] == reference["lr_schedulers"]
    reference, resumed = parameters(reference), parameters(resumed)
    difference = ((resumed - reference).norm() / reference.norm()).item()
    assert difference < 1e-5, f"the chain ends {difference:.2g} (relative L2) from the uninterrupted run"


def test_gradient_merge_sum_keeps_the_factor_of_the_run_it_resumes():
    """avg=false sums a replica's k_steps micro-batch gradients: k_steps times the global batch's
    mean. Resumed from 2 processes (k_steps=3) on 1 (k_steps=6), the sum keeps the factor 3."""
    resumed = GradientSum(k_steps=6)
    resumed.load_state_dict(GradientSum(k_steps=3).state_dict())
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([0.5, -1.0])  # Lightning's mean over the 6 micro-batches
    resumed.on_before_optimizer_step(None, None, torch.optim.SGD([param], lr=0.1))
    assert param.grad.tolist() == [1.5, -3.0]
