"""Issue 41, pipeline and tensor-parallel layouts resumed on another number of processes: a run on
2 processes, resumed at step 10 on 4 and at step 30 back on 2, trains every global step on the
samples of the uninterrupted 2-process run and ends with its parameters and optimizer state
(relative L2 under 1e-5 after 40 steps).

- pipeline: 2 stages on 2 processes; on 4, two replicas of those stages (`strategy.sharding.pp_degree=2`),
  whose optimizer states ZeRO shards over the replicas. The micro-batch stays, accumulate_steps
  (and so data.batch_size) halves.
- tensor parallel: sharding stage 3 with `mp_degree=2` (tp 2 on 2 processes, dp 2 x tp 2 on 4), through
  torch.distributed.checkpoint. The micro-batch stays, trainer.accumulate_grad_batches halves.

The accumulation is given by hand (until `lightfleet resume` chooses it). The model is the built-in
GPT with a warm-up and a linear decay of its learning rate (a scheduler over the run's steps).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugins.sharding import export
from tests.helpers.probe import samples_per_step

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

STEPS, GLOBAL_BATCH = 40, 8
CHAIN = ((2, None), (4, 10), (2, 30))  # (processes, step resumed from): 2 -> 4 -> 2

# The built-in GPT, with the warm-up and linear decay ClassifierModule builds (LambdaLR, per step).
SCHEDULED_GPT = '''
from runner.models import GPTDecoder


class ScheduledGPT(GPTDecoder):
    def __init__(self, vocab_size: int = 64, seq_len: int = 32, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, optimizer=None, warmup_steps: int = 5) -> None:
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, optimizer)
        self.warmup_steps, self.lr_decay = warmup_steps, "linear"
'''
RUN = ["model=gpt", "model._target_=scheduled_gpt.ScheduledGPT", "data=language_model", "model.n_layers=2",
       "model.d_model=32", "model.seq_len=16", "data.seq_len=16", f"trainer.max_steps={STEPS}",
       "trainer.enable_progress_bar=false", "+callbacks.ids._target_=tests.helpers.probe.SampleIds",
       "+callbacks.model_checkpoint.every_n_train_steps=10", "+callbacks.model_checkpoint.save_top_k=-1"]
LAYOUTS = {
    # SGD: AdamW's steps on the attention key biases, whose gradient is zero but for rounding
    # (softmax ignores a shift shared by all keys), are the sign of that rounding noise, which the
    # replicas' other reduction order changes (docs/reliability.md, "Pipeline and tensor-parallel layouts").
    "pipeline": (["strategy=[pipeline,sharding]", "strategy.sharding.pp_degree=2", "model/optimizer=sgd"],
                 {2: ["trainer.devices=2", "data.batch_size=8", "strategy.pipeline.accumulate_steps=4"],
                  4: ["trainer.devices=4", "data.batch_size=4", "strategy.pipeline.accumulate_steps=2"]}),
    "tensor_parallel": (["strategy=[sharding]", "strategy.sharding.stage=3", "strategy.sharding.mp_degree=2",
                         "data.batch_size=4"],  # the GPT's own AdamW
                        {2: ["trainer.devices=2", "trainer.accumulate_grad_batches=2"],
                         4: ["trainer.devices=4", "trainer.accumulate_grad_batches=1"]}),
}


@pytest.fixture(scope="module")
def chains(tmp_path_factory, lightfleet_in) -> dict:
    """Per layout: the uninterrupted run on 2 processes and the chain 2 -> 4 -> 2 (run directories)."""
    runs = {}
    for layout, (common, per_world) in LAYOUTS.items():
        cwd = tmp_path_factory.mktemp(layout)
        (cwd / "scheduled_gpt.py").write_text(SCHEDULED_GPT)
        reference = lightfleet_in(cwd, *RUN, *common, *per_world[2], "paths.output_dir=reference")
        assert reference.returncode == 0, reference.stderr[-3000:]
        chain, previous = [], cwd / "reference"
        for processes, step in CHAIN[1:]:
            (checkpoint,) = (previous / "checkpoints").glob(f"*-step={step}.ckpt")
            name = f"resumed_on_{processes}_at_{step}"
            resumed = lightfleet_in(cwd, "resume", str(previous), f"ckpt_path='{checkpoint}'", *per_world[processes],
                                    f"paths.output_dir={name}")
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            chain.append(cwd / name)
            previous = cwd / name
        runs[layout] = (cwd / "reference", chain)
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_trains_on_the_samples_of_the_uninterrupted_run(chains, layout):
    reference, chain = chains[layout]
    expected = samples_per_step(reference)
    assert sorted(expected) == list(range(STEPS))
    assert all(len(ids) == GLOBAL_BATCH for ids in expected.values())  # G distinct samples, each step
    ends = [step for _, step in CHAIN[2:]] + [STEPS]
    for run, (_, start), end in zip(chain, CHAIN[1:], ends):
        trained = samples_per_step(run)
        assert sorted(trained) == list(range(start, STEPS)), run.name
        for step in range(start, end):  # up to where the next run of the chain resumes
            assert trained[step] == expected[step], (run.name, step)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_middle_run_had_two_data_parallel_replicas(chains, layout):
    """Not the same layout again: the chain's 4-process run wrote checkpoints of 2 replicas of G / 2."""
    _, chain = chains[layout]
    record = full_checkpoint(chain[0] / "checkpoints" / "last.ckpt")["lightfleet"]
    assert record["world"] == {"processes": 4, "nodes": 1, "data_parallel": 2}
    assert record["batch"]["global"] == GLOBAL_BATCH and record["batch"]["loader"] == GLOBAL_BATCH // 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_chain_ends_with_the_parameters_and_optimizer_state_of_the_uninterrupted_run(chains, layout):
    reference, chain = chains[layout]
    expected, got = (full_checkpoint(run / "checkpoints" / "last.ckpt") for run in (reference, chain[-1]))
    assert got["global_step"] == expected["global_step"] == STEPS
    assert got["lr_schedulers"] == expected["lr_schedulers"]
    for part in ("state_dict", "optimizer_states"):
        assert relative_l2(flat(got[part]), flat(expected[part])) < 1e-5, part


def full_checkpoint(path: Path) -> dict:
    """A checkpoint directory as one state (every stage's or shard's part, whole tensors)."""
    out = path.parent / f"{path.name}.whole.pt"
    export(path, out)
    return torch.load(out, weights_only=True)


def flat(state: object, key: str = "") -> dict:
    """A nested state as {dotted key: leaf}."""
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {name: leaf for inner, value in items for name, leaf in flat(value, f"{key}.{inner}").items()}
    return {key: state}


def relative_l2(got: dict, expected: dict) -> float:
    """||got - expected|| / ||expected|| over the tensors of `expected` (by key) but scalars; those
    (step counters) and the other values (hyper-parameters) are equal."""
    assert got.keys() == expected.keys()
    tensors = [key for key, value in expected.items() if torch.is_tensor(value) and value.dim()]
    for key in expected.keys() - set(tensors):
        assert torch.equal(got[key], expected[key]) if torch.is_tensor(expected[key]) else got[key] == expected[key], key
    difference, norm = (torch.cat([tensor.flatten() for tensor in parts]).norm()
                        for parts in ([got[key] - expected[key] for key in tensors], [expected[key] for key in tensors]))
    return (difference / norm).item()
