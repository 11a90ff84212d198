"""A tensor-parallel rank other than 0: a spawned process that loads its shard, builds its
own KV cache and runs each step rank 0 hands it, until rank 0 says stop or goes away.

Messages on the pipe from rank 0: ("plan", CachePlan), then one HostInputs per step, then
None. To rank 0: ("loaded", CachePlan), ("ready", None) or ("error", traceback text).
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from astream.config import EngineConfig
from astream.executor.build import build_runner, kv_format
from astream.executor.cache_plan import plan_runner_cache
from astream.models.config import ModelConfig
from astream.models.loader import load_model, open_checkpoint
from astream.parallel.group import join_group, leave_group, rank_device
from astream.policies import make_policy
from astream.runtime.device import DeviceRuntime


def worker_main(rank: int, size: int, port: int, config: EngineConfig, path: str,
                conn: Connection) -> None:
    try:
        runner = _start(rank, size, port, config, path, conn)
    except EOFError:                        # rank 0 went away while this one loaded
        return
    except BaseException:
        _report(conn)
        sys.exit(1)
    previous = None
    try:
        while (host := conn.recv()) is not None:
            previous = runner.follow(host, previous)
    except EOFError:                        # rank 0's process ended: so does this one
        return
    except BaseException:
        _report(conn)
        sys.exit(1)
    finally:
        leave_group()


def _start(rank: int, size: int, port: int, config: EngineConfig, path: str, conn: Connection):
    checkpoint = open_checkpoint(Path(path), config.load_format)
    device = rank_device(config.torch_device(), rank)
    tp = join_group(rank, size, port, device, ModelConfig.from_hf(checkpoint.hf_config))
    model = load_model(checkpoint, config.torch_dtype(), device, None, config.tokenizer, tp)
    policy = make_policy(config.sparse_policy, config.sparse_budget)
    fmt = kv_format(config, model.decoder, model.tokenizer)
    conn.send(("loaded", plan_runner_cache(config, model.decoder, policy, fmt)))
    plan = conn.recv()[1]
    runner = build_runner(config, plan, model.decoder, DeviceRuntime(device), policy, fmt)
    conn.send(("ready", None))
    return runner


def _report(conn: Connection) -> None:
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    try:
        conn.send(("error", text))
    except OSError:
        pass
