"""Fleet's collective-training knobs (`collective.*`) and its parameter-server modes
(`parameter_server.*`): their schema, each knob typed and documented by the string under it
(docs/knobs.md), and what the collective knobs add to the plan.

`CollectiveConfig.contribute` is lightfleet's own contribution (`<- collective` in the plan),
made after the strategies', once the run's Lightning strategy is settled: the Trainer's
sync_batchnorm and benchmark, DDP's bucket size and unused-parameter search, every Lightning
strategy's process-group timeout, the foreach optimizer, and `CollectiveSetup` for what needs the
rank's device (plugins/collective.py carries them out); the op-fusion flags ask for the fast
path's compile (runner/config/fast_path.py). Pure: no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from runner.config.fast_path import FastPathConfig, compile_transform
from runner.core.contribution import Component, Contribution, RunShape
from runner.core.errors import require

# The Lightning strategy of a run of several processes whose strategies bring none: DDP, with the
# collective knobs' bucket size and unused-parameter search, and hooks on any device.
LIGHTFLEET_DDP = Component("plugins.ddp:build_ddp")
# fuse_all_reduce_ops=false: DDP always buckets gradients (a bucket per tensor cannot be asked for);
# 1 KB buckets come closest, each holding one tensor or a few small ones.
UNFUSED_BUCKET_MB = 0.001
OP_FUSION_FLAGS = ("fuse_elewise_add_act_ops", "fuse_bn_act_ops", "fuse_relu_depthwise_conv",
                   "enable_auto_fusion", "fuse_gemm_epilogue", "fuse_dropout_add")


@dataclass
class BuildStrategyConfig:
    """Fleet's BuildStrategy: graph passes of Paddle's static-graph executor. In PyTorch, any of
    the op-fusion flags compiles the model with torch.compile (whose inductor backend fuses
    elementwise ops, activations, norms and epilogues into generated kernels)."""

    fuse_elewise_add_act_ops: bool = False
    """Fuse an elementwise add with its activation: torch.compile."""
    fuse_bn_act_ops: bool = False
    """Fuse batch norm with its activation: torch.compile."""
    fuse_relu_depthwise_conv: bool = False
    """Fuse ReLU into a depthwise convolution: torch.compile."""
    enable_auto_fusion: bool = False
    """Fuse elementwise subgraphs automatically: torch.compile."""
    fuse_gemm_epilogue: bool = False
    """Fuse the bias add and activation after a matmul: torch.compile."""
    fuse_dropout_add: bool = False
    """Fuse dropout with the residual add: torch.compile."""
    fuse_all_optimizer_ops: bool = False
    """Update all parameters in few kernels: the optimizer's foreach implementation (where it has one)."""
    enable_inplace: bool = False
    """Reuse variables' memory in place: no effect (PyTorch's caching allocator reuses freed memory itself)."""


@dataclass
class ExecutionStrategyConfig:
    """Fleet's ExecutionStrategy: the static-graph executor's threads and scopes."""

    num_threads: int = 0
    """torch.set_num_threads on every rank; 0 leaves torch's default (Fleet's default is 1)."""
    num_iteration_per_drop_scope: int = 10
    """No effect: PyTorch frees a step's temporaries when they go out of scope (no scopes to drop)."""
    num_iteration_per_run: int = 1
    """No effect: PyTorch runs one step per Python call (the closest knob, logging, is trainer.log_every_n_steps)."""

    def __post_init__(self) -> None:
        require(self.num_threads >= 0, "collective.execution_strategy.num_threads", self.num_threads, "must be >= 0")
        for name in ("num_iteration_per_drop_scope", "num_iteration_per_run"):
            require(getattr(self, name) >= 1, f"collective.execution_strategy.{name}", getattr(self, name),
                    "must be >= 1")


@dataclass
class CollectiveConfig:
    """Fleet's collective-training knobs, each carried out by the PyTorch mechanism that does the
    job, or accepted with no effect where torch does it itself (docs/collective.md)."""

    fuse_all_reduce_ops: bool = True
    """Fuse gradients into buckets for the allreduce: DDP's gradient buckets (false: tiny buckets, about one tensor each)."""
    fuse_grad_size_in_MB: float = 32.0
    """Size of a fused gradient bucket: DDP's bucket_cap_mb."""
    fuse_grad_size_in_TFLOPS: float = 50.0
    """No effect: DDP starts a bucket's allreduce when its gradients are ready, not after a FLOP count."""
    sync_nccl_allreduce: bool = True
    """No effect: torch's NCCL process group runs collectives on its own stream, overlapping compute."""
    nccl_comm_num: int = 1
    """No effect: torch uses one NCCL communicator per process group."""
    use_hierarchical_allreduce: bool = False
    """Two-level allreduce. Sharded runs: hybrid sharding's 2-D mesh, sharding within groups of
    hierarchical_allreduce_inter_nranks ranks and replicated across them (sets strategy.sharding's
    degree and dp_degree); DDP has no two-level allreduce (no effect, said in build.yaml)."""
    hierarchical_allreduce_inter_nranks: int = 1
    """Ranks per inner group of the two-level allreduce (1: a node's processes, trainer.devices, as in Fleet)."""
    sync_batch_norm: bool = False
    """Synchronise batch-norm statistics across processes: Lightning's sync_batchnorm (SyncBatchNorm)."""
    find_unused_parameters: bool = False
    """Let DDP skip parameters that get no gradient in a step: DDP's find_unused_parameters."""
    cudnn_exhaustive_search: bool = False
    """Try every cuDNN convolution algorithm: torch.backends.cudnn.benchmark (Trainer benchmark); CUDA
    only. A CUDA run turns it on anyway unless trainer.benchmark or trainer.deterministic says
    otherwise; true insists (refused beside trainer.benchmark=false)."""
    conv_workspace_size_limit: int = 512
    """No effect: torch sizes cuDNN workspaces itself (no limit knob)."""
    cudnn_batchnorm_spatial_persistent: bool = False
    """No effect: torch picks the cuDNN batch-norm mode itself."""
    gpu_memory_fraction: Optional[float] = None
    """Fraction of each GPU's memory the process may use (Fleet's FLAGS_fraction_of_gpu_memory_to_use):
    torch.cuda.set_per_process_memory_fraction; CUDA only. None: no limit."""
    timeout_s: Optional[float] = None
    """Seconds a rank waits in a collective (or for the others at start-up) before the run fails
    with that rank's timeout error: the process group's timeout. None: torch's default (10 min
    for NCCL, 30 min for gloo). Not a Fleet field."""
    build_strategy: BuildStrategyConfig = field(default_factory=BuildStrategyConfig)
    """Fleet's BuildStrategy (graph passes): op fusion through torch.compile."""
    execution_strategy: ExecutionStrategyConfig = field(default_factory=ExecutionStrategyConfig)
    """Fleet's ExecutionStrategy: torch's thread count."""

    def __post_init__(self) -> None:
        require(self.fuse_grad_size_in_MB > 0, "collective.fuse_grad_size_in_MB", self.fuse_grad_size_in_MB,
                "must be > 0")
        require(self.fuse_grad_size_in_TFLOPS > 0, "collective.fuse_grad_size_in_TFLOPS",
                self.fuse_grad_size_in_TFLOPS, "must be > 0")
        require(self.nccl_comm_num >= 1, "collective.nccl_comm_num", self.nccl_comm_num, "must be >= 1")
        require(self.hierarchical_allreduce_inter_nranks >= 1, "collective.hierarchical_allreduce_inter_nranks",
                self.hierarchical_allreduce_inter_nranks, "must be >= 1")
        require(self.conv_workspace_size_limit >= 0, "collective.conv_workspace_size_limit",
                self.conv_workspace_size_limit, "must be >= 0")
        fraction = self.gpu_memory_fraction
        require(fraction is None or 0 < fraction <= 1, "collective.gpu_memory_fraction", fraction, "must be in (0, 1]")
        require(self.timeout_s is None or self.timeout_s > 0, "collective.timeout_s", self.timeout_s,
                "must be > 0 (or null: torch's default)")

    @property
    def fusion_flags(self) -> List[str]:
        """The op-fusion flags that are on: torch.compile is PyTorch's op fusion."""
        return [flag for flag in OP_FUSION_FLAGS if getattr(self.build_strategy, flag)]

    def tunes_cudnn(self, run: RunShape) -> Optional[str]:
        """Why the run turns cudnn.benchmark on (None: it does not). A plain loop on a GPU does for
        convolutions (cuDNN then times its algorithms for each new input shape and keeps the
        fastest; measured on an H200, ResNet-50 trained at 0.90 of the speed without it); a run that
        asks for determinism, or sets trainer.benchmark itself, keeps what it asked for. The device
        is asked only when nothing else settles it."""
        if self.cudnn_exhaustive_search:
            require(run.trainer.benchmark is not False, "collective.cudnn_exhaustive_search", True,
                    "trainer.benchmark=false says the opposite; set only one of them")
            return "collective.cudnn_exhaustive_search=true"
        if run.trainer.benchmark is not None or run.trainer.deterministic not in (None, False):
            return None
        if run.device_type != "cuda":
            return None
        return ("a CUDA run: convolutions take cuDNN's fastest algorithm for each input shape "
                "(trainer.benchmark=false or trainer.deterministic=true keeps it off)")

    def contribute(self, run: RunShape, compile_mode: str = FastPathConfig.compile_mode) -> Contribution:
        """The knobs' part of the plan. sync_batch_norm is Lightning's sync_batchnorm on CUDA only
        (DDP refuses SyncBatchNorm elsewhere: the rank says so); trainer.sync_batchnorm is false
        unless set (trainer=ddp sets it), so either one asking turns it on. cudnn.benchmark:
        `tunes_cudnn`. An op-fusion flag asks for the fast path's compile, in fast_path.compile_mode."""
        contribution = Contribution()
        if self.sync_batch_norm and run.device_type == "cuda":
            contribution.trainer_args["sync_batchnorm"] = True
        why = self.tunes_cudnn(run)
        if why:
            contribution.trainer_args["benchmark"] = True
            contribution.notes.append(f"cudnn.benchmark on: {why}")
        if run.lightning_strategy == LIGHTFLEET_DDP.target:
            contribution.lightning_strategy_args.update(
                bucket_cap_mb=self.fuse_grad_size_in_MB if self.fuse_all_reduce_ops else UNFUSED_BUCKET_MB,
                find_unused_parameters=self.find_unused_parameters)
        if run.lightning_strategy is not None and self.timeout_s is not None:
            contribution.lightning_strategy_args["timeout_s"] = self.timeout_s
        if self.fusion_flags:
            contribution.model_transforms.append(
                compile_transform(run, compile_mode, f"collective.build_strategy.{self.fusion_flags[0]}"))
        if self.build_strategy.fuse_all_optimizer_ops:
            contribution.optimizer_transforms.append(Component("plugins.collective:use_foreach"))
        on_device = {"num_threads": self.execution_strategy.num_threads,
                     "gpu_memory_fraction": self.gpu_memory_fraction,
                     "cudnn_exhaustive_search": self.cudnn_exhaustive_search,
                     "sync_batch_norm": self.sync_batch_norm and "sync_batchnorm" not in contribution.trainer_args}
        if any(on_device.values()):
            contribution.callbacks.append(Component("plugins.collective:CollectiveSetup", on_device))
        return contribution


PARAMETER_SERVER_MODES = ("none", "sync", "geo", "async", "half_async")
NEEDS_SERVERS = ("async", "half_async")
NO_SERVERS = ("asynchronous updates need parameter-server processes, which lightfleet does not run "
              "(PyTorch's mechanism for them, torch.distributed.rpc, is no longer maintained); use "
              "parameter_server.mode=geo with parameter_server.k_steps=K (local SGD: parameters averaged every "
              "K steps), strategy=[adaptive_localsgd] or parameter_server.mode=sync")


@dataclass
class ParameterServerConfig:
    """Fleet's parameter-server modes (`a_sync`, `a_sync_configs.k_steps`) in collective terms:
    lightfleet runs no server processes (docs/fleet.md)."""

    mode: str = "none"
    """none (the default): collective training; sync (Fleet: a_sync false, k_steps 0): data
    parallelism, gradients averaged every step; geo (a_sync true, k_steps > 0): GEO-SGD as strategy localsgd, parameters averaged every k_steps;
    async (a_sync true, k_steps 0) and half_async: refused, they need parameter servers."""
    k_steps: int = 0
    """GEO-SGD's local steps between two synchronisations (Fleet's a_sync_configs.k_steps): localsgd's k_steps; geo only."""

    def __post_init__(self) -> None:
        require(self.mode in PARAMETER_SERVER_MODES, "parameter_server.mode", self.mode,
                f"choose from: {', '.join(PARAMETER_SERVER_MODES)}", PARAMETER_SERVER_MODES)
        require(self.mode not in NEEDS_SERVERS, "parameter_server.mode", self.mode, NO_SERVERS)
        if self.mode == "geo":
            require(self.k_steps >= 1, "parameter_server.k_steps", self.k_steps, "must be >= 1 with mode=geo")
        else:
            require(self.k_steps == 0, "parameter_server.k_steps", self.k_steps,
                    f"only parameter_server.mode=geo takes k_steps (mode is {self.mode})")

    def note(self) -> Optional[str]:
        """The plan's line on what the mode became."""
        if self.mode == "sync":
            return ("parameter_server.mode=sync: Fleet's synchronous parameter-server training runs as data "
                    "parallelism (gradients averaged by allreduce every step)")
        if self.mode == "geo":
            return (f"parameter_server.mode=geo: Fleet's GEO-SGD runs as strategy localsgd (each process steps "
                    f"alone; parameters averaged every k_steps={self.k_steps} steps)")
        return None


def collective_knobs(config: Any) -> Dict[str, Any]:
    """Every knob of `config` (a CollectiveConfig, or its mapping as config.yaml saves it) by its
    key under collective: fuse_grad_size_in_MB, build_strategy.fuse_bn_act_ops, ..."""
    knobs: Dict[str, Any] = {}
    for name, value in (asdict(config) if isinstance(config, CollectiveConfig) else config).items():
        nested = value.items() if isinstance(value, dict) else [(None, value)]
        knobs.update((f"{name}.{inner}" if inner else name, item) for inner, item in nested)
    return knobs
