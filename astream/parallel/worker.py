"""A tensor-parallel rank other than 0: a process that loads its shard, builds its own KV
cache and runs each step rank 0 hands it, until rank 0 says stop or goes away.

A rank on rank 0's host is spawned by the engine and talks to it over a pipe. A rank on
another host (`astream worker`, run_node) joins through env:// and then connects to rank
0's step channel (its address and key come from rank 0 over the process group); rank 0
answers with its settings and checkpoint path, so that host's command line names only
the ranks' layout.

Messages from rank 0: ("plan", CachePlan), then one HostStep per step, between steps a
GraphSpec (build, and on CUDA capture, those decode graphs now, as rank 0 does), then Stop
(at any point).
To rank 0: ("hello", rank) on a connection, ("loaded", CachePlan), ("ready", None),
("graphs", the (mode, batch size) keys of the whole-step graphs captured: this rank captures
no sampling tail) or ("error", traceback text).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path

from astream.base.config import EngineConfig
from astream.executor.build import GraphSpec, build_runner, capture_graphs, kv_format, release_graphs
from astream.executor.cache_plan import plan_runner_cache
from astream.executor.graph_sampling import step_keys
from astream.models.config import ModelConfig
from astream.models.loader import load_model, open_checkpoint
from astream.models.tensor_parallel import TensorParallel, TPShard
from astream.parallel.group import (init_group, join_group, leave_group, rank_device,
                                    share_from_rank0)
from astream.policies import make_policy
from astream.runtime.device import DeviceRuntime


@dataclass(slots=True, frozen=True)
class Stop:
    """Rank 0's last message. `clean`: every rank is alive and idle, so each destroys the
    group; else each aborts it (parallel.group.leave_group)."""

    clean: bool


class _Stopped(Exception):
    """Rank 0 stopped the ranks before this one had started."""


def worker_main(rank: int, size: int, port: int | None, config: EngineConfig, path: str,
                conn: Connection) -> None:
    """A rank on rank 0's host, spawned with its pipe; `port` None: env:// (several hosts)."""
    try:
        checkpoint = open_checkpoint(Path(path), config.load_format)
        device = rank_device(config.torch_device(), rank)
        tp = join_group(rank, size, port, device, ModelConfig.from_hf(checkpoint.hf_config))
        if port is None:
            share_from_rank0()
        runner = _start(tp, config, checkpoint, device, conn)
    except (EOFError, _Stopped):            # rank 0 went away, or gave up, while this one loaded
        leave_group()
        return
    except BaseException:
        _report(conn)
        sys.exit(1)
    _serve(runner, conn)


def remote_worker_main(rank: int, config: EngineConfig, model: str | None) -> None:
    """A rank on another host: join through env://, connect to rank 0's step channel, take
    rank 0's settings (this host's `model` path, if given, instead of rank 0's)."""
    conn = None
    try:
        size = config.tensor_parallel_size
        device = rank_device(config.torch_device(), rank % config.ranks_per_node)
        init_group(rank, size, None, device)
        address, key = share_from_rank0()
        # Held until this process ends, and never written again: its close is how rank 0's
        # watch learns this rank is gone, even while rank 0 waits inside a collective.
        silent = Client(address, authkey=key)
        silent.send(("watch", rank))
        conn = Client(address, authkey=key)
        conn.send(("hello", rank))
        ours, path = conn.recv()
        if ours.torch_device().type != device.type:
            raise ValueError(f"node 0 runs on {ours.torch_device().type} and this node on "
                             f"{device.type}: start it with --device {ours.device}")
        ours = dataclasses.replace(ours, nnodes=config.nnodes, node_rank=config.node_rank)
        checkpoint = open_checkpoint(Path(model or path), ours.load_format)
        tp = TensorParallel(TPShard(rank, size, ModelConfig.from_hf(checkpoint.hf_config)))
        runner = _start(tp, ours, checkpoint, device, conn)
    except (EOFError, _Stopped):
        leave_group()
        return
    except BaseException:
        if conn is None:
            traceback.print_exc()
            leave_group()
            sys.exit(1)
        _report(conn)
        sys.exit(1)
    _serve(runner, conn)
    silent.close()


def run_node(config: EngineConfig, model: str | None) -> int:
    """Every rank of node `config.node_rank` (> 0): the first in this process, the others in
    spawned ones. Returns once rank 0 stops them; the exit status is the worst rank's."""
    first = config.node_rank * config.ranks_per_node
    context = multiprocessing.get_context("spawn")
    others = [context.Process(target=remote_worker_main, args=(rank, config, model),
                              name=f"astream-tp-rank{rank}", daemon=True)
              for rank in range(first + 1, first + config.ranks_per_node)]
    for process in others:
        process.start()
    code = 0
    try:
        remote_worker_main(first, config, model)
    except SystemExit as exit:
        code = exit.code or 0
    for process in others:
        process.join()
        code = code or (process.exitcode or 0)
    return code


def _start(tp, config: EngineConfig, checkpoint, device, conn: Connection):
    model = load_model(checkpoint, config.torch_dtype(), device, None, config.tokenizer, tp)
    policy = make_policy(config.sparse_policy, config.sparse_budget)
    fmt = kv_format(config, model.decoder, model.tokenizer)
    conn.send(("loaded", plan_runner_cache(config, model.decoder, policy, fmt)))
    message = conn.recv()
    if isinstance(message, Stop):
        raise _Stopped
    plan = message[1]
    runner = build_runner(config, plan, model.decoder, DeviceRuntime(device), policy, fmt)
    conn.send(("ready", None))
    return runner


def _serve(runner, conn: Connection) -> None:
    previous = graphs = None
    clean = False
    try:
        while not isinstance(message := conn.recv(), Stop):
            if isinstance(message, GraphSpec):
                graphs = runner.graphs = capture_graphs(message, runner)
                conn.send(("graphs", step_keys(graphs.graphs)))
            else:
                previous = runner.follow(message, previous)
        clean = message.clean
    except EOFError:                        # rank 0's process ended: so does this one
        return
    except BaseException:
        _report(conn)
        sys.exit(1)
    finally:
        leave_group(lambda: release_graphs(graphs, runner.runtime), clean=clean)


def _report(conn: Connection) -> None:
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    try:
        conn.send(("error", text))
    except OSError:
        pass
