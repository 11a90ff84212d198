"""Fairness: one client's burst or unread streams cannot hold another client's first token."""

from __future__ import annotations

import json

import anyio
import anyio.abc
import pytest
from websockets.asyncio.client import connect

from astream import Engine, SamplingParams
from astream.base.sampling import SamplingParams as P
from astream.core.scheduler import Scheduler, SchedulerConfig
from astream.core.sequence import Sequence, SequenceStatus
from astream.kvcache.block_manager import BlockManager
from server_helpers import Wire, generate, health, serving

ENGINE_KW = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=1024)
ENDLESS = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---- the scheduler alone ----------------------------------------------------------------

def make(max_seqs: int = 4, blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, 64, 64), BlockManager(blocks, 4))


def add(sched: Scheduler, name: str, client: str, arrival: int) -> Sequence:
    seq = Sequence(name, [1, 2, 3], P(max_tokens=8), arrival, client)
    sched.add(seq)
    return seq


def test_admission_alternates_between_clients():
    sched = make(max_seqs=4)
    for i in range(4):
        add(sched, f"a{i}", "a", i)
    add(sched, "b0", "b", 10)
    batch = sched.schedule()
    assert [item.seq.request_id for item in batch.items] == ["a0", "b0", "a1", "a2"]


def test_a_full_house_gives_a_slot_to_a_new_client():
    sched = make(max_seqs=4)
    hogs = [add(sched, f"a{i}", "a", i) for i in range(4)]
    sched.schedule()
    assert all(s.status is SequenceStatus.RUNNING for s in hogs)
    newcomer = add(sched, "b0", "b", 10)
    batch = sched.schedule()
    assert newcomer in [item.seq for item in batch.items]
    assert hogs[-1].status is SequenceStatus.WAITING                 # the newest hog yields
    assert sched.preemptions == 1
    sched.schedule()
    assert hogs[-1].status is SequenceStatus.WAITING                 # 3 to 1: no more swapping
    assert sched.preemptions == 1


def test_paused_sequences_park_when_others_wait_and_return_when_resumed():
    sched = make(max_seqs=2)
    a, _ = add(sched, "a", "x", 0), add(sched, "b", "x", 1)
    sched.schedule()
    sched.pause(a)
    c = add(sched, "c", "x", 2)
    batch = sched.schedule()
    assert [item.seq for item in batch.items] == [c]
    assert a in sched.parked and a.block_table == []
    sched.resume(a)
    assert a in sched.waiting and a not in sched.parked
    sched.finish(c)
    assert a in [item.seq for item in sched.schedule().items]


# ---- through the engine -------------------------------------------------------------------

@pytest.mark.anyio
async def test_another_clients_first_token_comes_within_a_few_steps():
    async with Engine(max_num_seqs=4, **ENGINE_KW) as engine:
        hogs = [await engine.request(f"Story {i}:", ENDLESS, client="hog") for i in range(4)]
        while engine.stats()["running"] < 4:
            await anyio.sleep(0.01)
        before = engine.stats()["steps"]
        async for _ in engine.stream("Hi", SamplingParams(temperature=0, max_tokens=1), client="b"):
            break
        assert engine.stats()["steps"] - before <= 4
        for hog in hogs:
            await hog.aclose()


@pytest.mark.anyio
async def test_unread_streams_give_their_slots_to_waiting_requests(smol_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    async with Engine(max_num_seqs=2, stream_buffer_tokens=4, **ENGINE_KW) as engine:
        idle_free = engine.stats()["kv_blocks_free"]
        stalled = [await engine.request(f"Count to {i}:", params) for i in (3, 5)]
        firsts = [await s.__anext__() for s in stalled]                # then stop reading
        while engine.stats()["paused"] < 2:
            await anyio.sleep(0.01)
        third = await engine.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))
        assert len(third.token_ids) == 8                              # it got a slot
        assert engine.stats()["paused"] == 2
        for i, (stream, first) in zip((3, 5), zip(stalled, firsts)):
            rest = [tok.token_id async for tok in stream]            # reading resumes them
            assert [first.token_id] + rest == smol_llm.generate([f"Count to {i}:"], params)[0].token_ids
        while engine.stats()["kv_blocks_free"] != idle_free:
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_client_holding_every_slot_unread_cannot_starve_another():
    async with serving({"max_num_seqs": 4}, max_requests_per_connection=4) as srv:
        async with connect(srv.url, max_queue=1) as hog, connect(srv.url) as ws:
            for i in range(4):                                # never read
                await Wire(hog).send(generate(f"h{i}", f"Story {i}:", temperature=0, max_tokens=64,
                                              ignore_eos=True))
            while (await health(srv.port))["running"] < 4:
                await anyio.sleep(0.01)
            before = (await health(srv.port))["steps"]
            wire = Wire(ws)
            await wire.send(generate("b", "Hi", temperature=0, max_tokens=2))
            await wire.first_token("b")
            assert (await health(srv.port))["steps"] - before <= 6



@pytest.mark.anyio
async def test_over_http_each_machine_is_one_client():
    """Eight streams from one address hold every slot and more wait; a request from another
    address (127.0.0.2) still gets its first token within a few steps."""
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Story:", "max_tokens": 300,
                       "ignore_eos": True, "stream": True}).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async def first_chunk(port: int, local_host: str) -> anyio.abc.SocketStream:
        sock = await anyio.connect_tcp("127.0.0.1", port, local_host=local_host)
        await sock.send(request)
        seen = b""
        while b"data: {" not in seen:
            seen += await sock.receive()
        return sock

    async with serving({"max_num_seqs": 2}, max_tokens_cap=300) as srv:
        async with anyio.create_task_group() as group:
            hogs = []

            async def hog() -> None:
                sock = await anyio.connect_tcp("127.0.0.1", srv.port, local_host="127.0.0.1")
                hogs.append(sock)
                await sock.send(request)

            for _ in range(8):
                group.start_soon(hog)
        with anyio.fail_after(60):
            while (await health(srv.port))["waiting"] < 6:
                await anyio.sleep(0.05)
        before = (await health(srv.port))["steps"]
        with anyio.fail_after(30):
            bystander = await first_chunk(srv.port, "127.0.0.2")
        assert (await health(srv.port))["steps"] - before <= 6
        for sock in [bystander, *hogs]:
            await sock.aclose()


# ---- short prompts while long ones prefill -----------------------------------------------

def test_a_short_prompt_goes_ahead_of_long_prefills_of_its_own_client():
    sched = Scheduler(SchedulerConfig(4, 64, 1024, short_prompt_tokens=16), BlockManager(256, 4))
    longs = [Sequence(f"long{i}", [1] * 400, P(max_tokens=8), i, "c") for i in range(3)]
    for seq in longs:
        sched.add(seq)
    sched.schedule()
    short = Sequence("short", [2] * 10, P(max_tokens=8), 10, "c")    # same client, last to come
    sched.add(short)
    batch = sched.schedule()
    chunks = {item.seq.request_id: item.num_tokens for item in batch.items}
    assert chunks["short"] == 10                          # its whole prompt, this step
    assert chunks["long0"] == 16                          # a quick step: a quarter for long chunks
    assert sum(chunks.values()) == 26
    chunks = {item.seq.request_id: item.num_tokens for item in sched.schedule().items}
    assert chunks["long0"] == 64                          # no short waits: the whole budget again


def test_a_long_prompt_first_in_fairness_order_does_not_hold_back_a_short_one():
    """Each websocket connection is a client: a long prompt of an idle connection comes before
    a short one of a busy connection. Once the step's long share is spent, the short one still
    starts, so the next step is a full one again."""
    sched = Scheduler(SchedulerConfig(4, 64, 1024, short_prompt_tokens=16), BlockManager(256, 4))
    sched.add(Sequence("long-a", [1] * 400, P(max_tokens=8), 0, "a"))
    sched.add(Sequence("busy", [3] * 4, P(max_tokens=50), 1, "s"))
    sched.schedule()
    sched.add(Sequence("long-b", [1] * 400, P(max_tokens=8), 2, "b"))     # idle client: first
    sched.add(Sequence("short", [2] * 10, P(max_tokens=8), 3, "s"))
    chunks = {item.seq.request_id: item.num_tokens for item in sched.schedule().items}
    assert chunks["short"] == 10 and chunks["long-a"] == 16 and "long-b" not in chunks
    chunks = {item.seq.request_id: item.num_tokens for item in sched.schedule().items}
    assert chunks["long-a"] + chunks.get("long-b", 0) >= 60                # no short waits now


def test_long_prefill_advances_when_a_quarter_budget_is_less_than_an_aligned_chunk():
    """With offload, chunks end on block boundaries: a quarter of a small budget is less than
    one block, and a short prompt arriving every step would have held the long one forever."""
    config = SchedulerConfig(8, 64, 2048, short_prompt_tokens=16, align_chunks_to=32,
                             prefer_chunks_of=32)
    sched = Scheduler(config, BlockManager(256, 32))
    long = Sequence("long", [1] * 600, P(max_tokens=4), 0, "c")
    sched.add(long)
    sched.schedule()
    for step in range(4):
        sched.add(Sequence(f"short{step}", [2] * 10, P(max_tokens=1), 1 + step, "c"))
        chunks = {item.seq.request_id: item.num_tokens for item in sched.schedule().items}
        assert chunks[f"short{step}"] == 10 and chunks["long"] == 32


def test_a_long_prompt_that_gets_no_chunk_does_not_hold_back_a_short_one():
    """A long prompt first in fairness order whose share this step is too small for an aligned
    chunk is skipped for the short one behind it, not waited for."""
    config = SchedulerConfig(4, 64, 2048, short_prompt_tokens=16, align_chunks_to=16,
                             prefer_chunks_of=16)
    sched = Scheduler(config, BlockManager(256, 16))
    sched.add(Sequence("busy", [3] * 4, P(max_tokens=50), 0, "s"))
    sched.schedule()
    sched.add(Sequence("long-a", [1] * 136, P(max_tokens=8), 1, "a"))
    for _ in range(2):                                # the whole budget twice: 8 tokens left
        assert {i.seq.request_id: i.num_tokens for i in sched.schedule().items}["long-a"] == 64
    sched.add(Sequence("long-b", [1] * 500, P(max_tokens=8), 2, "b"))     # idle client: first
    sched.add(Sequence("short", [2] * 10, P(max_tokens=8), 3, "s"))
    chunks = {item.seq.request_id: item.num_tokens for item in sched.schedule().items}
    # long-a's last 8 tokens leave 8 of the 16-token share: no aligned chunk for long-b
    assert chunks["long-a"] == 8 and "long-b" not in chunks and chunks["short"] == 10


def test_without_short_prompts_waiting_long_prefills_take_the_whole_budget():
    sched = Scheduler(SchedulerConfig(4, 64, 1024, short_prompt_tokens=16), BlockManager(256, 4))
    sched.add(Sequence("long", [1] * 400, P(max_tokens=8), 0, "c"))
    sched.add(Sequence("long2", [1] * 400, P(max_tokens=8), 1, "c"))
    assert [item.num_tokens for item in sched.schedule().items] == [64]
    assert [item.num_tokens for item in sched.schedule().items] == [64]


@pytest.mark.anyio
async def test_a_short_request_gets_its_first_token_while_long_prompts_prefill():
    long_prompt = " ".join(f"word{i}" for i in range(220))          # several chunks of 256
    async with Engine(max_num_seqs=8, max_num_batched_tokens=256, **ENGINE_KW) as engine:
        longs = [await engine.request(f"{i} {long_prompt}", SamplingParams(temperature=0, max_tokens=4))
                 for i in range(4)]
        with anyio.fail_after(60):
            while engine.stats()["steps"] < 1:
                await anyio.sleep(0.005)
            before = engine.stats()["steps"]
            async for _ in engine.stream("Hi", SamplingParams(temperature=0, max_tokens=1)):
                break
        assert engine.stats()["steps"] - before <= 3           # not after four long prefills
        for stream in longs:
            await stream.aclose()


@pytest.mark.anyio
async def test_a_long_prefill_step_is_emitted_before_the_next_step_is_scheduled(monkeypatch):
    """A step of at least half the token budget runs alone, so a request arriving while it
    runs joins the very next step; other steps stay pipelined."""
    from astream.core.engine_core import EngineCore

    events, real_schedule, real_process = [], EngineCore.schedule, EngineCore.process

    def schedule(self):
        batch = real_schedule(self)
        if batch is not None:
            events.append(("scheduled", batch.step, batch.num_tokens))
        return batch

    def process(self, output):
        events.append(("emitted", output.batch.step, output.batch.num_tokens))
        return real_process(self, output)

    monkeypatch.setattr(EngineCore, "schedule", schedule)
    monkeypatch.setattr(EngineCore, "process", process)
    long_prompt = " ".join(f"word{i}" for i in range(200))       # about 750 tokens
    async with Engine(max_num_seqs=8, max_num_batched_tokens=256, **ENGINE_KW) as engine:
        with anyio.fail_after(60):
            await engine.generate(long_prompt, SamplingParams(temperature=0, max_tokens=6))
    big = [step for kind, step, tokens in events if kind == "scheduled" and tokens >= 128]
    assert len(big) >= 2                                  # several long chunks
    for step in big:
        emitted = events.index(("emitted", step, next(t for k, s, t in events if s == step)))
        later = [i for i, e in enumerate(events) if e[0] == "scheduled" and e[1] == step + 1]
        assert not later or later[0] > emitted            # the next one waited for it


def test_short_prompts_of_a_busy_client_do_not_starve_another_clients_long_one():
    sched = Scheduler(SchedulerConfig(4, 64, 1024, short_prompt_tokens=16), BlockManager(256, 4))
    for i in range(4):
        sched.add(Sequence(f"a{i}", [1] * 8, P(max_tokens=200), i, "a"))
    sched.schedule()
    sched.add(Sequence("b", [1] * 40, P(max_tokens=4), 10, "b"))          # long, another client
    for i in range(2):
        sched.add(Sequence(f"a-short{i}", [2] * 8, P(max_tokens=4), 11 + i, "a"))
    running = {item.seq.request_id for item in sched.schedule().items}
    assert "b" in running                                 # a's newest yields its slot to b
