"""Tensor parallelism on the CPU over gloo: shards give the whole model's logits and tokens,
the async engine returns every block, bad sizes are refused, a lost rank stops the engine
without leaving a process behind (also while rank 0 waits in a collective only an abort
ends, as over NCCL), a failed capture releases its graphs, a release waits for the device a
bounded time, and the ranks leave the group together with their graphs released (shut down
when clean, aborted otherwise, as over NCCL, where a test forces it)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
import torch
import torch.distributed as dist

from astream import LLM, Engine, SamplingParams
from astream.base.config import EngineConfig
from astream.base.errors import TensorParallelError
from astream.core import engine_core
from astream.core.engine_core import EngineCore
from astream.executor import build
from astream.executor.build import graph_spec, release_graphs
from astream.executor.graph_chain import ChainedStep, capture_chained_steps
from astream.executor.graph_sampling import capture_sampling_graphs, captured_mode, replay, step_keys
from astream.executor.sampling_tail import Tail
from astream.kvcache.sizing import CachePlan, OffloadPlan
from astream.face.cli import parse_command
from astream.models.config import ModelConfig
from astream.models.loader import load_model, open_checkpoint
from astream.ops.attention import varlen_attention
from astream.ops.varlen import VarlenMeta
from astream.parallel import group, workers
from astream.parallel.group import free_port, init_group, join_group, leave_group, teardown
from astream.parallel.worker import Stop
from astream.runtime.device import DeviceRuntime

CPU = torch.device("cpu")
KW = dict(device="cpu", dtype="float32", num_kv_blocks=96, kv_block_size=16, max_model_len=512,
          max_num_batched_tokens=64, show_progress=False)
PROMPTS = ["The quick brown fox", [5, 6, 7, 8, 9, 10], "one two three four five six seven " * 12,
           "The quick brown fox jumps over"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().split(")")[-1].split()[0] == "Z")


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


# ---- the option ------------------------------------------------------------------------------

def test_tensor_parallel_size_is_an_engine_option_and_a_flag(tiny_qwen3):
    assert EngineConfig().tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(tensor_parallel_size=2, offload=True).offload
    _, (engine, _) = parse_command(["generate", "hi", "--model", str(tiny_qwen3),
                                    "--tensor-parallel-size", "2"], {})
    assert engine["tensor_parallel_size"] == 2


def test_a_size_the_heads_do_not_divide_into_is_refused_before_any_process_starts(tiny_qwen3):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not split this model: it has "
                                         r"4 attention heads, 2 KV heads .* sizes that work: 1, 2, 4"):
        LLM(str(tiny_qwen3), tensor_parallel_size=3, **KW)
    assert set(multiprocessing.active_children()) == before


# ---- the shards compute the whole model ------------------------------------------------------

def _dense_logits(path: str, ids: list[int], tp=None) -> torch.Tensor:
    decoder = load_model(open_checkpoint(Path(path)), torch.float32, CPU, tp=tp).decoder
    tokens = torch.tensor(ids, dtype=torch.int64)
    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    scale = decoder.config.head_dim ** -0.5

    def attend(layer, q, k, v):
        return varlen_attention(q, k, v, meta, causal=True, scale=scale)[0]

    with torch.inference_mode():
        return decoder.logits(decoder.forward(tokens, torch.arange(n), attend))


def _rank_logits(rank: int, size: int, port: int, path: str, ids: list[int]) -> None:
    tp = join_group(rank, size, port, CPU, ModelConfig.from_hf(open_checkpoint(Path(path)).hf_config))
    try:
        _dense_logits(path, ids, tp)
    finally:
        leave_group()


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen2"])
def test_two_shards_give_the_whole_models_logits(model, request):
    path = str(request.getfixturevalue(model))
    ids = list(range(3, 40, 2))
    whole = _dense_logits(path, ids)
    port = free_port()
    other = multiprocessing.get_context("spawn").Process(target=_rank_logits,
                                                         args=(1, 2, port, path, ids))
    other.start()
    try:
        tp = join_group(0, 2, port, CPU, ModelConfig.from_hf(open_checkpoint(Path(path)).hf_config))
        try:
            sharded = _dense_logits(path, ids, tp)
        finally:
            leave_group()
    finally:
        other.join(30)
    assert other.exitcode == 0
    assert sharded.shape == whole.shape
    torch.testing.assert_close(sharded, whole, atol=1e-4, rtol=0)


def _generate(path: Path, size: int, **options) -> tuple[list, dict]:
    with LLM(str(path), tensor_parallel_size=size, **{**KW, **options}) as llm:
        outs = llm.generate(PROMPTS + PROMPTS[:1], [GREEDY] * len(PROMPTS) + [SAMPLED])
        outs += llm.generate(PROMPTS[2:3], GREEDY)          # its full blocks are cached now
        return outs, llm.stats()


@pytest.mark.parametrize("model,size", [("tiny_qwen3", 2), ("tiny_qwen2", 2), ("tiny_qwen2", 4)])
def test_generate_gives_one_ranks_tokens_and_logprobs(model, size, request):
    """Chunked prefill, a cached prefix and a seeded sampled request, over 2 ranks, and over 4
    where the 2 KV heads are replicated."""
    path = request.getfixturevalue(model)
    want, _ = _generate(path, 1)
    got, stats = _generate(path, size)
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        assert ours.finish_reason == theirs.finish_reason == "length"
    for ours, theirs in zip(got, want):
        if ours.outputs[0].logprobs is None:
            continue
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["prefix_cache_hits"] > 0


def _same_outputs(got: list, want: list) -> None:
    for ours, theirs in zip(got, want, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs or [], theirs.outputs[0].logprobs or []):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


# Ring slots of two blocks: every context but the shortest crosses several slots.
OFFLOAD = dict(offload=True, offload_slot_tokens=32)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen2"])
def test_offload_under_tp_gives_one_ranks_and_the_resident_tokens(model, request):
    """Each rank loads its own KV heads from its own host pool: the same tokens and logprobs
    as one rank with offload, and as two ranks without."""
    path = request.getfixturevalue(model)
    one, _ = _generate(path, 1, **OFFLOAD)
    resident, _ = _generate(path, 2)
    got, stats = _generate(path, 2, **OFFLOAD)
    _same_outputs(got, one)
    _same_outputs(got, resident)
    assert stats["offload"] and stats["offload_bytes_loaded"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["offload_tail_blocks_used"] == 0


def test_quest_selects_for_each_ranks_own_kv_heads(tiny_qwen3):
    prompts = ["one two three four five six seven " * 12, "hello " * 50]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for size in (1, 2):
        with LLM(str(tiny_qwen3), tensor_parallel_size=size, sparse_policy="quest",
                 sparse_budget=64, **KW) as llm:
            runs.append(([out.token_ids for out in llm.generate(prompts, params)], llm.stats()))
    (want, whole), (got, shard) = runs
    assert got == want
    assert sum(whole["quest_selections"]) > 0
    # rank 0 holds one of the two KV heads, and its stats count its own selections
    assert sum(shard["quest_selections"]) * 2 == sum(whole["quest_selections"])


def test_a_gguf_model_splits_over_three_ranks(smollm2_path):
    """SmolLM2: 9 heads and 3 KV heads; every rank reads and dequantizes its own blocks only."""
    prompts = ["The capital of France is", [{"role": "user", "content": "Count to 5."}]]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    runs = []
    for size in (1, 3):
        with LLM(str(smollm2_path), tensor_parallel_size=size, device="cpu", dtype="float32",
                 num_kv_blocks=32, max_model_len=256, show_progress=False) as llm:
            runs.append(llm.generate(prompts, params))
    for ours, theirs in zip(runs[1], runs[0]):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_quest_with_offload_under_tp_selects_per_rank(tiny_qwen3):
    """Each rank's Quest chooses pages of its own KV heads from its own host pool: the same
    tokens as one rank's, and Full's for the rows the budget covers (the long one makes the
    sparse layers select). With keys_on_device each rank gathers its keys from its own device."""
    prompts = ["one two three four five six seven " * 12, "hello there", "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    quest = "quest(dense_layers=1, budget_tokens=48)"
    keys = "quest(dense_layers=1, budget_tokens=48, keys_on_device=True)"
    for name, size, policy in (("full", 1, "full"), ("quest1", 1, quest), ("quest2", 2, quest),
                               ("keys2", 2, keys)):
        with LLM(str(tiny_qwen3), tensor_parallel_size=size, sparse_policy=policy,
                 **{**KW, **OFFLOAD}) as llm:
            runs[name] = (llm.generate(prompts, params), llm.stats())
    _same_outputs(runs["quest2"][0], runs["quest1"][0])
    _same_outputs(runs["keys2"][0], runs["quest1"][0])
    _same_outputs(runs["quest2"][0][1:], runs["full"][0][1:])
    whole, shard = runs["quest1"][1], runs["quest2"][1]
    assert sum(shard["quest_selections"]) > 0
    assert sum(shard["quest_selections"]) * 2 == sum(whole["quest_selections"])
    assert shard["kv_blocks_free"] == shard["kv_blocks_total"]


# ---- decode graphs on every rank ---------------------------------------------------------------

PLAIN = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
QUEST = "quest(dense_layers=1, budget_tokens=48)"
# Batches of up to 4 rows replay the graphs; the 5 prompts' first steps run eagerly.
GRAPHED = {"resident": dict(cuda_graph_max_batch=4),
           "offload_quest": dict(cuda_graph_max_batch=4, sparse_policy=QUEST, **OFFLOAD),
           "offload_dense": dict(cuda_graph_max_batch=4, offload=True, offload_slot_tokens=128)}


def _with_graphs(llm: LLM, kind: str):
    """Every rank's decode graphs of the engine's spec, as on a GPU; here their static
    programs run eagerly, holding the same collectives as the captured graphs would."""
    core = llm.core
    spec = graph_spec(core.config, core.plan, core.runner)
    assert spec is not None and spec.kind == kind.removeprefix("offload_").replace("quest", "offload")
    core.workers.install_graphs(spec, core.runner)
    return core.runner.graphs


@pytest.mark.parametrize("kind", GRAPHED)
def test_every_rank_replays_rank_0s_graph_in_step(tiny_qwen3, kind):
    """Rank 0 picks the graph and the sampling mode of each decode step and every rank
    replays it: greedy rows sampled in the graph, rows with logprobs or penalties in rank 0's
    sampling tail after it, batches too large for the graphs eagerly, temperature rows in the
    graph (each rank draws, rank 0's ids count), and seeded rows on the host."""
    prompts = PROMPTS + ["hello there"]
    # Batches shrink as rows finish: the rows with logprobs leave before the last steps.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs,
                             frequency_penalty=penalty)
              for n, logprobs, penalty in ((14, None, 0.0), (8, 3, 0.0), (12, None, 1.5), (6, None, 0.0),
                                           (4, 3, 0.0))]
    options = {**KW, **GRAPHED[kind]}
    with LLM(str(tiny_qwen3), **options) as llm:
        want = llm.generate(prompts, params)
        hot = llm.generate(prompts[:2], [PLAIN, SamplingParams(temperature=0.8, max_tokens=10,
                                                               ignore_eos=True)])
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **options) as llm:
        graphs = _with_graphs(llm, kind)
        got = llm.generate(prompts, params)
        inside = graphs.sampler.sampled_inside
        assert graphs.steps == inside > 0               # the tail sampled the others
        sampled = llm.generate(prompts[:2], [PLAIN, SamplingParams(temperature=0.8, max_tokens=10,
                                                                   ignore_eos=True)])
        assert graphs.sampler.sampled_inside > inside + 5
        steps, inside = graphs.steps, graphs.sampler.sampled_inside
        seeded = llm.generate(prompts[:1], SAMPLED)[0]
        assert graphs.steps > steps and graphs.sampler.sampled_inside == inside   # on the host
        assert len(seeded.token_ids) == 10
        stats = llm.stats()
        assert stats["graph_steps"] == graphs.steps
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    _same_outputs(got, want)
    assert sampled[0].token_ids == hot[0].token_ids
    assert len(sampled[1].token_ids) == 10


def test_the_cpu_captures_nothing_and_no_spec_sends_nothing(tiny_qwen3):
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **KW) as llm:
        assert llm.core.runner.graphs is None
        llm.core.workers.install_graphs(None, llm.core.runner)
        assert llm.core.runner.graphs is None
        assert llm.generate(PROMPTS[:1], PLAIN)[0].token_ids      # the ranks still take steps


# ---- leaving the group -------------------------------------------------------------------------

def test_nccl_groups_shut_down_when_clean_else_abort_and_gloo_groups_are_destroyed():
    assert teardown("nccl", clean=True) == "shutdown"
    assert teardown("nccl", clean=False) == "abort"
    assert teardown("gloo", clean=True) == teardown("gloo", clean=False) == "destroy"


class _Graph:
    def __init__(self, resets: list):
        self.resets = resets

    def reset(self) -> None:
        self.resets.append(self)


class _Runtime:
    is_cuda = True

    def drain(self, timeout_s: float) -> bool:
        return True


def test_release_resets_every_captured_graph_once():
    resets = []
    one, two = _Graph(resets), _Graph(resets)
    chain = [_Graph(resets), _Graph(resets)]               # shared by a size's modes
    greedy, hot = _Graph(resets), _Graph(resets)
    graphs = SimpleNamespace(graphs={("greedy", 1): one, ("temperature", 1): two})
    step = partial(ChainedStep, between=lambda index: None, after=lambda: None)
    chained = SimpleNamespace(graphs={("greedy", 2): step(chain, greedy),
                                      ("temperature", 2): step(chain, hot),
                                      ("greedy", 1): step(chain[:1], None)})
    for holder in (graphs, chained):
        release_graphs(holder, _Runtime())
    assert sorted(map(id, resets)) == sorted(map(id, [one, two, *chain, greedy, hot]))
    release_graphs(None, _Runtime())
    release_graphs(graphs, SimpleNamespace(is_cuda=False))  # the CPU captured nothing
    assert len(resets) == 6


def test_a_release_waits_for_the_device_a_bounded_time(monkeypatch, caplog):
    """A device that never goes idle (a collective waiting on a rank that is gone): the
    graphs are destroyed all the same, after RELEASE_DRAIN_S, with a warning that says so."""
    never = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: never.wait(10))
    monkeypatch.setattr(build, "RELEASE_DRAIN_S", 0.3, raising=False)
    resets = []
    graphs = SimpleNamespace(graphs={("greedy", 1): _Graph(resets), ("greedy", 2): _Graph(resets)})
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="astream"):
            release_graphs(graphs, DeviceRuntime(torch.device("cuda")))
    finally:
        never.set()
    assert time.monotonic() - start < 3 and len(resets) == 2
    assert "did not go idle within 0 s" in caplog.text


class _CapturedGraph:
    """Stands in for torch.cuda.CUDAGraph in a capture on the CPU: counts its resets."""

    made: list = []

    def __init__(self) -> None:
        self.resets = 0
        _CapturedGraph.made.append(self)

    def register_generator_state(self, generator) -> None:
        pass

    def capture_begin(self, pool=None) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def reset(self) -> None:
        self.resets += 1


@contextlib.contextmanager
def _capturing(graph, pool=None):
    graph.capture_begin(pool)
    try:
        yield
    finally:
        graph.capture_end()


def _fake_cuda_capture(monkeypatch) -> None:
    _CapturedGraph.made = []
    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, value in (("CUDAGraph", _CapturedGraph), ("graph", _capturing),
                        ("graph_pool_handle", lambda: ("pool",)), ("synchronize", lambda device=None: None),
                        ("Stream", lambda device=None: stream), ("current_stream", lambda device=None: stream),
                        ("stream", lambda s: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)


@pytest.mark.parametrize("chained", [False, True], ids=["one_graph_a_step", "chain"])
def test_a_failed_capture_destroys_the_graphs_it_had_captured(monkeypatch, chained):
    """Sizes are captured largest first: where size 2 fails (here inside its capture), the
    graphs of size 4 and the one begun for size 2 are destroyed before the error goes on (it
    would hold them, and their memory pool, for as long as it lives)."""
    _fake_cuda_capture(monkeypatch)
    sampler = SimpleNamespace(program=lambda hidden, mode: None, tail=lambda size, tail: None,
                              generator=None, tables=object())

    def run(size: int, capture=None) -> torch.Tensor:
        if capture is not None:
            capture.cut(lambda: None)                 # a chain of two graphs
        if size == 2 and (capture is not None or chained is False and len(_CapturedGraph.made) > 2):
            raise RuntimeError("capture failed: out of memory")
        return torch.zeros(size, 4)

    out = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="capture failed"):
        if chained:
            capture_chained_steps([1, 2, 4], run, sampler, out, CPU, between=lambda i: None,
                                  after=lambda: None)
        else:
            capture_sampling_graphs([1, 2, 4], lambda size: run(size), sampler, out, CPU)
    assert len(_CapturedGraph.made) >= 3
    assert [graph.resets for graph in _CapturedGraph.made] == [1] * len(_CapturedGraph.made)


class _WholeModelRank:
    """A tensor-parallel rank as its decode graphs see it, in a process that holds the whole
    model: the rank it names, and collectives that leave its tensors as they are."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.shard = SimpleNamespace(vocab_start=0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        whole = logits[:, :vocab_size].float()
        return whole if out is None else out.copy_(whole)


def _one_follower() -> tuple[workers.WorkerGroup, object]:
    """Rank 0's group with one other rank, of another host (no process here): the end of its
    connection the test speaks for it."""
    ours, theirs = multiprocessing.Pipe()
    return workers.WorkerGroup([None], [ours], 1), theirs


@pytest.mark.parametrize("kind", GRAPHED)
def test_only_rank_0_captures_the_sampling_tails(tiny_qwen3, monkeypatch, kind):
    """Every rank captures the same whole-step graphs in the same order (here in one process,
    as on a GPU, the captures standing in for CUDA's); only rank 0 the sampling tails after
    them and their tables. A follower replays its greedy graph in a step rank 0 samples in
    a tail, and rank 0 takes its whole-step graphs as its own."""
    options = {**KW, **GRAPHED[kind]}
    with LLM(str(tiny_qwen3), **options) as llm:
        runner = llm.core.runner
        spec = graph_spec(llm.core.config, llm.core.plan, runner)
        _fake_cuda_capture(monkeypatch)
        ranks = []
        for rank in (0, 1):
            decoder = replace(runner.decoder, tp=_WholeModelRank(rank))
            _CapturedGraph.made = []
            graphs = build.make_graphs(spec, SimpleNamespace(
                decoder=decoder, cache=runner.cache, offload=runner.offload, backends=runner.backends,
                policy=runner.policy, generator=runner.generator))
            graphs.capture()
            ranks.append((graphs, len(_CapturedGraph.made)))
        (first, made_first), (follower, made_follower) = ranks
        tails = [key for key in first.graphs if isinstance(key[0], Tail)]
        assert tails and first.sampler.tables is not None
        assert follower.sampler.tables is None
        assert sorted(follower.graphs, key=repr) == step_keys(first.graphs)
        assert made_first - made_follower == len(tails)
        # A step of 3 rows whose logprobs rank 0 samples in its tail of size 4.
        tail = Tail(False, False, False, True)
        assert captured_mode(first.graphs, 4, tail) == tail
        replayed = []
        graphs = {key: SimpleNamespace(replay=partial(replayed.append, key)) for key in follower.graphs}
        ids = replay(graphs, 4, 3, tail, None, follower.sampler, follower._run_eager,
                     follower.buffers["hidden"])
        assert replayed == [("greedy", 4)]
        assert ids is not None and ids.shape == (3,)          # no host sampling to join
        monkeypatch.setattr(workers, "capture_graphs", lambda spec, runner: first)
        group, other = _one_follower()
        other.send(("graphs", step_keys(follower.graphs)))
        rank0 = SimpleNamespace(graphs=None, runtime=None)
        group.install_graphs(spec, rank0)
        assert rank0.graphs is first
        other.send(("graphs", step_keys(follower.graphs)[1:]))
        with pytest.raises(TensorParallelError, match="rank 1 captured decode graphs"):
            group.install_graphs(spec, rank0)


def test_the_ranks_agree_on_the_fewest_blocks_and_the_smallest_ring():
    """Each rank plans its own cache; with offload each sizes its ring by its own device
    memory (rank 0 keeps the sampling tails' tables there too): every rank takes the fewest
    blocks and the smallest ring, which fit each of them."""
    group, other = _one_follower()
    ours = CachePlan(64, 16, 1024, 256, OffloadPlan(3, 40, 17))
    theirs = CachePlan(60, 16, 960, 256, OffloadPlan(3, 48, 17))
    other.send(("loaded", theirs))
    other.send(("ready", None))
    agreed = group.agree(ours)
    assert (agreed.num_blocks, agreed.max_model_len, agreed.offload) == (60, 960, OffloadPlan(3, 40, 17))
    assert other.recv() == ("plan", agreed)


@pytest.fixture
def one_rank_group():
    init_group(0, 1, 0, CPU)                 # rank 0's store binds a port the OS picks
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_gloo_releases_the_graphs_then_destroys_the_group(one_rank_group, monkeypatch):
    events = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (events.append("destroy"), destroy()))
    monkeypatch.setattr(group, "abort_group", lambda: events.append("abort"))
    assert leave_group(lambda: events.append("release"))
    assert events == ["release", "destroy"] and not dist.is_initialized()


def test_an_aborted_group_releases_the_graphs_and_frees_the_process(one_rank_group, monkeypatch):
    """The NCCL path, forced onto a gloo group: the group is aborted (not destroyed) while the
    graphs are released, and the process can join another group afterwards."""
    events = []
    abort = group.abort_group
    monkeypatch.setattr(group, "teardown", lambda backend, clean: "abort")
    monkeypatch.setattr(group, "abort_group", lambda: (events.append("abort"), abort()))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: events.append("destroy"))
    assert leave_group(lambda: events.append("release"))
    assert sorted(events) == ["abort", "release"] and not dist.is_initialized()
    monkeypatch.undo()
    init_group(0, 1, 0, CPU)
    assert dist.get_world_size() == 1


def test_an_abort_that_does_not_end_is_waited_for_a_bounded_time(one_rank_group, monkeypatch):
    """NCCL's abort waits for graphs it still sees alive and for ranks yet to leave: the rank
    goes on after `wait_s`, its graphs released."""
    stuck, released = threading.Event(), []
    monkeypatch.setattr(group, "teardown", lambda backend, clean: "abort")
    monkeypatch.setattr(group, "abort_group", lambda: stuck.wait(30))
    start = time.monotonic()
    try:
        assert not leave_group(lambda: released.append(True), wait_s=0.3)
        assert time.monotonic() - start < 5 and released == [True]
    finally:
        stuck.set()


def test_closing_releases_the_graphs_rank_0_installed_even_when_detached(tiny_qwen3, monkeypatch):
    """The engine's close leaves the group with the graphs rank 0 captured, though their runner
    no longer holds them (a benchmark swaps them out), and rank 0 aborts (the NCCL path, here
    over gloo, the other rank destroying) without waiting for the other rank to exit first;
    the process can start another engine afterwards."""
    released, leaving = [], []
    monkeypatch.setattr(workers, "release_graphs", lambda graphs, runtime: released.append(graphs))
    monkeypatch.setattr(group, "teardown", lambda backend, clean: "abort")
    leave = workers.leave_group

    def leave_group(release, clean=False):
        leaving.append([process.is_alive() for process in llm.core.workers.processes])
        return leave(release, clean=clean)

    monkeypatch.setattr(workers, "leave_group", leave_group)
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **KW, cuda_graph_max_batch=4) as llm:
        graphs = _with_graphs(llm, "resident")
        want = llm.generate(PROMPTS[:2], PLAIN)
        llm.core.runner.graphs = None
        pids = llm.core.workers.pids
    assert released == [graphs] and leaving == [[True]] and not dist.is_initialized()
    assert _wait_gone(pids) == []
    monkeypatch.undo()
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **KW) as llm:
        assert [out.token_ids for out in llm.generate(PROMPTS[:2], PLAIN)] == \
            [out.token_ids for out in want]


# ---- the async engine ------------------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("options", [{}, OFFLOAD], ids=["resident", "offload"])
async def test_streams_cancelled_and_aborted_under_tp_return_every_block(tiny_qwen3, options):
    want = {}
    with LLM(str(tiny_qwen3), **KW) as llm:
        for i, out in enumerate(llm.generate([f"story {i}:" for i in range(6)], GREEDY)):
            want[i] = out.token_ids
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with Engine(str(tiny_qwen3), tensor_parallel_size=2, **{**KW, **options}) as engine:
        idle = engine.stats()["kv_blocks_free"]
        results: dict[int, list[int]] = {}

        async def finish(i):
            results[i] = [t.token_id async for t in engine.stream(f"story {i}:", GREEDY) if t.token_id >= 0]

        async def cancel(i):
            async for tok in engine.stream(f"story {i}:", long):
                if tok.index >= 4:
                    break                              # leaving the loop aborts it

        async def abort(i):
            reasons = [t.finish_reason async for t in engine.stream(f"story {i}:", long, f"abort-{i}")]
            assert reasons[-1] == "abort"

        async def aborter():
            while engine.stats()["running"] < 3:
                await anyio.sleep(0.01)
            for i in (4, 5):
                await engine.abort(f"abort-{i}")

        async with anyio.create_task_group() as group:
            for i in range(2):
                group.start_soon(finish, i)
            for i in (2, 3):
                group.start_soon(cancel, i)
            for i in (4, 5):
                group.start_soon(abort, i)
            group.start_soon(aborter)
        with anyio.fail_after(10):
            while engine.stats()["requests"]:
                await anyio.sleep(0.01)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == idle == stats["kv_blocks_total"]
        assert stats["running"] == 0 and stats["fault"] is None
        assert engine.running
    assert results == {0: want[0], 1: want[1]}


# ---- failures --------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_killed_rank_ends_the_engine_and_every_request_and_leaves_no_process(tiny_qwen3):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    ends = {}
    async with Engine(str(tiny_qwen3), tensor_parallel_size=2, **KW) as engine:
        pids = engine.core.workers.pids

        async def run(i):
            async for tok in engine.stream(f"prompt {i}", long):
                if i == 0 and tok.index == 3:
                    os.kill(pids[0], signal.SIGKILL)
                if tok.finish_reason is not None:
                    ends[i] = tok

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for i in range(3):
                    group.start_soon(run, i)
        assert not engine.running
        assert "rank 1 died (exit code -9)" in engine.stats()["fault"]
        with pytest.raises(Exception, match="stopped after a fault"):
            await engine.generate("more", long)
    assert sorted(ends) == [0, 1, 2]
    for tok in ends.values():
        assert tok.finish_reason == "error"
        assert "tensor-parallel rank 1 died" in tok.error
    assert _wait_gone(pids) == []
    assert multiprocessing.active_children() == []


def _capture_killing_rank_1(monkeypatch, then):
    """The engine captures decode graphs at start (as on CUDA); rank 0's capture kills rank 1
    and then does `then()`, standing in for the capture's warm-up collective."""
    monkeypatch.setattr(engine_core, "captures_graphs", lambda config, device: True)

    def capture(spec, runner):
        os.kill(runner.followers.pids[0], signal.SIGKILL)
        then()

    monkeypatch.setattr(workers, "capture_graphs", capture)


def _start_fails_naming_rank_1(path: Path) -> float:
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        LLM(str(path), tensor_parallel_size=2, cuda_graph_max_batch=4, **KW)
    elapsed = time.monotonic() - start
    assert multiprocessing.active_children() == [] and not dist.is_initialized()
    return elapsed


def test_a_rank_that_dies_during_graph_capture_is_named_and_leaves_no_process(tiny_qwen3, monkeypatch):
    """Over gloo the warm-up's collective fails at once (the dead rank's sockets close): the
    engine's start raises an error naming the rank, not the collective's."""
    _capture_killing_rank_1(monkeypatch, lambda: dist.all_reduce(torch.ones(1)))
    _start_fails_naming_rank_1(tiny_qwen3)


def test_a_dead_rank_frees_rank_0_from_a_wait_only_an_abort_ends(tiny_qwen3, monkeypatch):
    """Over NCCL a collective with a dead peer never completes, and rank 0 waits inside the
    device (the capture's synchronize). Here that wait ends only when rank 0's watch aborts
    the collectives, as NCCL's kernels quit on an abort; the start then fails at once,
    naming the rank, not after NCCL's timeout."""
    aborted = threading.Event()
    monkeypatch.setattr(workers, "abort_collectives", aborted.set, raising=False)

    def device_wait():
        if not aborted.wait(30):
            raise TimeoutError("rank 0 was never freed from its collective")
        raise RuntimeError("NCCL communicator was aborted")

    _capture_killing_rank_1(monkeypatch, device_wait)
    assert _start_fails_naming_rank_1(tiny_qwen3) < 15


def _watch_sees_death(group: workers.WorkerGroup) -> None:
    group.processes[0].join(20)
    watch = getattr(group, "watch", None)
    deadline = time.monotonic() + 20
    while watch is not None and watch.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_step_that_ends_after_a_rank_died_is_not_delivered(tiny_qwen3):
    """Over NCCL the watch's abort lets a step waiting on a dead rank end, with garbage ids:
    processing it raises the rank's death instead of delivering them."""
    core = EngineCore.create(EngineConfig.from_kwargs(str(tiny_qwen3), tensor_parallel_size=2, **KW))
    try:
        sink = core.add_request("r", [5, 6, 7, 8], PLAIN)
        output = core.launch(core.prepare(core.schedule()))
        os.kill(core.workers.pids[0], signal.SIGKILL)
        _watch_sees_death(core.workers)
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
            core.process(output)
        assert sink.tokens == []
    finally:
        core.close()
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


def test_a_step_dropped_part_way_closes_by_abort(tiny_qwen3, monkeypatch):
    """A step whose program is closed between layers (the engine cancelled mid-step) has
    reached the other rank, which now waits in a collective rank 0 will not issue: the close
    that follows aborts the group rather than destroying it, and no rank is left behind."""
    stops = []
    monkeypatch.setattr(workers, "Stop", lambda clean: (stops.append(clean), Stop(clean))[1])
    core = EngineCore.create(EngineConfig.from_kwargs(str(tiny_qwen3), tensor_parallel_size=2, **KW))
    try:
        pids = core.workers.pids
        core.add_request("r", [5, 6, 7, 8], PLAIN)
        program = core.runner.program(core.prepare(core.schedule()), None)
        next(program)                                  # layer 0 queued on every rank
        program.close()
        assert core.workers.out_of_step
    finally:
        core.close()
    assert stops == [False]
    assert multiprocessing.active_children() == [] and not dist.is_initialized()
    assert _wait_gone(pids) == []


@pytest.mark.parametrize("dies", [False, True], ids=["clean", "a_rank_died"])
def test_a_clean_close_shuts_the_group_down_after_the_graphs_else_aborts(tiny_qwen3, monkeypatch, dies):
    """NCCL's choice, forced over gloo: a clean close destroys the group once the graphs are
    gone (no abort, so no watchdog trace), and tells every rank to do the same; once a rank
    has died, every rank aborts."""
    events, stops = [], []
    monkeypatch.setattr(group, "teardown", lambda backend, clean: teardown("nccl", clean))
    monkeypatch.setattr(workers, "release_graphs", lambda graphs, runtime: events.append("release"))
    destroy, abort = dist.destroy_process_group, group.abort_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (events.append("destroy"), destroy()))
    monkeypatch.setattr(group, "abort_group", lambda: (events.append("abort"), abort()))
    monkeypatch.setattr(workers, "Stop", lambda clean: (stops.append(clean), Stop(clean))[1])
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **KW, cuda_graph_max_batch=4) as llm:
        _with_graphs(llm, "resident")
        assert llm.generate(PROMPTS[:2], PLAIN)[0].token_ids
        pids = llm.core.workers.pids
        if dies:
            os.kill(pids[0], signal.SIGKILL)
            _watch_sees_death(llm.core.workers)
    assert stops == [not dies]
    if dies:                                 # the abort starts first, on a helper thread
        assert sorted(events) == ["abort", "release"]
    else:
        assert events == ["release", "destroy"]
    assert not dist.is_initialized() and _wait_gone(pids) == []


def test_one_host_binds_its_rendezvous_port_as_it_opens_it(tiny_qwen3, monkeypatch):
    """No port is picked first and bound later (another socket may take it in between): rank
    0's store binds one the OS chooses."""
    def taken() -> int:
        raise AssertionError("a port picked before it is bound")

    monkeypatch.setattr(workers, "free_port", taken, raising=False)
    store = group.open_store(1)
    assert store.port > 0
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, **KW) as llm:
        assert llm.generate(PROMPTS[:1], PLAIN)[0].token_ids


def test_ranks_exit_when_the_engines_process_dies(tiny_qwen3, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        from astream import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_qwen3)!r}, tensor_parallel_size=3 - 1, device="cpu", dtype="float32",
                      num_kv_blocks=32, max_model_len=256, show_progress=False)
            print(*llm.core.workers.pids, flush=True)
            time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
    finally:
        driver.kill()
        driver.wait()
    assert _wait_gone(pids) == []


# ---- beyond one host ---------------------------------------------------------------------------

def test_nnodes_and_node_rank_are_options_and_a_worker_command(tiny_qwen3, monkeypatch):
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes - 1 = 1\], got 2"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split over nnodes 2"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node_rank 1 runs only tensor-parallel ranks and no "
                                         "engine: start that host with `astream worker`"):
        LLM(str(tiny_qwen3), tensor_parallel_size=2, nnodes=2, node_rank=1, **KW)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="nnodes > 1 needs MASTER_ADDR and MASTER_PORT set"):
        LLM(str(tiny_qwen3), tensor_parallel_size=2, nnodes=2, **KW)
    _, (engine, _) = parse_command(["generate", "hi", "--model", str(tiny_qwen3), "--nnodes", "2",
                                    "--tensor-parallel-size", "2"], {})
    assert (engine["nnodes"], engine["tensor_parallel_size"]) == (2, 2)
    args, (config,) = parse_command(["worker", "--nnodes", "2", "--node-rank", "1",
                                     "--tensor-parallel-size", "2", "--device", "cpu"], {})
    assert (config.nnodes, config.node_rank, config.device, args.model) == (2, 1, "cpu", None)
    with pytest.raises(SystemExit):                   # node 0 is the engine's, not a worker's
        parse_command(["worker", "--nnodes", "2", "--tensor-parallel-size", "2"], {})


def _rendezvous_port() -> int:
    """A free port below the OS's ephemeral range, which it never hands out to a socket on
    its own: MASTER_PORT must be known before node 0 binds it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    while True:
        port = random.randrange(max(1024, low - 8000), low)
        with socket.socket() as sock:
            with contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", port))
                return port


def test_the_watch_sees_another_hosts_rank_end_by_its_silent_connection():
    """A connection that carries nothing becomes readable only as it closes: that is the
    rank's death. A watch stopped first reports none."""
    from multiprocessing.connection import Client, Listener
    from astream.parallel.liveness import RankWatch
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        accepted = []                      # a client's connect waits for the accept's handshake
        acceptor = threading.Thread(target=lambda: accepted.extend(listener.accept() for _ in range(2)))
        acceptor.start()
        peers = [Client(listener.address, authkey=b"k") for _ in range(2)]
        acceptor.join(10)
        ours = dict(zip((2, 3), accepted))
        died = threading.Event()
        watch = RankWatch.start({}, lambda rank: died.set(), ours)
        time.sleep(0.2)
        assert watch.dead is None and not died.is_set()
        peers[1].close()                                   # rank 3's process ended
        assert died.wait(5) and watch.dead == 3
        quiet = RankWatch.start({}, lambda rank: pytest.fail("a death after stop"), {2: ours[2]})
        quiet.stop()
        peers[0].close()
        time.sleep(0.2)
        assert quiet.dead is None
        for conn in ours.values():
            conn.close()


def test_another_hosts_rank_that_ends_between_its_connections_fails_the_start_at_once(monkeypatch):
    """Its silent connection taken, its steps' connection never comes: rank 0 says so
    instead of waiting out the 300 s it gives other hosts to join."""
    from multiprocessing.connection import Client, Listener
    monkeypatch.setattr(workers, "join_group", lambda *args: "joined")
    monkeypatch.setattr(workers, "share_from_rank0", lambda *args: None)
    group = workers.WorkerGroup([None], [None], ranks_per_node=1)
    group.listener = Listener(("127.0.0.1", 0), authkey=b"k")

    def node1():
        silent = Client(group.listener.address, authkey=b"k")
        silent.send(("watch", 1))
        silent.close()                                # its process ended

    threading.Thread(target=node1, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="rank 1 on node 1 stopped while starting"):
            group._join(2, None, None, None, (None, None, b"k"))
    finally:
        group.listener.close()                        # ends the join thread's accept
    assert time.monotonic() - start < 10


def _start_node1(rendezvous: dict) -> subprocess.Popen:
    env = dict(os.environ, **rendezvous, PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
    return subprocess.Popen([sys.executable, "-m", "astream.face.cli", "worker", "--nnodes", "2",
                             "--node-rank", "1", "--tensor-parallel-size", "2", "--device", "cpu"],
                            env=env, stderr=subprocess.PIPE, text=True)


def test_a_rank_on_another_host_that_dies_frees_rank_0_from_a_collective(tiny_qwen3, monkeypatch):
    """As for a rank of rank 0's own host: over NCCL rank 0 would wait inside the device on
    a dead peer until NCCL's timeout. The other host's rank dies while rank 0 waits (here,
    a wait only the watch's abort ends); the start fails at once, naming the rank."""
    aborted = threading.Event()
    monkeypatch.setattr(workers, "abort_collectives", aborted.set, raising=False)
    monkeypatch.setattr(engine_core, "captures_graphs", lambda config, device: True)
    node1 = None

    def capture(spec, runner):
        node1.kill()
        if not aborted.wait(30):
            raise TimeoutError("rank 0 was never freed from its collective")
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(workers, "capture_graphs", capture)
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_rendezvous_port())}
    for name, value in rendezvous.items():
        monkeypatch.setenv(name, value)
    node1 = _start_node1(rendezvous)
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError,
                           match=r"tensor-parallel rank 1 on node 1 is gone \(its connection closed\)"):
            LLM(str(tiny_qwen3), tensor_parallel_size=2, nnodes=2, cuda_graph_max_batch=4, **KW)
        assert time.monotonic() - start < 60 and aborted.is_set()
        assert multiprocessing.active_children() == [] and not dist.is_initialized()
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.communicate()


def test_two_hosts_on_loopback_give_one_ranks_tokens(tiny_qwen3, monkeypatch):
    """Two processes that meet as two "hosts" through env:// on 127.0.0.1, one rank each:
    node 1 runs `astream worker` and takes every other setting from node 0. The port can
    still be taken before node 0 binds it (another program's listener): then both hosts
    start again on another one."""
    want, _ = _generate(tiny_qwen3, 1)
    for attempt in range(3):
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_rendezvous_port())}
        node1 = _start_node1(rendezvous)
        try:
            for name, value in rendezvous.items():
                monkeypatch.setenv(name, value)
            try:
                got, stats = _generate(tiny_qwen3, 2, nnodes=2)
            except Exception as exc:
                if attempt == 2 or not re.search("EADDRINUSE|address already in use", str(exc)):
                    raise
                continue
            _, errors = node1.communicate(timeout=60)      # it exits once node 0's engine stops
            assert node1.returncode == 0, errors
            break
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.communicate()
    _same_outputs(got, want)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
