"""Rank 0's watch over the other ranks, from a thread of its own: this host's by their
processes, other hosts' by a connection each holds to rank 0 that carries nothing, so that
it becomes readable only as it closes, when that rank's process ends.

A rank that dies is found by its process's sentinel (or its connection's end), whatever rank
0 is doing meanwhile.
That matters where rank 0 waits inside the device: over NCCL a collective whose peer is
gone never completes (its kernel spins on the peer's memory), so rank 0 would sit in a
device synchronize (a graph capture's warm-up), a step's event or a release's drain until
NCCL's timeout. The watch then aborts rank 0's communicators (group.abort_collectives):
the kernels quit, those waits return, and the next look at the watch (WorkerGroup.check,
or a step's failure) names the rank.
"""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable


@dataclass(slots=True)
class RankWatch:
    """Watches `processes` (rank -> process) and `connections` (rank -> its silent connection)
    until `stop`; the first to end before then is `dead`, and `on_death(rank)` runs on the
    watch's thread."""

    processes: dict[int, multiprocessing.Process]
    on_death: Callable[[int], object]
    connections: dict[int, Connection] = field(default_factory=dict)
    dead: int | None = None
    _wake: tuple[Connection, Connection] | None = None
    _thread: threading.Thread | None = None
    _stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, processes: dict[int, multiprocessing.Process], on_death: Callable[[int], object],
              connections: dict[int, Connection] | None = None) -> "RankWatch":
        watch = cls(processes, on_death, dict(connections or {}),
                    _wake=multiprocessing.Pipe(duplex=False))
        watch._thread = threading.Thread(target=watch._run, name="astream-tp-watch", daemon=True)
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """No more deaths: the ranks are being stopped, and their exits are expected. Does not
        wait for an `on_death` under way (an NCCL abort may wait for the graphs the caller
        is about to release)."""
        with self._lock:
            if not self._stopped and self.dead is None:
                self._wake[1].send_bytes(b"")
            self._stopped = True

    def _run(self) -> None:
        watched: dict = {process.sentinel: rank for rank, process in self.processes.items()}
        watched.update({conn: rank for rank, conn in self.connections.items()})
        try:
            ready = wait([self._wake[0], *watched])
            with self._lock:
                if self._stopped:
                    return
                self.dead = min(watched[s] for s in ready if s in watched)
        finally:
            with self._lock:
                # After `stop` has sent its byte, or once a death is recorded (stop sends none
                # then): nothing writes to the pipe again.
                if self._stopped or self.dead is not None:
                    for end in self._wake:
                        end.close()
        self.on_death(self.dead)
