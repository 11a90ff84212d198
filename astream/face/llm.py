"""LLM: the synchronous offline API, a thin facade over the async Engine."""

from __future__ import annotations

import weakref

import anyio

from astream.base.outputs import Completion
from astream.base.sampling import SamplingParams
from astream.engine.engine import Engine
from astream.runtime.loop_thread import LoopThread
from astream.text.tokenization import Prompt


class LLM:
    """Offline batch generation.

        llm = LLM()                                    # embedded SmolLM2-135M-Instruct
        llm = LLM("path/to/model", device="cpu", dtype="float32", num_kv_blocks=64)
        outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))

    The engine runs on an event loop in a background thread; `generate` blocks
    until every prompt is done. Loading shows its progress on stderr when stderr is a
    terminal; `show_progress=False` (or ASTREAM_SHOW_PROGRESS=0) keeps it quiet.
    """

    def __init__(self, model: str | None = None, **config) -> None:
        self._engine = Engine(model, **config)
        self._loop = LoopThread()
        self._engine_cm = self._loop.portal.wrap_async_context_manager(self._engine)
        try:
            self._engine_cm.__enter__()
        except BaseException:
            self._loop.stop()
            raise
        # Runs on close(), garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self._engine_cm, self._loop)

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def core(self):
        return self._engine.core

    @property
    def tokenizer(self):
        return self._engine.core.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        prompts = _as_prompt_list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        return self._loop.call(self._generate_all, prompts, params_list)

    async def _generate_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[Completion]:
        core = self._engine.core
        token_lists = [core.tokenize(p) for p in prompts]          # every error before any work
        for ids in token_lists:
            core.check_prompt_length(len(ids))
        results: list[Completion | None] = [None] * len(prompts)

        async def run(index: int) -> None:
            results[index] = await self._engine.generate(token_lists[index], params[index])

        async with anyio.create_task_group() as group:
            for index in range(len(prompts)):
                group.start_soon(run, index)
        return results

    def stats(self) -> dict:
        return self._engine.stats()

    def close(self) -> None:
        """Stop the engine and free its memory. Also runs when the LLM is garbage-collected."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _shutdown(engine_cm, loop: LoopThread) -> None:
    try:
        engine_cm.__exit__(None, None, None)
    finally:
        loop.stop()


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """A single prompt (string, token ids or one chat) becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) for p in prompts) or all(isinstance(p, dict) for p in prompts):
        return [prompts]
    return list(prompts)
