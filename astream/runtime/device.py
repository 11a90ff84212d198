"""The device as a parameter: streams, events and device-to-host readback.

On CUDA, events are real `torch.cuda.Event`s created with blocking sync, so a
thread that waits on one sleeps instead of spinning. On the CPU every operation
has already finished when it returns, so events are born complete; the same
engine code runs on both.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import anyio
import anyio.to_thread
import torch

from astream.runtime.events import Event

T = TypeVar("T")

log = logging.getLogger("astream")


class CompletedEvent:
    """The CPU stand-in for a device event: always complete."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@dataclass(slots=True)
class DeviceRuntime:
    device: torch.device
    # CPU compute runs on this one thread. Torch's OpenMP pool spins after each
    # parallel region, and every new calling thread gets a pool of its own, so
    # compute hopping between threads leaves idle pools spinning on the cores.
    _cpu_worker: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run device work without blocking the event loop: on CUDA it only enqueues, so it
        runs inline; on the CPU it computes on the runtime's worker thread."""
        if self.is_cuda:
            return fn(*args)
        if self._cpu_worker is None:
            self._cpu_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="astream-cpu")
        future = self._cpu_worker.submit(fn, *args)
        # The anyio worker only waits on the future; it never touches torch.
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    def close(self) -> None:
        if self._cpu_worker is not None:
            self._cpu_worker.shutdown(wait=True, cancel_futures=True)
            self._cpu_worker = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def record_event(self, stream: torch.cuda.Stream | None = None) -> Event:
        """An event marking the work queued so far on `stream` (default: the current stream)."""
        if not self.is_cuda:
            return CompletedEvent()
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Event]:
        """Start copying `tensor` to pinned host memory; returns (host tensor, event). The
        event also marks every copy queued before it by `copy_to_host`."""
        return self.copy_to_host(tensor), self.record_event()

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Start copying `tensor` to pinned host memory, valid once a later event completes."""
        if not self.is_cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def new_stream(self, priority: int = 0) -> torch.cuda.Stream | None:
        """A stream (None on the CPU); a negative priority is a higher one."""
        return torch.cuda.Stream(self.device, priority=priority) if self.is_cuda else None

    def on(self, stream: torch.cuda.Stream | None):
        """Context manager: queue work on `stream` (a no-op on the CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def wait(self, event: Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: current) wait for `event`, on the device, not the host."""
        if self.is_cuda and event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def synchronize(self) -> None:
        """Only for start-up, shutdown and tests, never on a hot path."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def drain(self, timeout_s: float) -> bool:
        """`synchronize`, for at most `timeout_s` seconds: whether the device went idle. The
        wait runs on a helper thread, left behind where it does not end (a kernel that waits
        on another process's device, say). A device that fails instead counts as idle: it
        runs nothing more."""
        if not self.is_cuda:
            return True
        done = threading.Event()

        def wait() -> None:
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as exc:
                log.warning("astream: waiting for the device failed: %s", exc)
            done.set()

        threading.Thread(target=wait, name="astream-drain", daemon=True).start()
        return done.wait(timeout_s)
