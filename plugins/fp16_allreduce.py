"""Half-precision gradient communication (Fleet `strategy.fp16_allreduce`) as torch's DDP
compress hooks.

Each gradient bucket is cast to float16 (or bfloat16), divided by the world size, all-reduced in
16 bits and copied back into the float32 bucket: half the bytes on the wire, and gradients whose
values are exactly representable in the wire type. bfloat16 keeps float32's range (no overflow of
large gradients, no underflow of tiny ones) at 8 bits of mantissa instead of float16's 11.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook

from plugins import traffic


HOOKS = {"float16": fp16_compress_hook, "bfloat16": bf16_compress_hook}


def build_hook(dtype: str) -> Tuple[Optional[object], Callable]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook`, called once the process
    group exists. The state is the process group the hook reduces over: None, the world group.
    `dtype` comes checked by FP16AllreduceConfig (runner/strategies/fp16_allreduce.py)."""
    hook = HOOKS[dtype]
    if dtype == "bfloat16" and dist.is_initialized() and dist.get_backend() == "gloo":
        hook = gloo_bf16_compress_hook
    return None, traffic.counted_compress_hook(hook, getattr(torch, dtype))


def gloo_bf16_compress_hook(process_group, bucket):  # no annotations: DDP checks them, and these would be strings
    """torch's `bf16_compress_hook` under another name, for gloo. DDP refuses a hook named
    bf16_compress_hook unless CUDA with NCCL >= 2.10 (or XPU with XCCL) is present, a check meant
    for NCCL's bfloat16 support; gloo reduces bfloat16 tensors itself."""
    return bf16_compress_hook(process_group, bucket)
