"""Rank 0's view of the other tensor-parallel ranks: it spawns them, agrees the KV cache
size with them, hands them each step and stops them.

A step reaches each rank once, as one pickled HostStep (its inputs as a few small integer
arrays and, with offload, the offload plan's host lists) written to that rank's pipe (a
connection to rank 0's step channel for a rank on another host), which it then sends to
its own device. The pipe is
also how a rank learns that rank 0 is gone (end of file), and rank 0 watches every
process's sentinel, so a dead rank is named, never waited for: from a thread of its own
(parallel.liveness) once the group has formed, which also frees rank 0 from a collective
that waits on the dead rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, Listener, wait

import torch

from astream.base.config import EngineConfig
from astream.base.errors import TensorParallelError
from astream.executor.build import GraphSpec, capture_graphs, release_graphs
from astream.executor.graph_sampling import step_keys
from astream.executor.runner import HostStep, ModelRunner
from astream.kvcache.sizing import CachePlan
from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TensorParallel
from astream.parallel.group import (COLLECTIVE_TIMEOUT_S, abort_collectives, join_group,
                                    leave_group, open_store, share_from_rank0)
from astream.parallel.liveness import RankWatch
from astream.parallel.worker import Stop, worker_main
from astream.runtime.device import DeviceRuntime

STOP_GRACE_S = 5.0         # a rank asked to stop may finish its step; then it is terminated
DEATH_WAIT_S = 2.0         # after a failed collective: how long a dying rank may take to exit

log = logging.getLogger("astream")


@dataclass(slots=True)
class WorkerGroup:
    """Ranks 1..size-1, indexed by rank - 1: those on rank 0's host are spawned processes,
    each with a pipe; those on other hosts (no process here) are connections to rank 0's
    step channel. `tp` is rank 0's own shard."""

    processes: list[multiprocessing.Process | None]
    pipes: list[Connection | None]
    ranks_per_node: int
    tp: TensorParallel | None = None
    errors: dict[int, str] = field(default_factory=dict)     # rank -> its last words
    lost: set[int] = field(default_factory=set)              # other hosts' ranks whose connection closed
    silent: dict[int, Connection] = field(default_factory=dict)   # other hosts' ranks: for the watch
    out_of_step: bool = False        # a step that had reached every rank was dropped part-way
    listener: Listener | None = None                         # the step channel, with several hosts
    closed: bool = False
    graphs: object = None                                    # rank 0's captured decode graphs
    runtime: DeviceRuntime | None = None                     # rank 0's, where it has graphs
    watch: RankWatch | None = None                           # this host's ranks, once joined

    @classmethod
    def start(cls, config: EngineConfig, path: str, model: ModelConfig,
              device: torch.device) -> "WorkerGroup":
        """Spawn the other ranks of this host and join the process group with them (and with
        the ranks of other hosts) as rank 0."""
        size, local = config.tensor_parallel_size, config.ranks_per_node
        store = port = key = None
        if config.nnodes == 1:
            store = open_store(size)
            port = store.port
        else:
            address = rendezvous_address()
            key = os.urandom(32)
        context = multiprocessing.get_context("spawn")
        group = cls([None] * (size - 1), [None] * (size - 1), local)
        for rank in range(1, local):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, name=f"astream-tp-rank{rank}",
                                      args=(rank, size, port, config, str(path), theirs),
                                      daemon=True)
            process.start()
            theirs.close()
            group.processes[rank - 1] = process
            group.pipes[rank - 1] = ours
        try:
            if key is not None:
                group.listener = Listener((address, 0), authkey=key)
            group.tp = group._join(size, port, model, device, (config, str(path), key), store)
        except BaseException:
            group.close(clean=False)
            raise
        group.watch = RankWatch.start({rank: process for rank, process in
                                       zip(group._ranks(), group.processes) if process is not None},
                                      _on_death, group.silent)
        return group

    @property
    def pids(self) -> list[int]:
        """The processes of this host's other ranks."""
        return [process.pid for process in self.processes if process is not None]

    def agree(self, plan: CachePlan) -> CachePlan:
        """Every rank sized its own cache; all take the smallest, so block ids mean the same
        everywhere (the scheduler on rank 0 hands them out), and with offload the smallest
        ring: each rank sized its ring by its own device memory, and rank 0's also holds the
        sampling tails' tables. The agreed plan's `memory` is the chosen rank's (each rank
        logged its own)."""
        plans = [plan] + [self._receive(rank, "loaded") for rank in self._ranks()]
        chosen = min(plans, key=lambda p: (p.num_blocks, p.max_model_len))
        if chosen.offload is not None:
            ring = min((p.offload for p in plans), key=lambda offload: offload.slot_blocks)
            chosen = replace(chosen, offload=ring)
        for pipe in self.pipes:
            pipe.send(("plan", chosen))
        for rank in self._ranks():
            self._receive(rank, "ready")
        return chosen

    def install_graphs(self, spec: GraphSpec | None, runner: ModelRunner) -> None:
        """Give every rank, rank 0's `runner` included, the decode graphs of `spec` (on CUDA,
        captured). The ranks build them at once, sizes and modes in the same order: a
        capture's warm-up runs the step's collectives, and the capture records them, so each
        rank must meet the others in the same collective. The spec goes down the steps' path,
        so a rank takes it between two steps; each answers with the whole-step graphs it
        captured, which must be rank 0's, as every step from now on replays the same graph on
        every rank. Only rank 0 captures the sampling tails after them (they hold no collective)."""
        if spec is None:
            return
        self._send_all(pickle.dumps(spec, pickle.HIGHEST_PROTOCOL))
        runner.graphs = None              # steps run eagerly until every rank has its graphs
        try:
            graphs = capture_graphs(spec, runner)     # a failed capture released its graphs
        except Exception as exc:
            raise self.failed(exc, "decode graphs' capture") from exc
        self.graphs, self.runtime = graphs, runner.runtime    # released as rank 0 leaves
        ours = step_keys(graphs.graphs)
        for rank in self._ranks():
            theirs = self._receive(rank, "graphs")
            if theirs != ours:
                raise TensorParallelError(f"tensor-parallel rank {rank} captured decode graphs "
                                          f"{theirs}, rank 0 {ours}")
        runner.graphs = graphs

    def send(self, step: HostStep) -> None:
        """Hand every other rank the step rank 0 is about to run."""
        self._send_all(pickle.dumps(step, pickle.HIGHEST_PROTOCOL))     # once, for every rank

    def _send_all(self, payload: bytes) -> None:
        for rank, pipe, process in zip(self._ranks(), self.pipes, self.processes):
            try:
                if process is not None and not process.is_alive():
                    raise ConnectionError("the process is gone")
                pipe.send_bytes(payload)
            except (OSError, ConnectionError) as exc:
                raise self.failed(exc) from exc

    def check(self) -> None:
        """Raise the TensorParallelError that names a rank the watch saw die (after which
        rank 0's device results are garbage: its collectives were aborted)."""
        if self.watch is not None and self.watch.dead is not None:
            raise self.failed(ConnectionError(f"rank {self.watch.dead} is gone"))

    def failed(self, error: BaseException, during: str = "step") -> Exception:
        """A step (or `during`) failed after it had started on every rank: name the dead rank
        if one died, and stop them all."""
        if self.closed:
            return TensorParallelError(f"the tensor-parallel ranks were stopped: {error}")
        dead = self._dead(DEATH_WAIT_S)
        self.close(clean=False)
        if not dead:
            return TensorParallelError(f"a tensor-parallel {during} failed on rank 0 "
                                       f"({type(error).__name__}: {error}); the engine stops")
        return self._named(*dead[0])

    def stop_after(self, error: BaseException) -> Exception | None:
        """Starting the engine failed with `error` once the group had formed: stop the ranks;
        the error to raise instead where a rank died, else None."""
        if self.closed or isinstance(error, TensorParallelError):
            self.close(clean=False)
            return None
        dead = self._dead(DEATH_WAIT_S if isinstance(error, RuntimeError) else 0.0)
        self.close(clean=False)
        return self._named(*dead[0]) if dead else None

    def _dead(self, wait_s: float) -> list[tuple[int, str]]:
        """The ranks that died or whose connection closed (waiting up to `wait_s` for one),
        the one the watch saw first first."""
        ready = wait([p.sentinel for p in self.processes if p is not None]
                     + [pipe for pipe, p in zip(self.pipes, self.processes) if p is None],
                     timeout=wait_s)
        for process in self.processes:
            if process is not None and process.sentinel in ready:
                process.join(DEATH_WAIT_S)     # its files close a moment before its exit shows
        self._collect_errors()
        dead = [(rank, f"died (exit code {p.exitcode})")
                for rank, p in zip(self._ranks(), self.processes)
                if p is not None and p.exitcode is not None]
        dead += [(rank, f"on node {rank // self.ranks_per_node} is gone (its connection "
                        "closed)") for rank in sorted(self.lost)]
        first = None if self.watch is None else self.watch.dead
        return sorted(dead, key=lambda item: item[0] != first)

    def _named(self, rank: int, state: str) -> TensorParallelError:
        last = self.errors.get(rank, "").strip().splitlines()
        cause = f": {last[-1]}" if last else ""
        return TensorParallelError(f"tensor-parallel rank {rank} {state}{cause}; "
                                   "the engine stops")

    def abandoned(self) -> None:
        self.out_of_step = True

    def close(self, clean: bool = True) -> None:
        """Stop every rank and leave the process group with them, releasing rank 0's decode
        graphs, then wait for this host's ranks to exit (politely, then by force). `clean`:
        the caller saw the device go idle; the ranks destroy the group then, unless a step
        was dropped part-way or a rank has died or gone meanwhile, where they abort it."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.stop()
            clean = clean and self.watch.dead is None
        clean = (clean and not self.out_of_step and not self.lost
                 and not any(p is not None and not p.is_alive() for p in self.processes))
        for pipe in self.pipes:
            try:
                if pipe is not None:
                    pipe.send(Stop(clean))
            except OSError:
                pass
        # Before waiting for the ranks: each leaves the group as it stops, and under NCCL a
        # rank's teardown ends only once every other rank of the host has left too.
        graphs, self.graphs = self.graphs, None
        leave_group(lambda: release_graphs(graphs, self.runtime), clean=clean)
        for process in self.processes:
            if process is None:
                continue
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in [*self.pipes, *self.silent.values()]:
            if pipe is not None:
                pipe.close()
        if self.listener is not None:
            self.listener.close()

    def _ranks(self) -> range:
        return range(1, len(self.processes) + 1)

    def _join(self, size: int, port: int | None, model: ModelConfig, device: torch.device,
              settings: tuple, store=None) -> TensorParallel:
        """Join the group on a helper thread while watching the ranks: one that dies before
        it joins would otherwise hold rank 0 in the rendezvous until it times out. With
        several hosts, the thread then waits for their ranks on the step channel."""
        joined: list = []

        def join() -> None:
            try:
                tp = join_group(0, size, port, device, model, store)
                if self.listener is not None:
                    share_from_rank0((self.listener.address, settings[2]))
                    self._accept(settings[:2])
                joined.append(tp)
            except BaseException as exc:
                joined.append(exc)

        thread = threading.Thread(target=join, name="astream-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.1)
            for rank, process in zip(self._ranks(), self.processes):
                if process is not None and process.exitcode is not None:
                    self._collect_errors()
                    raise TensorParallelError(self._startup_death(rank, process.exitcode))
            # Another host's rank that ends between its two connections: its silent one has
            # closed, and its steps' one will never come.
            for rank, conn in list(self.silent.items()):
                if self.pipes[rank - 1] is None and conn.poll():
                    raise TensorParallelError(self._startup_death(rank, None, remote=True))
            if time.monotonic() > deadline:
                missing = [rank for rank, pipe in zip(self._ranks(), self.pipes) if pipe is None]
                raise TensorParallelError(
                    f"tensor-parallel ranks {missing} did not join within "
                    f"{COLLECTIVE_TIMEOUT_S} s: start each other host with `astream worker "
                    "--nnodes N --node-rank K --tensor-parallel-size N` and the same "
                    "MASTER_ADDR and MASTER_PORT")
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def _accept(self, settings: tuple) -> None:
        """Take the two connections of each other host's rank: its steps' ("hello"), which
        gets rank 0's settings and checkpoint path, and a silent one for the watch ("watch")."""
        remote = [rank for rank, pipe in zip(self._ranks(), self.pipes) if pipe is None]
        while any(self.pipes[rank - 1] is None for rank in remote) or len(self.silent) < len(remote):
            conn = self.listener.accept()
            kind, rank = conn.recv()
            if rank in remote and kind == "hello" and self.pipes[rank - 1] is None:
                conn.send(settings)
                self.pipes[rank - 1] = conn
            elif rank in remote and kind == "watch" and rank not in self.silent:
                self.silent[rank] = conn
            else:
                conn.close()

    def _receive(self, rank: int, kind: str):
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        wait([pipe] if process is None else [pipe, process.sentinel], timeout=COLLECTIVE_TIMEOUT_S)
        try:
            if pipe.poll():
                got, value = pipe.recv()
                if got == kind:
                    return value
                if got == "error":
                    self.errors[rank] = value
        except (EOFError, OSError):
            pass
        code = None
        if process is not None:
            process.join(DEATH_WAIT_S)
            code = process.exitcode
        raise TensorParallelError(self._startup_death(rank, code, process is None))

    def _startup_death(self, rank: int, code: int | None, remote: bool = False) -> str:
        detail = self.errors.get(rank, "").strip()
        state = "did not answer" if code is None else f"died (exit code {code})"
        if remote:
            state = f"on node {rank // self.ranks_per_node} stopped"
            detail = detail or "its traceback is on that host's stderr"
        if not detail:       # it died before it could say why, e.g. in spawn's re-import of __main__
            detail = ("its traceback is on stderr; a script that starts a tensor-parallel engine "
                      "must do so under `if __name__ == \"__main__\":`, as spawned processes "
                      "import the script again")
        return f"tensor-parallel rank {rank} {state} while starting: {detail}"

    def _collect_errors(self) -> None:
        for rank, pipe, process in zip(self._ranks(), self.pipes, self.processes):
            if pipe is None:
                continue
            try:
                while pipe.poll():
                    got, value = pipe.recv()
                    if got == "error":
                        self.errors[rank] = value
            except (EOFError, OSError):
                if process is None:
                    self.lost.add(rank)
            except (ValueError, TypeError):
                continue


def rendezvous_address() -> str:
    """Node 0's address from $MASTER_ADDR (with $MASTER_PORT, the env:// rendezvous)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"nnodes > 1 needs {' and '.join(missing)} set: node 0's address and a "
                         "free port there, the same on every host")
    return os.environ["MASTER_ADDR"]


def _on_death(rank: int) -> None:
    log.error("astream: tensor-parallel rank %d died or lost its connection; aborting rank 0's "
              "collectives", rank)
    abort_collectives()
