"""RULER-style aggregation tasks: the answer is a count over the whole text, not one place in it.

There is no needle, so the asked depth only changes the seed. The haystack is the task's own
text, grown to the prompt length (problem.Body); the words a correct answer names are chosen
before the size is known, and every size keeps them strictly the most frequent.
"""

from __future__ import annotations

import random
from typing import Callable

from astream.eval.problem import WORD, Body, Problem

COMMON_WORDS = 10
FREQUENT_WORDS = 3

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_RARE_MOST = 2                 # a rare word appears once or twice
_COMMON_FEWEST = _RARE_MOST + 1
_COMMON_MOST = 30              # RULER's repeat count for its common words
_ENTRIES_PER_REPEAT = 30       # list entries per repeat of each common word (the common third)
_ZIPF_EXPONENT = 2             # RULER's exponent for its coded text


def made_up_word(rng: random.Random, taken: set[str], syllables: int = 3) -> str:
    """A pronounceable word that is no English word one would meet ('tamoki'), unlike every
    string in `taken`: the vocabulary never runs out and no word is more familiar than another."""
    return _new_word(taken, lambda: "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS)
                                            for _ in range(syllables)))


def coded_word(rng: random.Random, taken: set[str], letters: int = 5) -> str:
    """Random lowercase letters ('qzvkt'), unlike every string in `taken`."""
    return _new_word(taken, lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                            for _ in range(letters)))


def _new_word(taken: set[str], draw: Callable[[], str]) -> str:
    """The first word `draw` gives that is not in `taken`, added to it."""
    while (word := draw()) in taken:
        pass
    taken.add(word)
    return word


def common_repeats(entries: int) -> int:
    """How often each common word appears in a list of `entries` words."""
    return max(_COMMON_FEWEST, min(_COMMON_MOST, entries // _ENTRIES_PER_REPEAT))


def cwe(rng: random.Random, length: int, depth: float) -> Problem:
    """Common words extraction: a numbered list of made-up words where ten words appear
    `common_repeats` times each (3 to 30) and every other word once or twice."""
    taken: set[str] = set()
    common = [made_up_word(rng, taken) for _ in range(COMMON_WORDS)]
    seed = rng.getrandbits(64)

    def text(entries: int) -> str:
        # The rare words come from one stream for every size, so a larger size adds words and
        # the token count grows with it, which the length search relies on.
        stream = random.Random(f"cwe/{seed}/words")
        words = [word for word in common for _ in range(common_repeats(entries))]
        others = set(common)
        while len(words) < entries:
            word = made_up_word(stream, others)
            words += [word] * min(stream.randint(1, _RARE_MOST), entries - len(words))
        random.Random(f"cwe/{seed}/{entries}").shuffle(words)
        return "\n".join(f"{n}. {word}" for n, word in enumerate(words, 1))

    return Problem(intro="Below is a numbered list of made-up words. Some words appear in it far more "
                         "often than the others: keep count of how often each word appears.",
                   question=f"What are the {COMMON_WORDS} most common words in the list above? Answer "
                            f"with the {COMMON_WORDS} words only, separated by commas.",
                   inserts=(), expected=tuple(common), kind=WORD, max_tokens=80,
                   body=Body(text, smallest=COMMON_WORDS * (_COMMON_FEWEST + 1)))


def zipf_counts(top: int) -> list[int]:
    """Occurrences by rank when the most frequent word appears `top` times: rank k appears
    top // k**2 times, down to once."""
    counts = []
    rank = 1
    while (count := top // rank ** _ZIPF_EXPONENT) > 0:
        counts.append(count)
        rank += 1
    return counts


def fwe(rng: random.Random, length: int, depth: float) -> Problem:
    """Frequent words extraction: a text of coded words whose counts follow Zipf's law
    (`zipf_counts`); the seed picks the words and their order. From 32 occurrences of the most
    frequent word up, the third is strictly ahead of the fourth."""
    taken: set[str] = set()
    frequent = [coded_word(rng, taken) for _ in range(FREQUENT_WORDS)]
    seed = rng.getrandbits(64)

    def text(top: int) -> str:
        counts = zipf_counts(top)
        stream, others = random.Random(f"fwe/{seed}/words"), set(frequent)
        vocabulary = frequent + [coded_word(stream, others) for _ in range(len(counts) - FREQUENT_WORDS)]
        words = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
        random.Random(f"fwe/{seed}/{top}").shuffle(words)
        return " ".join(words)

    return Problem(intro="Below is a text written in coded words. Keep count of how often each coded "
                         "word appears.",
                   question=f"What are the {FREQUENT_WORDS} most frequent coded words in the text above? "
                            f"Answer with the {FREQUENT_WORDS} words only.",
                   inserts=(), expected=tuple(frequent), kind=WORD, max_tokens=32,
                   body=Body(text, smallest=32))
