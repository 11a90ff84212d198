"""The torch.distributed process group of one engine: gloo on the CPU, NCCL on CUDA,
its rendezvous on a free loopback port, or through env:// ($MASTER_ADDR, $MASTER_PORT)
when the ranks span several hosts."""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TensorParallel, TPShard

# A collective waits this long for a rank that neither answers nor dies (a dead rank's
# closed sockets end it at once). Idle ranks wait on their pipe, never in a collective.
COLLECTIVE_TIMEOUT_S = 300
# Leaving an NCCL group waits at most this long for its communicator's teardown.
LEAVE_WAIT_S = 15.0

log = logging.getLogger("astream")


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


def teardown(backend: str) -> str:
    """How a rank leaves a group of `backend`: "abort" its NCCL communicator, or "destroy"
    (gloo)."""
    return "abort" if backend == "nccl" else "destroy"


def leave_group(release: Callable[[], object] = lambda: None, wait_s: float = LEAVE_WAIT_S) -> bool:
    """Leave the engine's process group, once this rank takes no more steps (every rank does,
    at about the same time: WorkerGroup.close). `release` drops this rank's CUDA graphs
    (executor.build.release_graphs) on the way. Afterwards this process may join another
    group. Returns False where an NCCL teardown did not end within `wait_s` seconds (it
    carries on in the background; the process is then still in the group)."""
    if not dist.is_initialized():
        release()
        return True
    if teardown(dist.get_backend()) == "destroy":
        release()
        dist.destroy_process_group()
        return True
    # NCCL: abort, never destroy_process_group. Destroying finalizes the communicator: it
    # waits for every collective queued on it to complete, which none does once a rank is
    # gone mid-step. An abort tells NCCL's kernels to quit and frees the communicator without
    # a flush. Two waits remain inside NCCL even so: for every CUDA graph that captured one of
    # the communicator's collectives to be destroyed, and for the host's other ranks to close
    # their connections to this one. Hence the order: the ranks leave together (rank 0 does
    # not wait for the others to exit first: WorkerGroup.close); here the abort starts on a
    # helper thread (stopping NCCL's kernels first, so the device drains), the graphs are
    # destroyed on this one, and the wait for the abort is bounded.
    outcome: list[BaseException | None] = []

    def abort() -> None:
        try:
            abort_group()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    helper = threading.Thread(target=abort, name="astream-tp-abort", daemon=True)
    helper.start()
    try:
        release()
    finally:
        helper.join(wait_s)
    if not outcome:
        log.warning("astream: the NCCL communicator did not tear down within %.0f s (a CUDA "
                    "graph holding its collectives still alive, or a rank that has not left); "
                    "going on without it", wait_s)
        return False
    if outcome[0] is not None:
        log.warning("astream: aborting the NCCL communicator failed: %r", outcome[0])
        return False
    return True


def abort_group() -> None:
    """Abort the default group's communicators and forget the group: torch's
    `_abort_process_group`, which clears what destroy_process_group clears; on a torch older
    than it, destroy_process_group, the only teardown there is."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        dist.destroy_process_group()
    else:
        abort()
