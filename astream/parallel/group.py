"""The torch.distributed process group of one engine: gloo on the CPU, NCCL on CUDA,
its rendezvous on a free loopback port, or through env:// ($MASTER_ADDR, $MASTER_PORT)
when the ranks span several hosts."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TensorParallel, TPShard

# A collective waits this long for a rank that neither answers nor dies (a dead rank's
# closed sockets end it at once). Idle ranks wait on their pipe, never in a collective.
COLLECTIVE_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r (its index on its own host) computes on the r-th GPU after the first one's
    (the same CPU on the CPU)."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def join_group(rank: int, size: int, port: int | None, device: torch.device,
               model: ModelConfig) -> TensorParallel:
    """Join the engine's process group (every rank calls this) as rank `rank` of `size`:
    on loopback port `port`, or, with None, through env:// (ranks on several hosts)."""
    init_group(rank, size, port, device)
    return TensorParallel(TPShard(rank, size, model))


def init_group(rank: int, size: int, port: int | None, device: torch.device) -> None:
    """`join_group` before this rank knows the model's shape."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel engine per process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def share_from_rank0(value: object = None) -> object:
    """Every rank calls this once; all get rank 0's `value` (any picklable object)."""
    values = [value]
    dist.broadcast_object_list(values, src=0)
    return values[0]


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
