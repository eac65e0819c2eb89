"""Resume on another number of processes: the state that differs between ranks follows each
strategy's stated rule (docs/reliability.md#resume-on-another-number-of-processes), never rank 0's
alone. One chain of real runs per row: 2 processes for 10 steps, resumed on 1 for 10 more, then on
2 again for 10 more, the global batch of 128 kept by hand (trainer.accumulate_grad_batches=2 on
1 process) until the resume chooses it itself. What every rank starts from is read off
tests/helpers/rank_rules.py:StartState and held against the rule, computed here from the
checkpoint it resumed from."""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 10
SEED = 0  # conf/config.yaml's
PROBE = ("+callbacks.start._target_=tests.helpers.rank_rules.StartState", "trainer.limit_val_batches=0",
         f"+callbacks.model_checkpoint.every_n_train_steps={STEPS}", "+callbacks.model_checkpoint.save_top_k=-1")
# The chain: (run directory, processes, Lightning's accumulation, the step it resumes the run before from).
# The first, never interrupted, trains 2 x STEPS steps; the others resume from a checkpoint written
# while training, at the step given.
WORLDS = (("two", 2, 1, None), ("one", 1, 2, STEPS), ("again", 2, 1, 2 * STEPS))


class Chain:
    """A chain of WORLDS' runs under `root`: run directories, consoles, checkpoints and start states."""

    def __init__(self, lightfleet_in, root: Path, *overrides: str) -> None:
        self.root = root
        self.consoles: Dict[str, str] = {}
        for (before, *_), (name, processes, accumulation, step) in zip(((None,), *WORLDS), WORLDS):
            world = (f"trainer.devices={processes}", f"trainer.accumulate_grad_batches={accumulation}",
                     f"trainer.max_steps={(step or STEPS) + STEPS}", f"paths.output_dir={name}")
            if step is None:
                done = lightfleet_in(root, *overrides, *PROBE, *world)
            else:
                done = lightfleet_in(root, "resume", before, f"ckpt_path='{self.checkpoint(before, step)}'", *world)
            assert done.returncode == 0, done.stderr[-3000:]
            self.consoles[name] = done.stdout + done.stderr

    def checkpoint(self, run: str, step: int) -> Path:
        """`run`'s checkpoint of `step`, written while training."""
        (path,) = (self.root / run / "checkpoints").glob(f"*-step={step}.ckpt")
        return path

    def load(self, run: str, step: int) -> dict:
        return torch.load(self.checkpoint(run, step), weights_only=False)

    def starts(self, run: str) -> List[dict]:
        """What each rank of `run` started training from, in rank order."""
        paths = sorted((self.root / run).glob("start.rank*.pt"))
        return [torch.load(path, weights_only=False) for path in paths]

    def resumes(self):
        """(resumed run, the checkpoint it resumed from, its ranks' start states) for 2 -> 1 and 1 -> 2."""
        for (before, *_), (run, processes, _, step) in zip(WORLDS, WORLDS[1:]):
            starts = self.starts(run)
            assert len(starts) == processes
            yield run, self.load(before, step), starts


def callback_state(checkpoint: dict, name: str) -> dict:
    (state,) = [state for key, state in checkpoint["callbacks"].items() if key.startswith(name)]
    return state


def assert_tensors_close(got, expected, where: str) -> None:
    """Nested dicts and lists alike, their tensors equal to float32's rounding (a mean of two)."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_tensors_close(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for index, (mine, theirs) in enumerate(zip(got, expected)):
            assert_tensors_close(mine, theirs, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, msg=where)
    else:
        assert got == expected, where


def halves(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return (first + second) / 2


def assert_rule_announced(chain: Chain, what: str, runs=tuple(run for run, *_ in WORLDS[1:])) -> None:
    """Each resume of `runs` says the rule once, in a lightfleet line on the console and in the
    job's log, never as a raw warning."""
    for run in runs:
        console = chain.consoles[run]
        lines = [line for line in console.splitlines() if f"holds the {what} of" in line]
        # The line as rank 0 writes it: the agent puts [rank0]: before it on the console.
        assert len(lines) == 1 and re.match(r"(\[rank0\]:)?lightfleet: ", lines[0]), console[-3000:]
        assert "UserWarning" not in console, console[-3000:]
        log = (chain.root / run / "lightfleet.log").read_text()  # the job's log, every rank's lines
        assert log.count(f"holds the {what} of") == 1, log[-3000:]


def assert_generators_rederived(chain: Chain) -> None:
    """Random generators: every rank's re-derived from (run seed, global step, rank) through
    numpy's SeedSequence (torch's, Python's and numpy's seeds its first three words), so that no
    two ranks draw alike and none takes rank 0's saved states."""
    for run, checkpoint, starts in chain.resumes():
        saved = callback_state(checkpoint, "RandomStates")["ranks"]
        for rank, start in enumerate(starts):
            torch_seed, python_seed, numpy_seed = np.random.SeedSequence(
                [SEED, start["global_step"], rank]).generate_state(3)
            assert torch.equal(start["torch"], torch.Generator().manual_seed(int(torch_seed)).get_state()), (run, rank)
            assert start["python"] == random.Random(int(python_seed)).getstate(), (run, rank)
            assert np.array_equal(start["numpy"][1], np.random.RandomState(int(numpy_seed)).get_state()[1]), (run, rank)
            assert not any(torch.equal(start["torch"], old["torch"]) for old in saved), (run, rank)
        if len(starts) > 1:
            assert not torch.equal(starts[0]["torch"], starts[1]["torch"]), run


# ------------------------------------------------------------------ dgc, on a model with batch norm


@pytest.fixture(scope="module")
def dgc_batch_norm(lightfleet_in, tmp_path_factory) -> Chain:
    return Chain(lightfleet_in, tmp_path_factory.mktemp("dgc"), "model=resnet", "data=images", "strategy=[dgc]")


def test_dgc_every_rank_takes_the_mean_of_the_old_ranks_momentum_and_residual(dgc_batch_norm):
    """(1/N) sum_r v_r, the update the ranks have yet to send, is what it was: on 1 process the
    mean of the 2 ranks' buffers; on 2 again, the one rank's buffers on both."""
    for run, checkpoint, starts in dgc_batch_norm.resumes():
        old = callback_state(checkpoint, "DGCCheckpoint")["ranks"]
        if len(old) == 2:  # the two ranks' residuals differ: their mean is no rank's own
            first, second = (rank["buffers"]["head.weight"]["residual"] for rank in old)
            assert not torch.equal(first, second)
        expected = {name: {key: sum(rank["buffers"][name][key] for rank in old) / len(old)
                           for key in ("momentum", "residual")} for name in old[0]["buffers"]}
        for start in starts:
            assert start["dgc"]["step"] == old[0]["step"] == start["global_step"], run
            assert_tensors_close(start["dgc"]["buffers"], expected, run)
    assert_rule_announced(dgc_batch_norm, "dgc residuals and momentum")


def test_batch_norm_every_rank_starts_from_the_checkpoints_statistics_rank_0s(dgc_batch_norm):
    """The running statistics are buffers that DDP sends from rank 0 to every rank before each
    forward (broadcast_buffers): the checkpoint holds rank 0's, which every rank of the new world
    starts from, and which DDP goes on sending."""
    for run, checkpoint, starts in dgc_batch_norm.resumes():
        statistics = {name: value for name, value in checkpoint["state_dict"].items()
                      if "running_" in name}
        assert statistics
        for start in starts:
            assert start["buffers"].keys() == statistics.keys()
            for name, value in statistics.items():
                assert torch.equal(start["buffers"][name], value), (run, name)
    assert_generators_rederived(dgc_batch_norm)


# ------------------------------------------------------------------ localsgd, adaptive_localsgd

# At step 10 every rank holds a replica of its own: localsgd averaged after steps 5 and 9 (k = 4
# from step 1), adaptive_localsgd goes local after step 7 and averages first after step 11.
LOCAL_SGD = {"localsgd": ("strategy.localsgd.k_steps=4",),
             "adaptive_localsgd": ("strategy.adaptive_localsgd.init_k_steps=4",
                                   "strategy.adaptive_localsgd.begin_step=7")}
COUNTERS = {"localsgd": ("syncs",), "adaptive_localsgd": ("syncs", "k_steps", "lr0", "loss0", "next_average_step")}


@pytest.fixture(scope="module", params=sorted(LOCAL_SGD))
def local_sgd(request, lightfleet_in, tmp_path_factory) -> tuple:
    name = request.param
    return name, Chain(lightfleet_in, tmp_path_factory.mktemp(name), "experiment=quickstart", f"strategy=[{name}]",
                       *LOCAL_SGD[name])


def test_local_sgd_every_rank_starts_from_the_average_of_the_replicas(local_sgd):
    """What the next averaging would have given: 2 -> 1, the mean of the 2 replicas' parameters
    and optimizer state; 1 -> 2, the one process's model on both ranks; the averaging counters
    (and adaptive's period, first loss and learning rate, next averaging step) carried."""
    name, chain = local_sgd
    for run, checkpoint, starts in chain.resumes():
        state = callback_state(checkpoint, "ModelAveraging" if name == "localsgd" else "AdaptiveModelAveraging")
        replicas = state.get("replicas")
        if replicas:
            first, second = (replica["parameters"] for replica in replicas)
            assert any(not torch.equal(first[key], second[key]) for key in first)  # each rank's own
            parameters = {key: halves(first[key], second[key]) for key in first}
            optimizer = {index: {key: halves(*(replica["optimizer"]["state"][index][key] for replica in replicas))
                                 for key in entry} for index, entry in replicas[0]["optimizer"]["state"].items()}
        else:  # one process: its model is the one replica
            parameters = {key: value for key, value in checkpoint["state_dict"].items()}
            optimizer = checkpoint["optimizer_states"][0]["state"]
        for start in starts:
            assert_tensors_close(start["parameters"], parameters, run)
            assert_tensors_close(start["optimizer"]["state"], optimizer, run)
            for counter in COUNTERS[name]:
                assert start["averaging"][counter] == state[counter], (run, counter)
    assert_rule_announced(chain, "local replicas", ["one"])  # a 1-process checkpoint holds no replicas
    assert_generators_rederived(chain)


# ------------------------------------------------------------------ amp, on a model with dropout

INIT_SCALE = 32768.0  # amp's init_loss_scaling


@pytest.fixture(scope="module")
def amp_dropout(lightfleet_in, tmp_path_factory) -> Chain:
    """A tiny GPT-2 (transformers) with dropout in float16, its loss scale doubled every 2 good steps."""
    return Chain(lightfleet_in, tmp_path_factory.mktemp("amp"), "model=causal_lm", "data=language_model",
                 "model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.dropout=0.1",
                 "strategy=[amp]", "strategy.amp.incr_every_n_steps=2")


def test_amp_every_rank_carries_the_loss_scale_and_its_counters(amp_dropout):
    """The loss scaler is the same on every rank (its overflow flag is all-reduced): the checkpoint's
    scale, good and bad steps go on on every rank of the new world."""
    for run, checkpoint, starts in amp_dropout.resumes():
        saved = checkpoint["MixedPrecision"]
        assert saved["scale"] != INIT_SCALE  # it moved: carried, not started again
        for start in starts:
            assert start["precision"] == saved, run


def test_dropout_draws_from_generators_rederived_on_every_rank(amp_dropout):
    assert_generators_rederived(amp_dropout)
    assert_rule_announced(amp_dropout, "random generator states")


# ------------------------------------------------------------------ fp16_allreduce


@pytest.fixture(scope="module")
def fp16_allreduce(lightfleet_in, tmp_path_factory) -> Chain:
    return Chain(lightfleet_in, tmp_path_factory.mktemp("fp16_allreduce"), "experiment=quickstart",
                 "strategy=[fp16_allreduce]")


RESUMED_L2 = 1e-4


def relative_l2(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    difference = sum(float((got[key].double() - value.double()).square().sum()) for key, value in expected.items())
    return (difference / sum(float(value.double().square().sum()) for value in expected.values())) ** 0.5


def test_fp16_allreduce_goes_on_close_to_the_run_never_interrupted(fp16_allreduce):
    """Nothing of it is kept per rank; what the world changes is where gradients are rounded to
    float16: each rank's share (its gradient / N) before the sum on N processes, the whole
    accumulated gradient on one. 2 -> 1 at step 10 ends step 20 within RESUMED_L2 of the
    uninterrupted run's parameters (relative L2; measured 2.1e-5, plain DDP's 2.2e-8); 1 -> 2
    goes on to step 30."""
    chain = fp16_allreduce
    full, one, again = chain.load("two", 2 * STEPS), chain.load("one", 2 * STEPS), chain.load("again", 3 * STEPS)
    assert relative_l2(one["state_dict"], full["state_dict"]) < RESUMED_L2
    assert all(value.isfinite().all() for value in again["state_dict"].values())
