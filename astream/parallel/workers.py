"""Rank 0's view of the other tensor-parallel ranks: it spawns them, agrees the KV cache
size with them, hands them each step and stops them.

A step's inputs reach each rank once, as one pickled HostInputs (a few small integer
arrays) written to that rank's pipe, which it then sends to its own device. The pipe is
also how a rank learns that rank 0 is gone (end of file), and rank 0 watches every
process's sentinel, so a dead rank is named, never waited for.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch

from astream.config import EngineConfig
from astream.errors import TensorParallelError
from astream.executor.inputs import HostInputs
from astream.kvcache.sizing import CachePlan
from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TensorParallel
from astream.parallel.group import COLLECTIVE_TIMEOUT_S, free_port, join_group, leave_group
from astream.parallel.worker import worker_main

STOP_GRACE_S = 5.0         # a rank asked to stop may finish its step; then it is terminated
DEATH_WAIT_S = 2.0         # after a failed collective: how long a dying rank may take to exit


@dataclass(slots=True)
class WorkerGroup:
    """Ranks 1..size-1, each a spawned process with a pipe; `tp` is rank 0's own shard."""

    processes: list[multiprocessing.Process]
    pipes: list[Connection]
    tp: TensorParallel | None = None
    errors: dict[int, str] = field(default_factory=dict)     # rank -> its last words
    closed: bool = False

    @classmethod
    def start(cls, config: EngineConfig, path: str, model: ModelConfig,
              device: torch.device) -> "WorkerGroup":
        """Spawn the other ranks and join the process group with them as rank 0."""
        size, port = config.tensor_parallel_size, free_port()
        context = multiprocessing.get_context("spawn")
        group = cls([], [])
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, name=f"astream-tp-rank{rank}",
                                      args=(rank, size, port, config, str(path), theirs),
                                      daemon=True)
            process.start()
            theirs.close()
            group.processes.append(process)
            group.pipes.append(ours)
        try:
            group.tp = group._join(size, port, model, device)
        except BaseException:
            group.close()
            raise
        return group

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def agree(self, plan: CachePlan) -> CachePlan:
        """Every rank sized its own cache; all take the smallest, so block ids mean the same
        everywhere (the scheduler on rank 0 hands them out)."""
        plans = [plan] + [self._receive(rank, "loaded") for rank in self._ranks()]
        chosen = min(plans, key=lambda p: (p.num_blocks, p.max_model_len))
        for pipe in self.pipes:
            pipe.send(("plan", chosen))
        for rank in self._ranks():
            self._receive(rank, "ready")
        return chosen

    def send(self, inputs: HostInputs) -> None:
        """Hand every other rank the step rank 0 is about to run."""
        payload = pickle.dumps(inputs, pickle.HIGHEST_PROTOCOL)    # once, for every rank
        for rank, pipe in zip(self._ranks(), self.pipes):
            try:
                if not self.processes[rank - 1].is_alive():
                    raise ConnectionError("the process is gone")
                pipe.send_bytes(payload)
            except (OSError, ConnectionError) as exc:
                raise self.failed(exc) from exc

    def failed(self, error: BaseException) -> Exception:
        """A step failed after it had started on every rank: name the dead rank if one died,
        and stop them all."""
        if self.closed:
            return TensorParallelError(f"the tensor-parallel ranks were stopped: {error}")
        wait([p.sentinel for p in self.processes], timeout=DEATH_WAIT_S)
        dead = [(rank, p.exitcode) for rank, p in zip(self._ranks(), self.processes)
                if p.exitcode is not None]
        self._collect_errors()
        self.close()
        if not dead:
            return TensorParallelError(f"a tensor-parallel step failed on rank 0 "
                                       f"({type(error).__name__}: {error}); the engine stops")
        rank, code = dead[0]
        last = self.errors.get(rank, "").strip().splitlines()
        cause = f": {last[-1]}" if last else ""
        return TensorParallelError(f"tensor-parallel rank {rank} died (exit code {code}){cause}; "
                                   "the engine stops")

    def close(self) -> None:
        """Stop every rank (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        leave_group()

    def _ranks(self) -> range:
        return range(1, len(self.processes) + 1)

    def _join(self, size: int, port: int, model: ModelConfig, device: torch.device) -> TensorParallel:
        """Join the group on a helper thread while watching the ranks: one that dies before
        it joins would otherwise hold rank 0 in the rendezvous until it times out."""
        joined: list = []

        def join() -> None:
            try:
                joined.append(join_group(0, size, port, device, model))
            except BaseException as exc:
                joined.append(exc)

        thread = threading.Thread(target=join, name="astream-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            for rank, process in zip(self._ranks(), self.processes):
                if process.exitcode is not None:
                    self._collect_errors()
                    raise TensorParallelError(self._startup_death(rank, process.exitcode))
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def _receive(self, rank: int, kind: str):
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        wait([pipe, process.sentinel], timeout=COLLECTIVE_TIMEOUT_S)
        try:
            if pipe.poll():
                got, value = pipe.recv()
                if got == kind:
                    return value
                if got == "error":
                    self.errors[rank] = value
        except (EOFError, OSError):
            pass
        process.join(DEATH_WAIT_S)
        raise TensorParallelError(self._startup_death(rank, process.exitcode))

    def _startup_death(self, rank: int, code: int | None) -> str:
        detail = self.errors.get(rank, "").strip()
        state = "did not answer" if code is None else f"died (exit code {code})"
        if not detail:       # it died before it could say why, e.g. in spawn's re-import of __main__
            detail = ("its traceback is on stderr; a script that starts a tensor-parallel engine "
                      "must do so under `if __name__ == \"__main__\":`, as spawned processes "
                      "import the script again")
        return f"tensor-parallel rank {rank} {state} while starting: {detail}"

    def _collect_errors(self) -> None:
        for rank, pipe in zip(self._ranks(), self.pipes):
            try:
                while pipe.poll():
                    got, value = pipe.recv()
                    if got == "error":
                        self.errors[rank] = value
            except (EOFError, OSError, ValueError, TypeError):
                continue
