"""Haystack filler: varied, plain sentences drawn from small word lists by a seeded generator.

The sentences hold no digits and no all-capital words, so no filler can be mistaken for a
key, a code or a variable name, and the needle is never the only line that differs.
"""

from __future__ import annotations

import random

_PEOPLE = ("the baker", "an old fisherman", "the young teacher", "a quiet farmer", "the gardener",
           "my neighbour", "the tailor", "a tired traveller", "the miller's daughter", "the painter",
           "a shepherd", "the librarian", "two children", "the carpenter", "a street musician")
_PLACES = ("the market", "the river bank", "the village square", "the hill road", "the harbour",
           "the orchard", "the old bridge", "the bakery", "the town hall", "the forest edge",
           "the narrow lane", "the quiet station", "the meadow", "the lighthouse", "the chapel")
_THINGS = ("a basket of apples", "a bundle of letters", "fresh bread", "a wooden chair", "a blue kite",
           "a jar of honey", "an umbrella", "a map of the coast", "a pair of boots", "some wild flowers",
           "a lantern", "a fishing net", "a loaf of rye", "a sack of flour", "a small drum")
_VERBS = ("carried", "painted", "found", "sold", "repaired", "borrowed", "dropped", "wrapped",
          "cleaned", "hid", "gave away", "looked at", "described", "forgot", "returned")
_MOVES = ("walked past", "waited near", "hurried to", "rested by", "wandered around", "sang near",
          "stopped at", "looked across", "strolled along", "turned towards")
_TIMES = ("in the morning", "before noon", "after the rain", "at dusk", "late in the evening",
          "on a windy day", "during the festival", "in early spring", "at the end of summer",
          "while the bells rang")
_WEATHER = ("The wind was cold", "The sky turned grey", "A light rain began", "The sun came out",
            "Fog covered the valley", "The air smelled of pine", "Clouds drifted slowly",
            "The evening was warm")
_MOODS = ("nobody seemed to mind", "everyone went on with their day", "the dogs barked at nothing",
          "the shops stayed open", "the roads were nearly empty", "a few birds circled overhead",
          "the kettle was already on", "the streets grew quiet")

_TEMPLATES = (
    lambda r: f"{_cap(r.choice(_TIMES))}, {r.choice(_PEOPLE)} {r.choice(_VERBS)} {r.choice(_THINGS)}.",
    lambda r: f"{_cap(r.choice(_PEOPLE))} {r.choice(_MOVES)} {r.choice(_PLACES)} {r.choice(_TIMES)}.",
    lambda r: f"{r.choice(_WEATHER)}, and {r.choice(_MOODS)}.",
    lambda r: f"{_cap(r.choice(_PEOPLE))} {r.choice(_VERBS)} {r.choice(_THINGS)} near {r.choice(_PLACES)}.",
    lambda r: f"Near {r.choice(_PLACES)}, {r.choice(_PEOPLE)} {r.choice(_VERBS)} {r.choice(_THINGS)}.",
    lambda r: f"{_cap(r.choice(_PEOPLE))} said that {r.choice(_MOODS)} {r.choice(_TIMES)}.",
    lambda r: f"{r.choice(_WEATHER)} when {r.choice(_PEOPLE)} {r.choice(_MOVES)} {r.choice(_PLACES)}.",
)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def filler_sentence(rng: random.Random) -> str:
    """One sentence; the same generator state always gives the same sentence."""
    return rng.choice(_TEMPLATES)(rng)


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    return [filler_sentence(rng) for _ in range(count)]
