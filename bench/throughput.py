"""Steady-state training throughput of one GPT trained three ways: (a) a hand-written PyTorch loop,
(b) a hand-written Lightning script, (c) lightfleet with strategy=[], [amp], [amp,recompute] and
[amp,sharding] (all one process: sharding stage 1 is DDP + ZeroRedundancyOptimizer over a world of 1).
Same sizes, seed, steps, batch and threads (1) everywhere; each side a fresh process, the sides
interleaved round by round; samples/s over the steps after warm-up. Ratios: medians over the rounds'
pairs. With --gpu-gpt: a GPT-2-small-sized GPT in bf16 on CUDA, (a), (b) and lightfleet [amp] and
[amp,recompute], with MFU. Results: bench/throughput.json.

    python bench/throughput.py                 # CPU, small GPT, 3 rounds of 200 steps
    python bench/throughput.py --repeats 5 --steps 400 --warmup 40
    python bench/throughput.py --gpu-gpt       # CUDA only
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytorch_lightning as pl
import torch
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and bench/ when lightfleet is not installed
from bench.run import paired_ratio, timed  # noqa: E402
from bench.spawning import machine  # noqa: E402
from runner.config.compose import compose_config  # noqa: E402
from runner.core.paths import CONF_DIR  # noqa: E402
from runner.data import SyntheticLanguageModelData  # noqa: E402
from runner.rank.measure import peak_flops  # noqa: E402
from runner.models import GPTDecoder  # noqa: E402

SEED = 0
# A step of tens of milliseconds on one CPU thread (d_model 256 x 4 layers x 128 tokens x 16 would
# take about 0.7 s): short steps are where a framework's per-step cost shows.
CPU_GPT = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 4}
CPU_BATCH = 8
# GPT-2 small's shape with the padded GPT-2 vocabulary: 124M parameters with tied embeddings, 163M
# here, where the decoder's head is separate (FLOPs per token count the head, not the embeddings).
GPU_GPT = {"vocab_size": 50304, "seq_len": 1024, "d_model": 768, "n_heads": 12, "n_layers": 12}
GPU_BATCH = 8
# The synthetic data's Markov chain is a vocab x vocab matrix: at 50304 tokens, 10 GB of floats
# argsorted row by row (about 40 GB and 5 minutes on one thread, in every process). The data draws
# ids below this instead; the model's vocabulary (embedding and head sizes), and so every FLOP,
# stays GPU_GPT's.
GPU_DATA_VOCAB = 1024
# The hand-written Lightning script shows no progress bar, keeps no logger and no checkpoint;
# lightfleet's sides are told the same.
LIGHTFLEET_QUIET = ["logger=none", "callbacks=none", "trainer.enable_checkpointing=false",
                    "trainer.enable_progress_bar=false"]
Rounds = List[Dict[str, Dict[str, Any]]]  # per round, per side, its figures (samples_per_s, ...)


@dataclass(frozen=True)
class Setup:
    """What every side trains: the same model, data, steps and precision."""

    model: Dict[str, int]  # GPTDecoder's sizes
    data_vocab: int
    batch: int
    steps: int
    warmup: int
    device: str  # cpu | cuda
    bf16: bool  # hand-written sides under bf16 autocast; lightfleet's amp with dtype bfloat16
    strategies: Tuple[str, ...]  # lightfleet's sides; the first is compared with the hand-written ones

    @property
    def data(self) -> Dict[str, int]:
        """SyntheticLanguageModelData's arguments: one epoch of exactly `steps` batches, so no
        epoch ends inside the measured steps, and one batch of validation at its end."""
        return {"vocab_size": self.data_vocab, "seq_len": self.model["seq_len"], "batch_size": self.batch,
                "num_train": self.batch * self.steps, "num_val": self.batch, "num_test": self.batch, "seed": SEED}

    @property
    def sides(self) -> Dict[str, Optional[str]]:
        """Each side's name and lightfleet's strategy list for it (None: a hand-written side)."""
        return {**dict.fromkeys(HAND_WRITTEN), **{lightfleet_side(s): s for s in self.strategies}}

    @property
    def accelerator(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"


def make_setup(args: argparse.Namespace) -> Setup:
    if args.gpu_gpt:
        return Setup(GPU_GPT, GPU_DATA_VOCAB, GPU_BATCH, args.steps, args.warmup, "cuda", True,
                     ("amp", "amp,recompute"))
    return Setup(CPU_GPT, CPU_GPT["vocab_size"], CPU_BATCH, args.steps, args.warmup, "cpu", False,
                 ("", "amp", "amp,recompute", "amp,sharding"))


def lightfleet_side(strategies: str) -> str:
    return f"lightfleet[{strategies}]"


# --------------------------------------------------------------------------- timing the steps


@dataclass
class Window:
    """Samples and seconds of the optimizer steps after warm-up, counted as RunMeter counts them:
    from the end of step `warmup` to the end of step `steps`. On CUDA the device is synchronised
    at those two ends only, so the steps in between run asynchronously as they would untimed."""

    warmup: int
    steps: int
    samples: int = 0
    started: Optional[float] = None
    ended: Optional[float] = None

    def step_done(self, step: int, batch_size: int, device: torch.device) -> None:
        """`step`: optimizer steps done so far, this one included."""
        if step > self.warmup:
            self.samples += batch_size
        if step in (self.warmup, self.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            if step == self.warmup:
                self.started = now
            else:
                self.ended = now

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def figures(self) -> Dict[str, float]:
        return {"samples": self.samples, "seconds": self.seconds, "samples_per_s": self.samples / self.seconds}


class StepWindow(pl.Callback):
    """A `Window` as a Lightning callback, ticking where RunMeter does (at each batch's end). With
    `out`, writes its figures there as JSON when training ends: lightfleet runs take it as
    `+callbacks.NAME._target_=bench.throughput.StepWindow` (bench/run.py's measure benchmark)."""

    def __init__(self, warmup: int, steps: int, out: Optional[str] = None) -> None:
        self.window = Window(warmup, steps)
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.window.step_done(trainer.global_step, len(batch[0]), trainer.strategy.root_device)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out:
            Path(self.out).write_text(json.dumps(self.window.figures()))


class CallbackClock(pl.Callback):
    """Times every hook of the run's other callbacks (bench/run.py's HookClock: lightfleet's own,
    the bar, Lightning's checkpointing) and, at teardown, writes to `out` each one's microseconds per
    optimizer step and share of the training time (on_train_start to on_train_end): bench/run.py's
    callbacks benchmark takes it as `+callbacks.clock._target_=bench.throughput.CallbackClock`."""

    def __init__(self, out: str) -> None:
        self.out, self.clocks, self.started, self.training_s = out, {}, 0.0, 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from bench.run import HookClock

        self.clocks = {type(callback).__name__: HookClock(callback, pl.Callback)
                       for callback in trainer.callbacks if callback is not self}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.training_s = time.perf_counter() - self.started

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        steps = max(trainer.global_step, 1)
        costs = {name: sum(sum(calls) for calls in clock.durations.values()) for name, clock in self.clocks.items()}
        Path(self.out).write_text(json.dumps({
            "steps": steps, "step_ms": self.training_s / steps * 1e3,
            "callbacks": {name: {"us_per_step": seconds / steps * 1e6, "share": seconds / self.training_s,
                                 "hooks_us_per_step": {hook: sum(calls) / steps * 1e6
                                                       for hook, calls in self.clocks[name].durations.items()}}
                          for name, seconds in costs.items()}}))


# --------------------------------------------------------------------------- the hand-written sides


def adamw_settings() -> Dict[str, Any]:
    """The knobs of conf/model/gpt.yaml's AdamW (its option of conf/model/optimizer/), which
    lightfleet's sides train with."""
    optimizer = OmegaConf.to_container(compose_config(["model=gpt"]).model.optimizer)
    return {key: value for key, value in optimizer.items() if not key.startswith("_")}


def lightfleet_trainer_defaults() -> Dict[str, Any]:
    """conf/trainer/default.yaml: the Trainer settings lightfleet's sides run with."""
    return yaml.safe_load((CONF_DIR / "trainer" / "default.yaml").read_text())


def hand_loop(setup: Setup) -> Tuple[Window, GPTDecoder]:
    """Plain PyTorch written for speed: the data made once and indexed on the device, no loader,
    no logging, gradients dropped rather than zeroed."""
    torch.manual_seed(SEED)
    device = torch.device(setup.device)
    model = GPTDecoder(**setup.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_settings())
    data = SyntheticLanguageModelData(**setup.data)
    data.setup()
    inputs, targets = (tensor.to(device) for tensor in data.train_set.tensors)
    window = Window(setup.warmup, setup.steps)
    batches = torch.randperm(len(inputs), device=device).split(setup.batch)  # one shuffled epoch
    for step, batch in enumerate(batches, start=1):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.bf16):
            loss = model.loss(model(inputs[batch]), targets[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        window.step_done(step, len(batch), device)
    return window, model


def lightning_script(setup: Setup) -> Tuple[Window, GPTDecoder]:
    """A plain Trainer with lightfleet's trainer defaults, without logger, checkpoints or progress bar."""
    pl.seed_everything(SEED, workers=True, verbose=False)
    model = GPTDecoder(**setup.model, optimizer=partial(torch.optim.AdamW, **adamw_settings()))
    timer = StepWindow(setup.warmup, setup.steps)
    settings = {**lightfleet_trainer_defaults(), "accelerator": setup.accelerator, "max_steps": setup.steps}
    trainer = pl.Trainer(**settings, precision="bf16-mixed" if setup.bf16 else "32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[timer])
    trainer.fit(model, datamodule=SyntheticLanguageModelData(**setup.data))
    return timer.window, model


HAND_WRITTEN = {"hand_loop": hand_loop, "lightning_script": lightning_script}


def run_hand_written(name: str, setup: Setup, result: Path) -> None:
    """One hand-written side (in its own process), its figures written to `result` as lightfleet's
    results.yaml would name them; MFU from the model's declared FLOPs per token, as lightfleet's."""
    window, model = HAND_WRITTEN[name](setup)
    samples_per_s = window.figures()["samples_per_s"]
    tokens_per_s = samples_per_s * setup.model["seq_len"]
    peak = peak_flops(torch.device(setup.device), torch.bfloat16 if setup.bf16 else torch.float32)
    mfu = model.flops_per_token * tokens_per_s / peak if peak else None
    result.write_text(json.dumps({"samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s, "mfu": mfu}))


# --------------------------------------------------------------------------- running the sides


def lightfleet_command(setup: Setup, strategies: str, run_dir: Path) -> List[str]:
    sizes = [f"model.{key}={value}" for key, value in setup.model.items()]
    sizes += [f"data.{key}={value}" for key, value in setup.data.items()]
    bf16 = ["strategy.amp.dtype=bfloat16"] if setup.bf16 and "amp" in strategies.split(",") else []
    return [sys.executable, "-m", "runner", "model=gpt", "data=language_model", f"strategy=[{strategies}]",
            *sizes, *bf16, f"seed={SEED}", f"trainer.accelerator={setup.accelerator}",
            f"trainer.max_steps={setup.steps}", f"measure.warmup_steps={setup.warmup}", *LIGHTFLEET_QUIET,
            f"paths.output_dir={run_dir}"]


def hand_written_command(setup: Setup, name: str, result: Path) -> List[str]:
    return [sys.executable, __file__, "--side", name, "--result", str(result), "--steps", str(setup.steps),
            "--warmup", str(setup.warmup), *(["--gpu-gpt"] if setup.device == "cuda" else [])]


def run_side(setup: Setup, side: str, strategies: Optional[str], workdir: Path) -> Dict[str, Any]:
    """One side in a fresh process (OMP_NUM_THREADS=1, bench/run.py's environment): its samples/s,
    tokens/s and MFU, and the whole process's wall time."""
    if strategies is None:
        result = workdir / f"{side}.json"
        wall = timed(hand_written_command(setup, side, result))
        figures = json.loads(result.read_text())
    else:
        run_dir = workdir / f"lightfleet_{strategies.replace(',', '+') or 'none'}"  # Hydra-safe characters
        wall = timed(lightfleet_command(setup, strategies, run_dir))
        results = yaml.safe_load((run_dir / "results.yaml").read_text())
        figures = {key: results[key] for key in ("samples_per_s", "tokens_per_s", "mfu")}
    return {**figures, "wall_s": wall}


def run_rounds(setup: Setup, repeats: int) -> Rounds:
    """Every side once per round, in the same order, so drifting load hits them alike."""
    rounds = []
    for index in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            figures = {}
            for side, strategies in setup.sides.items():
                figures[side] = run_side(setup, side, strategies, Path(tmp))
                print(f"round {index + 1}/{repeats}: {side}: {figures[side]['samples_per_s']:.1f} samples/s",
                      flush=True)
            rounds.append(figures)
    return rounds


# --------------------------------------------------------------------------- summary


@dataclass
class Ratio:
    """Throughput of `side` over `reference`: the median over the rounds' pairs, and the pairs."""

    side: str
    reference: str
    goal: Optional[float]  # at least this
    median: float
    pairs: List[float]

    @property
    def met(self) -> Optional[bool]:
        return None if self.goal is None else self.median >= self.goal


def paired_throughput(rounds: Rounds, side: str, reference: str, goal: Optional[float] = None) -> Ratio:
    throughput = {key: [figures[name]["samples_per_s"] for figures in rounds]
                  for key, name in (("a", side), ("b", reference))}
    pairs = [a / b for a, b in zip(throughput["a"], throughput["b"])]
    return Ratio(side, reference, goal, paired_ratio(throughput), pairs)


def ratios(setup: Setup, rounds: Rounds) -> List[Ratio]:
    """lightfleet's first side against the Lightning script (goal: within 3%) and the hand loop
    (within 10%); lightfleet's other strategies against its first."""
    baseline = lightfleet_side(setup.strategies[0])
    found = [paired_throughput(rounds, baseline, "lightning_script", 0.97),
             paired_throughput(rounds, baseline, "hand_loop", 0.90)]
    return found + [paired_throughput(rounds, lightfleet_side(strategies), baseline)
                    for strategies in setup.strategies[1:]]


def medians(setup: Setup, rounds: Rounds) -> Dict[str, Dict[str, Optional[float]]]:
    """Per side, the median of each figure over the rounds (None for a figure a side lacks: MFU on CPU)."""
    def median(side: str, key: str) -> Optional[float]:
        values = [figures[side][key] for figures in rounds]
        return None if None in values else statistics.median(values)

    return {side: {key: median(side, key) for key in rounds[0][side]} for side in setup.sides}


def shown(value: Optional[float], form: str) -> str:
    return "—" if value is None else format(value, form)


def table(by_side: Dict[str, Dict[str, Optional[float]]], found: List[Ratio]) -> str:
    """Markdown: the sides' medians, then the ratios with their goals."""
    lines = ["| side | samples/s | tokens/s | MFU | process wall s |", "| --- | --- | --- | --- | --- |"]
    for side, figures in by_side.items():
        lines.append(f"| {side} | {shown(figures['samples_per_s'], ',.1f')} | {shown(figures['tokens_per_s'], ',.0f')} "
                     f"| {shown(figures['mfu'], '.1%')} | {shown(figures['wall_s'], '.1f')} |")
    lines += ["", "| samples/s ratio | median of the rounds' pairs | pairs | goal | met |",
              "| --- | --- | --- | --- | --- |"]
    for ratio in found:
        goal = "" if ratio.goal is None else f">= {ratio.goal:.2f}"
        met = "" if ratio.met is None else ("yes" if ratio.met else "no")
        lines.append(f"| {ratio.side} / {ratio.reference} | **{ratio.median:.3f}** "
                     f"| {min(ratio.pairs):.3f}–{max(ratio.pairs):.3f} | {goal} | {met} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every side (medians taken)")
    # On a shared 2-core machine, 60 steps (about 2 s of training) gave pairs from 0.8 to 1.2; 200, within 0.05.
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="first steps left out of the throughput")
    parser.add_argument("--gpu-gpt", action="store_true", help="GPT-2-small-sized GPT in bf16 on CUDA, with MFU")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "throughput.json")
    parser.add_argument("--side", choices=list(HAND_WRITTEN), help=argparse.SUPPRESS)  # a hand-written side's process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be at least 1 and below --steps {args.steps}")
    if args.gpu_gpt and not torch.cuda.is_available():
        parser.exit(2, "bench/throughput.py: --gpu-gpt needs a CUDA GPU, and torch sees none here\n")
    setup = make_setup(args)
    if args.side:
        run_hand_written(args.side, setup, args.result)
        return

    print(f"{len(setup.sides)} sides x {args.repeats} rounds: {', '.join(setup.sides)}", flush=True)
    rounds = run_rounds(setup, args.repeats)
    by_side, found = medians(setup, rounds), ratios(setup, rounds)
    print(table(by_side, found))
    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
               "setup": {**asdict(setup), "data": setup.data}, "sides": by_side,
               "ratios": [{**asdict(ratio), "met": ratio.met} for ratio in found], "rounds": rounds}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
