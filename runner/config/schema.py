"""The run's schema: trainer, paths, measurement, the collective knobs and the parameter-server
mode (runner/config/collective.py), the fast path (runner/config/fast_path.py) and the run
itself, each knob typed and documented.

Plain dataclasses (no torch, no lightning): Hydra composes the YAML in conf/, and
`runner.config.checks.validate` merges it onto `RunConfig`, so a typo, a wrong type or an out-of-range
value is refused before anything heavy is imported. Each field is documented by the string
right under it (the source of docs/knobs.md). Strategies' knobs live in runner/strategies/.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Dict, Optional

from runner import strategies
from runner.config.collective import CollectiveConfig, ParameterServerConfig
from runner.config.fast_path import FastPathConfig
from runner.config.rehearse import RehearseConfig
from runner.core.errors import require

# One field per strategy of the registry.
StrategyConfig = make_dataclass(
    "StrategyConfig", [(name, Optional[schema], None) for name, schema in strategies.schemas().items()],
    namespace={"__module__": __name__, "__doc__": "Knobs of the selected strategies, by name (None: not selected)."})


ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
LIGHTFLEET_TRAINER_KNOBS = ("max_restarts",)  # trainer.* knobs lightfleet carries out itself, not Lightning's Trainer
PROFILERS = ("simple", "advanced", "pytorch", "xla")


# The keys of a max_time mapping: Lightning's Timer builds a datetime.timedelta from it.
TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def is_duration(value: Any) -> bool:
    """A max_time Lightning's Timer takes: "DD:HH:MM:SS", or a mapping of TIMEDELTA_KEYS to numbers."""
    if isinstance(value, str):
        return re.fullmatch(r"\d+:\d\d:\d\d:\d\d", value.strip()) is not None
    if isinstance(value, dict):
        return bool(value) and all(key in TIMEDELTA_KEYS and isinstance(number, (int, float))
                                   and not isinstance(number, bool) for key, number in value.items())
    return value is None


def is_batches(value: Any, lowest: int) -> bool:
    """A count of batches >= lowest, or a fraction in [0, 1] (Lightning's limit_* and val_check_interval)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= lowest
    return value is None or (isinstance(value, float) and 0.0 <= value <= 1.0)


@dataclass
class TrainerConfig:
    """Arguments of `pytorch_lightning.Trainer`, and LIGHTFLEET_TRAINER_KNOBS. lightfleet owns `strategy`, `precision`,
    `plugins`, `callbacks`, `logger` and `default_root_dir` (they come from the plan and the
    config groups), so they are not knobs here."""

    accelerator: str = "auto"
    """cpu, gpu/cuda or auto (CUDA when available)."""
    devices: Any = 1
    """Processes per node (an int), or a device list. On CPU, 2 means 2 real processes (gloo)."""
    num_nodes: int = 1
    """Nodes; the same command runs on each with MASTER_ADDR, MASTER_PORT and NODE_RANK set."""
    max_epochs: Optional[int] = None
    """Stop after this many epochs (None: Lightning's default, 1000, unless max_steps is set)."""
    min_epochs: Optional[int] = None
    """Run at least this many epochs."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: no limit)."""
    min_steps: Optional[int] = None
    """Run at least this many optimizer steps."""
    max_time: Any = None
    """Stop after this wall time ("DD:HH:MM:SS" or a dict)."""
    limit_train_batches: Any = None
    """Optimizer steps per training epoch (int; lightfleet passes Lightning steps x accumulation
    batches, so a resume that changes the accumulation keeps it) or fraction of the epoch (float)."""
    limit_val_batches: Any = None
    """Batches per validation run (int) or fraction of them (float); 0 disables validation."""
    limit_test_batches: Any = None
    """Batches per test run (int) or fraction (float)."""
    limit_predict_batches: Any = None
    """Batches per predict run (int) or fraction (float)."""
    overfit_batches: Any = 0.0
    """Train and validate on this many (int) or this fraction (float) of training batches."""
    val_check_interval: Any = None
    """Validate every this many optimizer steps (int; Lightning is given steps x accumulation
    batches, so a resume that changes the accumulation validates at the same steps) or fraction of
    an epoch (float)."""
    check_val_every_n_epoch: Optional[int] = 1
    """Validate every n epochs."""
    num_sanity_val_steps: Optional[int] = None
    """Validation batches run before training (Lightning default 2)."""
    log_every_n_steps: Optional[int] = None
    """Logging interval in steps (Lightning default 50)."""
    enable_checkpointing: Optional[bool] = None
    """Save checkpoints (see the callbacks group)."""
    enable_progress_bar: Optional[bool] = None
    """Show the progress bar."""
    enable_model_summary: Optional[bool] = None
    """Print the model summary at start."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; prefer strategy=[gradient_merge] (which sets it)."""
    gradient_clip_val: Optional[float] = None
    """Clip gradients at this value (None: no clipping)."""
    gradient_clip_algorithm: Optional[str] = None
    """norm (default) or value."""
    deterministic: Any = None
    """Use deterministic algorithms (true, false or "warn")."""
    benchmark: Optional[bool] = None
    """cudnn.benchmark."""
    inference_mode: bool = True
    """Use torch.inference_mode in evaluation."""
    use_distributed_sampler: bool = True
    """Wrap dataloaders in a DistributedSampler when distributed."""
    profiler: Optional[str] = None
    """simple, advanced or pytorch."""
    detect_anomaly: bool = False
    """Enable autograd anomaly detection."""
    barebones: bool = False
    """Disable all features that may slow the loop (logging, checkpoints, progress bar...)."""
    sync_batchnorm: bool = False
    """Synchronise batch-norm statistics across processes."""
    reload_dataloaders_every_n_epochs: int = 0
    """Reload dataloaders every n epochs (0: never)."""
    fast_dev_run: Any = False
    """Run n (or 1 if true) batches of train/val/test to find bugs."""
    enable_autolog_hparams: bool = True
    """Log the module's hyperparameters to the loggers."""
    model_registry: Optional[str] = None
    """Lightning model registry name (unused by lightfleet)."""
    max_restarts: int = 0
    """lightfleet's own, not Lightning's: when a rank dies (killed, out of memory), restart the ranks
    up to this many times in the same command, resuming from the newest checkpoints/last.ckpt as
    `lightfleet resume` would (torch elastic's restarts; for ranks the command starts, so
    trainer.devices >= 2). restarts.yaml records each restart."""

    def __post_init__(self) -> None:
        devices_ok = not isinstance(self.devices, bool) and (  # true is an int to Python, not a count
            self.devices in ("auto", -1) or (isinstance(self.devices, int) and self.devices >= 1)
            or (isinstance(self.devices, list) and len(self.devices) >= 1))
        require(devices_ok, "trainer.devices", self.devices, "allowed: a count >= 1, a list of device ids, auto or -1")
        require(is_duration(self.max_time), "trainer.max_time", self.max_time,
                "allowed: \"DD:HH:MM:SS\" (e.g. \"00:12:00:00\"), a mapping such as {hours: 12}, or null; keys: "
                + ", ".join(TIMEDELTA_KEYS))
        require(self.num_nodes >= 1, "trainer.num_nodes", self.num_nodes, "must be >= 1")
        require(self.max_restarts >= 0, "trainer.max_restarts", self.max_restarts, "must be >= 0")
        require(not self.max_restarts or self.devices != 1 or self.num_nodes > 1, "trainer.max_restarts",
                self.max_restarts, "restarts are of the ranks the command starts (trainer.devices >= 2); "
                "a single process trains inside the command")
        require(self.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches",
                self.accumulate_grad_batches, "must be >= 1")
        require(self.accelerator in ACCELERATORS, "trainer.accelerator", self.accelerator,
                f"allowed: {', '.join(ACCELERATORS)}", ACCELERATORS)
        # Lightning's own ranges, checked here so that a bad value stops the command, not a rank.
        for name, lowest in (("max_epochs", -1), ("min_epochs", 0), ("max_steps", -1), ("min_steps", 0),
                             ("check_val_every_n_epoch", 1), ("num_sanity_val_steps", -1), ("log_every_n_steps", 0),
                             ("reload_dataloaders_every_n_epochs", 0)):
            value = getattr(self, name)
            require(value is None or value >= lowest, f"trainer.{name}", value,
                    f"must be >= {lowest}" + ("" if name in ("max_steps", "reload_dataloaders_every_n_epochs")
                                              else " (or null)"))
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                     "overfit_batches"):
            require(is_batches(getattr(self, name), lowest=0), f"trainer.{name}", getattr(self, name),
                    "allowed: a count of batches >= 0, a fraction in [0.0, 1.0], or null")
        require(self.val_check_interval is None or (is_batches(self.val_check_interval, lowest=1)
                                                     and self.val_check_interval != 0.0),
                "trainer.val_check_interval", self.val_check_interval,
                "allowed: a count of optimizer steps >= 1, a fraction of an epoch in (0.0, 1.0], or null")
        require(self.gradient_clip_val is None or self.gradient_clip_val >= 0, "trainer.gradient_clip_val",
                self.gradient_clip_val, "must be >= 0 (or null: no clipping)")
        require(self.gradient_clip_algorithm in (None, "norm", "value"), "trainer.gradient_clip_algorithm",
                self.gradient_clip_algorithm, "allowed: norm, value (or null: norm)", ("norm", "value"))
        require(self.profiler in (None, *PROFILERS), "trainer.profiler", self.profiler,
                f"allowed: {', '.join(PROFILERS)} (or null)", PROFILERS)
        require(self.deterministic in (None, True, False, "warn"), "trainer.deterministic", self.deterministic,
                "allowed: true, false, warn (or null)")
        require(isinstance(self.fast_dev_run, bool) or (isinstance(self.fast_dev_run, int) and self.fast_dev_run >= 0),
                "trainer.fast_dev_run", self.fast_dev_run, "allowed: true, false or a count of batches >= 0")


@dataclass
class PathsConfig:
    """Where outputs go. Relative paths are taken from the directory lightfleet runs in."""

    root_dir: str = "."
    """Base of the default output locations."""
    output_dir: str = "${paths.root_dir}/outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    """Run directory of a single run: config, plan, env, metrics, checkpoints, rank logs."""
    sweep_dir: str = "${paths.root_dir}/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    """Parent of a multirun's job directories (one per job: 0, 1, ...)."""


@dataclass
class MeasureConfig:
    """What every run measures of itself (docs/measurements.md): optimizer-step time, samples/s,
    tokens/s, model FLOPs utilisation, peak memory per rank, start-up and wall time."""

    enabled: bool = True
    """Measure, log the figures every log_every_n_steps and write them to results.yaml."""
    warmup_steps: int = 5
    """Optimizer steps left out of step times and throughput (allocation, autotuning, caches)."""
    traffic: bool = False
    """Count the payload bytes of the strategies' collectives, per rank and optimizer step, into
    traffic/rank<R>.jsonl (docs/rehearse.md); off, nothing is counted."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "measure.warmup_steps", self.warmup_steps, "must be >= 0")


@dataclass
class RunConfig:
    """A whole run: what to train, on what, how, with which strategies, and where outputs go."""

    model: Dict[str, Any] = field(default_factory=dict)
    """The LightningModule: `_target_` (import path) and its constructor arguments; a built-in
    model's `optimizer` is an option of the group model/optimizer (sgd, adam, adamw, ...:
    docs/guide.md#the-optimizer), e.g. model/optimizer=adamw."""
    data: Dict[str, Any] = field(default_factory=dict)
    """The LightningDataModule: `_target_` and its constructor arguments."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer arguments."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """Knobs of the strategies selected with `strategy=[...]`."""
    logger: Dict[str, Any] = field(default_factory=dict)
    """Loggers by name, each a `_target_` spec (null disables one)."""
    callbacks: Dict[str, Any] = field(default_factory=dict)
    """Extra callbacks by name, each a `_target_` spec (null disables one)."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Output locations."""
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """The run's measurements of its own speed and memory."""
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    """Fleet's collective-training knobs (DDP buckets, SyncBatchNorm, op fusion as torch.compile, threads)."""
    parameter_server: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    """Fleet's parameter-server modes: sync (data parallelism) and geo (localsgd); async ones are refused."""
    fast_path: FastPathConfig = field(default_factory=FastPathConfig)
    """torch.compile, fused optimizers and the attention kernel."""
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)
    """What `lightfleet rehearse` holds each rank against: the device, the reserve, the steps."""
    name: str = "default"
    """Name of the run (experiments set it)."""
    seed: int = 0
    """Seed for torch, numpy and python random on every rank."""
    dry_run: bool = False
    """Print the plan and exit without training."""
    ckpt_path: Optional[str] = None
    """Checkpoint to start from: model, optimizer, loss scaler, strategy state and step count
    (a path, or `last`: the newest checkpoints/last.ckpt of a run of the same experiment name and
    model under paths.root_dir's outputs/ and multirun/, named when taken). Weights that do not fit
    the model are refused before anything starts. The run itself writes a new run directory."""
    test: bool = False
    """Run the test stage after fit (the data module needs a test_dataloader)."""
    evaluate: bool = False
    """Only evaluate ckpt_path's weights: validation (and test with test=true), no training."""
    stop_on_nonfinite: bool = True
    """Stop the run when the loss or a parameter becomes NaN or Inf: one line naming the step and the
    last checkpoint written before it, exit status 3, failure.yaml's status `diverged`; no
    checkpoint with non-finite weights is written (docs/reliability.md). false: train on."""
    verbose: bool = False
    """Show Lightning's informational lines (devices, distributed setup, tips); hydra.verbose=true
    and the --verbose flag set it too."""
    optimized_metric: Optional[str] = None
    """A metric of results.yaml (e.g. val_loss) the job returns to a sweeper that optimises it (Optuna)."""
