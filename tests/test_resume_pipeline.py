"""Issue 41, pipeline and tensor-parallel layouts resumed on another number of processes: a run on
2 processes, resumed on 4 and back on 2, trains every global step on the samples of the
uninterrupted 2-process run and ends with its parameters and optimizer state (relative L2 under
1e-5 after 40 steps).

- pipeline: 2 stages on 2 processes; on 4, two replicas of those stages (`strategy.sharding.pp_degree=2`),
  whose optimizer states ZeRO shards over the replicas. The micro-batch stays, accumulate_steps
  (and so data.batch_size) halves.
- tensor parallel: sharding stage 3 with `mp_degree=2` (tp 2 on 2 processes, dp 2 x tp 2 on 4), through
  torch.distributed.checkpoint. The micro-batch stays, trainer.accumulate_grad_batches halves.
- the pipeline alone spans every process: on 4 the model is cut into 4 stages instead of 2.

The accumulation is given by hand (until `lightfleet resume` chooses it). The model is the built-in
GPT with a warm-up and a linear decay of its learning rate (a scheduler over the run's steps).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import pytest
import torch

from plugins.sharding import export
from tests.helpers.probe import samples_per_step

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

STEPS, GLOBAL_BATCH = 40, 8

# The built-in GPT, with the warm-up and linear decay ClassifierModule builds (LambdaLR, per step).
SCHEDULED_GPT = '''
from runner.models import GPTDecoder


class ScheduledGPT(GPTDecoder):
    def __init__(self, vocab_size: int = 64, seq_len: int = 32, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, optimizer=None, warmup_steps: int = 5) -> None:
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, optimizer)
        self.warmup_steps, self.lr_decay = warmup_steps, "linear"
'''
RUN = ["model=gpt", "model._target_=scheduled_gpt.ScheduledGPT", "data=language_model", "model.d_model=32",
       "model.seq_len=16", "data.seq_len=16", f"trainer.max_steps={STEPS}", "trainer.enable_progress_bar=false",
       "+callbacks.ids._target_=tests.helpers.probe.SampleIds", "+callbacks.model_checkpoint.every_n_train_steps=10",
       "+callbacks.model_checkpoint.save_top_k=-1"]


class Layout(NamedTuple):
    overrides: List[str]  # on every number of processes
    per_world: Dict[int, List[str]]  # processes -> the overrides that make the global batch there
    replicas: Dict[int, int]  # processes -> data-parallel replicas
    chain: Tuple[Tuple[int, int], ...]  # after the 2-process run: (processes, step resumed from)


LAYOUTS = {
    # SGD: AdamW's steps on the attention key biases, whose gradient is zero but for rounding
    # (softmax ignores a shift shared by all keys), are the sign of that rounding noise, which the
    # replicas' other reduction order changes (docs/reliability.md, "Pipeline and tensor-parallel layouts").
    "pipeline": Layout(
        ["strategy=[pipeline,sharding]", "strategy.sharding.pp_degree=2", "model.n_layers=2", "model/optimizer=sgd"],
        {2: ["trainer.devices=2", "data.batch_size=8", "strategy.pipeline.accumulate_steps=4"],
         4: ["trainer.devices=4", "data.batch_size=4", "strategy.pipeline.accumulate_steps=2"]},
        {2: 1, 4: 2}, ((4, 10), (2, 30))),
    "tensor_parallel": Layout(  # the GPT's own AdamW
        ["strategy=[sharding]", "strategy.sharding.stage=3", "strategy.sharding.mp_degree=2", "model.n_layers=2",
         "data.batch_size=4"],
        {2: ["trainer.devices=2", "trainer.accumulate_grad_batches=2"],
         4: ["trainer.devices=4", "trainer.accumulate_grad_batches=1"]},
        {2: 1, 4: 2}, ((4, 10), (2, 30))),
    "pipeline_restaged": Layout(  # one pipeline of 2 stages, then of 4: the batch stays
        ["strategy=[pipeline]", "model.n_layers=4", "data.batch_size=8", "strategy.pipeline.accumulate_steps=4"],
        {2: ["trainer.devices=2"], 4: ["trainer.devices=4"]},
        {2: 1, 4: 1}, ((4, 20),)),
}


@pytest.fixture(scope="module")
def chains(tmp_path_factory, lightfleet_in) -> Dict[str, List[Tuple[Path, int, int]]]:
    """Per layout: the uninterrupted run on 2 processes, then its chain: (run directory, processes,
    first step) each."""
    runs = {}
    for name, layout in LAYOUTS.items():
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "scheduled_gpt.py").write_text(SCHEDULED_GPT)
        reference = lightfleet_in(cwd, *RUN, *layout.overrides, *layout.per_world[2], "paths.output_dir=reference")
        assert reference.returncode == 0, reference.stderr[-3000:]
        runs[name] = [(cwd / "reference", 2, 0)]
        for processes, step in layout.chain:
            previous = runs[name][-1][0]
            (checkpoint,) = (previous / "checkpoints").glob(f"*-step={step}.ckpt")
            run = f"resumed_on_{processes}_at_{step}"
            resumed = lightfleet_in(cwd, "resume", str(previous), f"ckpt_path='{checkpoint}'",
                                    *layout.per_world[processes], f"paths.output_dir={run}")
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            runs[name].append((cwd / run, processes, step))
    return runs


def trained(run: Path, readers: int) -> Dict[int, Counter]:
    """The samples of each step of `run`, once per data-parallel replica: the `readers` ranks of a
    pipeline or a tensor-parallel group read the same batches."""
    steps = samples_per_step(run)
    assert all(count % readers == 0 for ids in steps.values() for count in ids.values())
    return {step: Counter({sample: count // readers for sample, count in ids.items()}) for step, ids in steps.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_trains_on_the_samples_of_the_uninterrupted_run(chains, layout):
    (reference, _, _), *chain = chains[layout]
    replicas = LAYOUTS[layout].replicas
    expected = trained(reference, 2 // replicas[2])
    assert sorted(expected) == list(range(STEPS))
    assert all(len(ids) == sum(ids.values()) == GLOBAL_BATCH for ids in expected.values())  # G samples, once each
    ends = [start for _, _, start in chain[1:]] + [STEPS]
    for (run, processes, start), end in zip(chain, ends):
        steps = trained(run, processes // replicas[processes])
        assert sorted(steps) == list(range(start, STEPS)), run.name
        for step in range(start, end):  # up to where the next run of the chain resumes
            assert steps[step] == expected[step], (run.name, step)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_4_process_run_had_its_layout(chains, layout):
    """Not the same layout again: the chain's 4-process run wrote checkpoints of its own world,
    with the same global batch."""
    run, processes, _ = chains[layout][1]
    record = full_checkpoint(run / "checkpoints" / "last.ckpt")["lightfleet"]
    assert record["world"] == {"processes": processes, "nodes": 1, "data_parallel": LAYOUTS[layout].replicas[processes]}
    assert record["batch"]["global"] == GLOBAL_BATCH


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_chain_ends_with_the_parameters_and_optimizer_state_of_the_uninterrupted_run(chains, layout):
    (reference, _, _), *_, (last, _, _) = chains[layout]
    expected, got = (full_checkpoint(run / "checkpoints" / "last.ckpt") for run in (reference, last))
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
        same = torch.equal if torch.is_tensor(expected[key]) else lambda a, b: a == b
        assert same(got[key], expected[key]), key
    difference, norm = (torch.cat([tensor.flatten() for tensor in parts]).norm() for parts in
                        ([got[key] - expected[key] for key in tensors], [expected[key] for key in tensors]))
    return (difference / norm).item()
