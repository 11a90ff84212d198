"""The torch.distributed process group of one engine: gloo on the CPU, NCCL on CUDA,
its rendezvous on a loopback port rank 0's store binds, or through env:// ($MASTER_ADDR,
$MASTER_PORT) when the ranks span several hosts."""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TensorParallel, TPShard

# A collective waits this long for a rank that neither answers nor dies (a dead rank's
# closed sockets end it at once over gloo; over NCCL rank 0's watch aborts it:
# parallel.liveness). Idle ranks wait on their pipe, never in a collective.
COLLECTIVE_TIMEOUT_S = 300
# Leaving an NCCL group waits at most this long for its communicator's teardown.
LEAVE_WAIT_S = 15.0
# Set in every rank before it joins (a user's own setting wins).
# - ASYNC_ERROR_HANDLING 2: a failure NCCL's watchdog finds itself (a collective past its
#   timeout) aborts the communicator, so whatever waits on it returns and the engine names
#   the failure; torch's default (3) kills the whole process instead, engine and API with it.
# - DUMP_ON_TIMEOUT 0: no flight-recorder dump, and so no polling of rank 0's store by the
#   other ranks' monitors, which warn once rank 0 has closed it at a clean close.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}

log = logging.getLogger("astream")
# Serializes this process's teardowns of its group: rank 0's watch may abort the
# communicator while the engine's thread leaves the group.
_teardown = threading.Lock()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store for `size` ranks on one host, on a loopback port the OS
    picks as it binds (`.port`): a port chosen first and bound later may be taken between
    the two."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r (its index on its own host) computes on the r-th GPU after the first one's
    (the same CPU on the CPU)."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def join_group(rank: int, size: int, port: int | None, device: torch.device,
               model: ModelConfig, store: dist.Store | None = None) -> TensorParallel:
    """Join the engine's process group (every rank calls this) as rank `rank` of `size`:
    through the store on loopback port `port` (rank 0 passes its own, `open_store`), or,
    with None, through env:// (ranks on several hosts)."""
    init_group(rank, size, port, device, store)
    return TensorParallel(TPShard(rank, size, model))


def init_group(rank: int, size: int, port: int | None, device: torch.device,
               store: dist.Store | None = None) -> None:
    """`join_group` before this rank knows the model's shape. Rank 0 without a store binds
    `port` itself."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel engine per process")
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    options: dict = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
        # The communicator is made now, inside the join rank 0 watches, not lazily in the
        # first collective, where a rank that died before it would hold rank 0 for good.
        options["device_id"] = device
    if port is None:
        options["init_method"] = "env://"
    else:
        options["store"] = store or dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=size, timeout=timeout, **options)


def share_from_rank0(value: object = None) -> object:
    """Every rank calls this once; all get rank 0's `value` (any picklable object)."""
    values = [value]
    dist.broadcast_object_list(values, src=0)
    return values[0]


def teardown(backend: str, clean: bool) -> str:
    """How a rank leaves a group of `backend`: "destroy" it at once (gloo); over NCCL, where
    `clean`, "shutdown" (destroy it once the graphs are gone), else "abort" its
    communicator."""
    if backend != "nccl":
        return "destroy"
    return "shutdown" if clean else "abort"


def leave_group(release: Callable[[], object] = lambda: None, wait_s: float = LEAVE_WAIT_S,
                clean: bool = False) -> bool:
    """Leave the engine's process group, once this rank takes no more steps (every rank does,
    at about the same time: WorkerGroup.close). `release` drops this rank's CUDA graphs
    (executor.build.release_graphs) on the way. `clean`: every rank is alive and idle and
    leaves with this one. Afterwards this process may join another group. Returns False
    where an NCCL teardown did not end within `wait_s` seconds (it carries on in the
    background; the process is then still in the group)."""
    if not dist.is_initialized():
        release()
        return True
    mode = teardown(dist.get_backend(), clean)
    if mode == "destroy":
        release()
        with _teardown:
            if dist.is_initialized():
                dist.destroy_process_group()
        return True
    # NCCL frees a communicator, destroyed or aborted, only once every CUDA graph that
    # captured one of its collectives is destroyed and the host's other ranks have closed
    # their connections to it: the ranks leave together (rank 0 does not wait for the others
    # to exit first: WorkerGroup.close), each destroying its graphs on the way, and the wait
    # for the teardown is bounded.
    # A clean leave destroys the group: it finalizes the communicator (nothing is in flight)
    # and stops NCCL's watchdog before freeing it, so nothing is reported. An abort flags the
    # communicator as failed first, and the watchdog of this rank or another may then print
    # an "unhandled system error" trace; but only an abort ends when a rank is gone mid-step
    # (a destroy's flush waits for collectives that never complete), so it is the way out
    # of every leave that is not clean. It starts on the helper thread before the graphs go
    # (stopping NCCL's kernels first, so the device drains); a shutdown, after.
    outcome: list[BaseException | None] = []

    def leave() -> None:
        try:
            with _teardown:
                if dist.is_initialized():
                    (dist.destroy_process_group if mode == "shutdown" else abort_group)()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    helper = threading.Thread(target=leave, name=f"astream-tp-{mode}", daemon=True)
    if mode == "abort":
        helper.start()
    try:
        release()
    finally:
        if mode == "shutdown":
            helper.start()
        helper.join(wait_s)
    if not outcome:
        log.warning("astream: the NCCL communicator did not tear down (%s) within %.0f s (a "
                    "CUDA graph holding its collectives still alive, or a rank that has not "
                    "left); going on without it", mode, wait_s)
        return False
    if outcome[0] is not None:
        log.warning("astream: leaving the NCCL group (%s) failed: %r", mode, outcome[0])
        return False
    return True


def abort_collectives() -> None:
    """Abort this rank's communicators where they are, from any thread: NCCL's kernels quit,
    so a collective, a device synchronize or an event that waits on a rank that is gone
    returns (its result is garbage, and the communicator takes no more collectives). The
    group stays this process's until it leaves (`leave_group`). A gloo collective needs
    none of this: a dead rank's closed sockets end it."""
    with _teardown:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            world = dist.group.WORLD
            abort = getattr(world, "abort", None) or world._get_backend(torch.device("cuda")).abort
            abort()


def abort_group() -> None:
    """Abort the default group's communicators and forget the group: torch's
    `_abort_process_group`, which clears what destroy_process_group clears; on a torch older
    than it, destroy_process_group, the only teardown there is."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        dist.destroy_process_group()
    else:
        abort()
