"""Find stop strings in streamed text in time proportional to the text, not to the stop count.

An Aho-Corasick automaton over the stop strings is fed each piece of new text once.
Its state is the longest suffix of the text so far that is a prefix of some stop
string, which is also exactly the text that must be held back from the caller: it
could still grow into a stop string.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class StopMatcher:
    goto: list[dict[str, int]]
    fail: list[int]
    depth: list[int]                  # length of the prefix a state stands for
    match: list[int]                  # longest stop string ending at the state, 0 if none
    state: int = 0
    fed: int = 0                      # characters fed so far

    @classmethod
    def build(cls, stops: tuple[str, ...]) -> "StopMatcher":
        goto: list[dict[str, int]] = [{}]
        depth, match = [0], [0]
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    match.append(0)
                state = nxt
            match[state] = depth[state]
        return cls(goto, _failure_links(goto, match), depth, match)

    @property
    def held(self) -> int:
        """Characters at the end of the text that may be the start of a stop string."""
        return self.depth[self.state]

    def feed(self, text: str) -> int | None:
        """Consume new text. Returns where (in all text fed) the first completed stop
        string starts, or None. Of stop strings ending at the same character, the longest wins."""
        goto, fail, state = self.goto, self.fail, self.state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if self.match[state]:
                self.state = state
                return self.fed + i + 1 - self.match[state]
        self.state = state
        self.fed += len(text)
        return None


def _failure_links(goto: list[dict[str, int]], match: list[int]) -> list[int]:
    """Breadth-first: each state's fail link is its longest proper suffix in the trie."""
    fail = [0] * len(goto)
    queue = deque(goto[0].values())
    while queue:
        state = queue.popleft()
        for ch, nxt in goto[state].items():
            back = fail[state]
            while back and ch not in goto[back]:
                back = fail[back]
            fail[nxt] = goto[back].get(ch, 0)
            # A state that is no stop string itself still ends one if a suffix does.
            match[nxt] = match[nxt] or match[fail[nxt]]
            queue.append(nxt)
    return fail
