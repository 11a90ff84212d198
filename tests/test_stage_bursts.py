"""A burst of requests reaches the scheduler together (stages/burst.py): a batch from
`LLM.generate` is prefilled in one step, not a few requests a step while others decode."""

from __future__ import annotations

import anyio

from astream import LLM, SamplingParams
from astream.stages import burst

PROMPTS = [f"Request {i}: name a colour." for i in range(100)]   # more than a channel holds


def test_with_queued_takes_everything_waiting_behind_the_first_item():
    async def main():
        send, receive = anyio.create_memory_object_stream(8)
        for item in range(5):
            await send.send(item)
        first = await receive.receive()
        assert burst.with_queued(first, receive) == [0, 1, 2, 3, 4]
        assert burst.with_queued("alone", receive) == ["alone"]
        send.close()
        assert burst.with_queued("last", receive) == ["last"]      # a closed, empty channel

    anyio.run(main)


def test_a_generate_batch_is_prefilled_in_one_step(smollm2_path):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(smollm2_path, device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=128,
             max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, params)
        steps = llm.stats()["steps"]
    assert all(len(o.token_ids) == 4 for o in outs)
    # One step prefills all 100 prompts (their first tokens), three more decode the rest.
    assert steps == 4
