"""Bad frames get error frames and the connection goes on; oversize frames close it."""

from __future__ import annotations

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from astream import SamplingParams
from server_helpers import GREEDY, LONG, OPTIONS, PROMPTS, Wire, check_against, cut_short, generate, health, wait_idle


@pytest.fixture(scope="module")
def expected(smol_llm):
    return [smol_llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS]


BAD_FRAMES = [
    ("not json", "invalid_json", None),
    (b"\x00\x01binary", "binary_frame", None),
    ('["a", "list"]', "invalid_field", None),
    ({"type": "summon", "id": "x"}, "unknown_type", "x"),
    ({"type": "generate", "id": "x"}, "invalid_field", "x"),
    ({"type": "generate", "id": 7, "prompt": "hi"}, "invalid_field", None),
    ({"type": "generate", "id": "x", "prompt": ""}, "invalid_field", "x"),
    ({"type": "generate", "id": "x", "prompt": "hi", "parms": {}}, "unknown_field", "x"),
    (generate("x", "hi", temperature="hot"), "invalid_field", "x"),
    (generate("x", "hi", top_p=2.0), "invalid_field", "x"),
    (generate("x", "hi", max_tokens=8, beam_width=4), "unknown_param", "x"),
    (generate("x", "hi", max_tokens=65), "max_tokens_cap", "x"),
    (generate("x", "hello " * 2100, max_tokens=8), "prompt_too_long", "x"),
    ({"type": "cancel", "id": "nobody"}, "unknown_id", "nobody"),
]


@pytest.mark.anyio
async def test_bad_input_gets_error_frames_and_the_connection_goes_on(server, expected, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("bg", PROMPTS[0], **GREEDY))      # must go on meanwhile
        for frame, code, request_id in BAD_FRAMES:
            await wire.send(frame)
            error = await wire.error()
            assert (error["code"], error["id"]) == (code, request_id), (frame, error)
            assert error["message"]
        check_against(await wire.until_end("bg"), expected[0])
        await wire.send(generate("dup", "Tell me a long story.", **LONG))
        await wire.send(generate("dup", "hi", max_tokens=4))
        assert (await wire.error())["code"] == "duplicate_id"
        for i in range(3):                                       # the limit is 4 live requests
            await wire.send(generate(f"fill{i}", "Tell me a long story.", **LONG))
        await wire.send(generate("fifth", "hi", max_tokens=4))
        assert (await wire.error()) == {"type": "error", "id": "fifth", "code": "too_many_requests",
                                        "message": "this connection already has 4 live requests, "
                                                   "the server's limit"}
        for request_id in ("dup", "fill0", "fill1", "fill2"):
            await wire.send({"type": "cancel", "id": request_id})
        for request_id in ("dup", "fill0", "fill1", "fill2"):
            assert (await wire.until_end(request_id))[-1]["finish_reason"] == "abort"
        await wire.send(generate("after", PROMPTS[1], **GREEDY))
        check_against(await wire.until_end("after"), expected[1])
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_oversize_frame_closes_1009_and_frees_requests(server, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("long", "Tell me a long story.", **LONG))
        await wire.first_token("long")
        before = await health(server.port)
        await wire.send(generate("big", "a" * (OPTIONS["max_frame_bytes"] + 1)))
        with pytest.raises(ConnectionClosed):
            await wire.until_end("long")
        assert ws.close_code == 1009
    assert cut_short(before, await wait_idle(server.port, idle_free))
