"""Property-based fuzzing of the websocket protocol with generated frames.

Every frame gets exactly one well-formed answer: one error frame, or (for a request
that was accepted) a stream of progress and token frames ending in one terminal frame.
The connection keeps serving, and the server stays healthy with every KV block back.
"""

from __future__ import annotations

import itertools
import json

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from astream import Engine
from astream.server import ServerOptions, StreamServer
from astream.server.protocol import MAX_ID_CHARS
from server_helpers import ENGINE_KW, health

ERROR_CODES = {"invalid_json", "binary_frame", "unknown_type", "invalid_field", "unknown_field",
               "unknown_param", "max_tokens_cap", "prompt_too_long", "invalid_prompt",
               "duplicate_id", "unknown_id", "too_many_requests", "shutting_down", "engine_error",
               "internal"}
PARAM_NAMES = ["temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids",
               "ignore_eos", "beam_width"]

# Text including lone surrogates, which JSON can carry as escapes ("\ud800").
text = st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
               max_size=12)
numbers = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, 2, 4, 2**63 - 1, 2**63, 2**64, -1]))
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)
params = st.dictionaries(st.sampled_from(PARAM_NAMES), json_values, max_size=4)
valid_params = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional={
    "temperature": st.sampled_from([0, 0.5, 1.0]), "top_k": st.sampled_from([0, 1, 5, 2**63 - 1]),
    "stop": st.lists(st.text(max_size=3), max_size=3), "seed": st.integers(-2**63, 2**64 - 1)})
prompts = st.one_of(text, st.lists(st.integers(-5, 60_000), max_size=6), json_values,
                    st.just("The quick brown fox"))
generate_frames = st.fixed_dictionaries(
    {"type": st.just("generate"), "id": st.one_of(text, json_values)},
    optional={"prompt": prompts, "messages": json_values,
              "params": st.one_of(params, valid_params, json_values), "extra": json_values})
frames = st.one_of(
    generate_frames,
    st.fixed_dictionaries({"type": st.sampled_from(["generate"]), "id": text, "prompt": text,
                           "params": valid_params}),
    st.fixed_dictionaries({"type": st.sampled_from(["cancel", "summon"]), "id": json_values}),
    json_values, text, st.binary(max_size=8))


@pytest.fixture(scope="module")
def portal_server():
    """A server on its own event loop thread, so hypothesis can drive it from plain tests."""
    with anyio.from_thread.start_blocking_portal() as portal:
        engine = Engine(**ENGINE_KW)
        with portal.wrap_async_context_manager(engine):
            options = ServerOptions(port=0, max_tokens_cap=4, max_requests_per_connection=4)
            with portal.wrap_async_context_manager(StreamServer(engine, options)) as server:
                yield portal, server


def encoded(frame) -> str | bytes:
    if isinstance(frame, (str, bytes)):
        return frame
    return json.dumps(frame, ensure_ascii=True)           # surrogates travel escaped; NaN as NaN


def usable_id(frame) -> str | None:
    """The id the server answers with: a string of 1 to 256 characters, no lone surrogate."""
    value = frame.get("id") if isinstance(frame, dict) else None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def check_well_formed(frame: dict) -> None:
    kind = frame["type"]
    assert kind in ("token", "progress", "done", "error"), frame
    if kind == "error":
        assert frame["code"] in ERROR_CODES and isinstance(frame["message"], str), frame
    elif kind == "token":
        assert isinstance(frame["index"], int) and isinstance(frame["text"], str), frame
    elif kind == "done":
        assert frame["finish_reason"] in ("stop", "length", "abort"), frame


async def exchange(url: str, sent: list) -> None:
    syncs = itertools.count()
    async with connect(url, max_size=None) as ws:
        for frame in sent:
            await ws.send(encoded(frame))
            sync = f"~sync~{next(syncs)}"
            await ws.send(json.dumps({"type": "cancel", "id": sync}))
            answers = await collect_until(ws, sync, usable_id(frame))
            check_answers(answers, usable_id(frame))


async def collect_until(ws, sync: str, request_id: str | None) -> list[dict]:
    """Frames answering one sent frame. Frames are handled in order, so a refusal comes
    before the sync marker's answer; a frame with nothing before it was accepted as a
    request, and its frames are read to the terminal one."""
    answers, synced = [], False
    with anyio.fail_after(60):
        while not synced or (answers == [] and request_id is not None) or \
                (answers and answers[-1]["type"] in ("token", "progress")):
            frame = json.loads(await ws.recv())
            check_well_formed(frame)
            if frame["id"] == sync:
                assert frame["code"] == "unknown_id", frame
                synced = True
                continue
            assert frame["id"] in (None, request_id), frame
            answers.append(frame)
    return answers


def check_answers(answers: list[dict], request_id: str | None) -> None:
    kinds = [a["type"] for a in answers]
    if "done" in kinds or "token" in kinds or "progress" in kinds:
        terminal = kinds[-1]
        assert terminal in ("done", "error") and kinds.count("done") + kinds.count("error") == 1
        assert all(a["id"] == request_id for a in answers)
        return
    assert kinds == ["error"], answers                   # refused: exactly one error frame


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sent=st.lists(frames, min_size=1, max_size=4))
def test_every_frame_gets_one_well_formed_answer(portal_server, sent):
    portal, server = portal_server
    portal.call(exchange, server.url, sent)
    stats = portal.call(health, server.port)
    assert stats["status"] == "ok"


def test_after_fuzzing_every_block_is_back(portal_server):
    portal, server = portal_server

    async def idle() -> dict:
        with anyio.fail_after(20):
            while True:
                stats = await health(server.port)
                if stats["requests"] == 0 and stats["running"] == 0 and \
                        stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                    return stats
                await anyio.sleep(0.05)

    assert portal.call(idle)["live_requests"] == 0
