"""A progress bar over trials on a text stream (stderr): redrawn in place on a terminal;
elsewhere (a log file, CI) only its final state is written."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

_WIDTH = 30
_REDRAW_S = 0.1


@dataclass(slots=True)
class ProgressBar:
    stream: TextIO
    total: int
    done: int = 0
    correct: int = 0
    last_draw: float = 0.0

    def advance(self, correct: bool, label: str = "") -> None:
        self.done += 1
        self.correct += correct
        finished = self.done >= self.total
        if not finished and (not self.stream.isatty() or time.monotonic() - self.last_draw < _REDRAW_S):
            return
        self.last_draw = time.monotonic()
        filled = _WIDTH * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} trials, "
                f"{self.correct} correct {label}")
        if self.stream.isatty():          # pad over a longer previous label
            line = "\r" + line.ljust(90)
        self.stream.write(line + ("\n" if finished else ""))
        self.stream.flush()
