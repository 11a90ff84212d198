"""LLM: the synchronous offline API (batch generate)."""

from __future__ import annotations

import itertools

from astream.config import EngineConfig
from astream.core import EngineCore
from astream.outputs import Completion
from astream.sampling import SamplingParams
from astream.tokenization import Prompt


class LLM:
    """Offline batch generation.

        llm = LLM()                                    # embedded SmolLM2-135M-Instruct
        llm = LLM("path/to/model", device="cpu", dtype="float32", num_kv_blocks=64)
        outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    """

    def __init__(self, model: str | None = None, **config) -> None:
        self.core = EngineCore.create(EngineConfig.from_kwargs(model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        prompts = _as_prompt_list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self.core.tokenize(p) for p in prompts]   # all errors before any work
        results: dict[str, Completion] = {}
        for ids, sp in zip(token_lists, params_list):
            rid = f"llm-{next(self._ids)}"
            self.core.add_request(rid, ids, sp)
            results[rid] = Completion(rid, ids)
        while self.core.scheduler.has_work():
            for event in self.core.step():
                out = results[event.seq.request_id]
                out.token_ids.append(event.token_id)
                out.text += event.text
                out.finish_reason = event.finish_reason
        return list(results.values())

    def stats(self) -> dict:
        return self.core.stats()


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """A single prompt (string, token ids or one chat) becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(p, dict) for p in prompts):
        return [prompts]
    if isinstance(prompts, list) and not prompts:
        raise ValueError("no prompts given")
    return list(prompts)
