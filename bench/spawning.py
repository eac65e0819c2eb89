"""What the multi-process benchmarks (comm.py, sharding.py, pipeline.py) share: a free port for
the rendezvous of the processes they spawn, and the machine description their results carry."""
from __future__ import annotations

import os
import platform
import socket
from typing import Any, Dict

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine() -> Dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
