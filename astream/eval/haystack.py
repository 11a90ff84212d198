"""A problem rendered as a prompt of an exact token length, its sentences at their depths.

The length counts the whole prompt as the model sees it: one user message (intro, haystack,
question) rendered with the tokenizer's chat template, or, for a model without one, the plain
text with the question at the end. A problem with a body (the aggregation tasks) has no
filler: its haystack is the body's text at the largest size that fits.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from astream.eval.filler import filler_sentences
from astream.eval.problem import Body, Problem

_BATCH = 128          # filler sentences generated and counted per tokenizer call
_MAX_TRIMS = 64       # sentences dropped at most when the joined text counts more than its parts


@dataclass(slots=True, frozen=True)
class BuiltPrompt:
    ids: tuple[int, ...]
    needle_depth: float     # share of the filler tokens before the problem's first insert


def render(tokenizer, content: str) -> list[int]:
    """Token ids of one user message, exactly as the engine would see a chat prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(content)["input_ids"])


def build_prompt(tokenizer, problem: Problem, length: int, rng: random.Random) -> BuiltPrompt:
    """At most `length` tokens, and fewer only by less than one filler sentence (or one step
    of the body's size)."""
    if problem.body is not None:
        return BuiltPrompt(tuple(_fit_body(tokenizer, problem, problem.body, length)), 0.0)
    frame = len(render(tokenizer, _content(problem, "")))
    inserts = sum(_count(tokenizer, [i.text for i in problem.inserts]))
    budget = length - frame - inserts
    if budget < 0:
        raise ValueError(f"a prompt of {length} tokens is too short for this task: its question and "
                         f"hidden sentences alone take {frame + inserts} tokens")
    sentences, counts = _fill(tokenizer, rng, budget)
    for _ in range(_MAX_TRIMS):
        text, depth = _assemble(sentences, counts, problem)
        ids = render(tokenizer, _content(problem, text))
        if len(ids) <= length:
            return BuiltPrompt(tuple(ids), depth)
        sentences.pop()
        counts.pop()
    raise RuntimeError(f"could not fit the prompt into {length} tokens: this tokenizer counts "
                       "joined sentences very differently from single ones")


def _fit_body(tokenizer, problem: Problem, body: Body, length: int) -> list[int]:
    """The prompt of the largest body size that fits: sizes double until one does not fit,
    then bisect. The body's text only roughly grows with its size, so every size tried is
    checked and the result always fits."""
    def fitting(size: int) -> list[int] | None:
        ids = render(tokenizer, _content(problem, body.text(size)))
        return ids if len(ids) <= length else None

    low, best = body.smallest, fitting(body.smallest)
    if best is None:
        smallest = len(render(tokenizer, _content(problem, body.text(body.smallest))))
        raise ValueError(f"a prompt of {length} tokens is too short for this task: its question and "
                         f"smallest text take {smallest} tokens")
    high = 2 * low
    while (ids := fitting(high)) is not None:
        low, best, high = high, ids, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if (ids := fitting(middle)) is not None:
            low, best = middle, ids
        else:
            high = middle
    return best


def _content(problem: Problem, haystack: str) -> str:
    return f"{problem.intro}\n\n{haystack}\n\n{problem.question}"


def _count(tokenizer, sentences: list[str]) -> list[int]:
    """Tokens of each sentence as it appears in the haystack: after a space."""
    if not sentences:
        return []
    encoded = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    return [len(ids) for ids in encoded]


def _fill(tokenizer, rng: random.Random, budget: int) -> tuple[list[str], list[int]]:
    """Filler sentences in order while they fit in `budget` tokens."""
    sentences: list[str] = []
    counts: list[int] = []
    total = 0
    while True:
        batch = filler_sentences(rng, _BATCH)
        for sentence, count in zip(batch, _count(tokenizer, batch)):
            if total + count > budget:
                return sentences, counts
            sentences.append(sentence)
            counts.append(count)
            total += count


def _assemble(sentences: list[str], counts: list[int], problem: Problem) -> tuple[str, float]:
    """The haystack text with each insert at the sentence boundary nearest its position."""
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    total = bounds[-1]
    at_boundary: dict[int, list[str]] = {}
    first_depth = 0.0
    for n, insert in enumerate(problem.inserts):
        if not 0.0 <= insert.position <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {insert.position}")
        index = _nearest(bounds, insert.position * total)
        at_boundary.setdefault(index, []).append(insert.text)
        if n == 0:
            first_depth = bounds[index] / total if total else 0.0
    pieces: list[str] = []
    for index, sentence in enumerate(sentences):
        pieces += at_boundary.get(index, [])
        pieces.append(sentence)
    pieces += at_boundary.get(len(sentences), [])
    return " ".join(pieces), first_depth


def _nearest(bounds: list[int], target: float) -> int:
    right = bisect.bisect_left(bounds, target)
    if right == 0:
        return 0
    if right == len(bounds):
        return len(bounds) - 1
    return right if bounds[right] - target < target - bounds[right - 1] else right - 1
