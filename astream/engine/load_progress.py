"""What loading a model shows on stderr: a bar while the weights load, then how long it took.

It shows when EngineConfig.show_progress is true, or when that is unset, stderr is a
terminal and $ASTREAM_SHOW_PROGRESS is not 0. On a terminal the bar is tqdm's when tqdm is
installed, else one rewritten line; elsewhere (a pipe, a log file) only the final line is
written. The messages also go to the "astream" logger: at INFO when nothing is shown, at
DEBUG when the display already said it (so a configured log does not repeat it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

SHOW_PROGRESS_ENV = "ASTREAM_SHOW_PROGRESS"
_OFF = ("0", "false", "no", "off")

log = logging.getLogger("astream")


def wants_progress(setting: bool | None, stream: TextIO) -> bool:
    """Whether to show load progress: as set, else on a terminal unless the environment says no."""
    if setting is not None:
        return setting
    if os.environ.get(SHOW_PROGRESS_ENV, "").strip().lower() in _OFF:
        return False
    return _is_terminal(stream)


def model_label(model: str | None) -> str:
    """How a model is named in messages: a path by its file or folder name, a hub id as given."""
    if model is None:
        return "SmolLM2-135M-Instruct (embedded)"
    path = Path(model).expanduser()
    return path.name if path.exists() else model


@dataclass(slots=True)
class LoadProgress:
    """One model load. `weights` is called from the loading thread; `finish` and `close` after it."""

    label: str
    stream: TextIO | None                        # None: log only
    started: float = field(default_factory=time.perf_counter)
    bar: Any = None                              # a tqdm bar, once the first tensor arrived
    line: bool = False                           # our own rewritten line is on screen
    last: float = 0.0

    @classmethod
    def start(cls, model: str | None, show: bool, stream: TextIO | None = None) -> "LoadProgress":
        label = model_label(model)
        log.log(logging.DEBUG if show else logging.INFO, "loading %s", label)
        return cls(label, (stream or sys.stderr) if show else None)

    def weights(self, done: int, total: int) -> None:
        if self.stream is None or not _is_terminal(self.stream):
            return
        if self.bar is None and not self.line and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=f"astream: loading {self.label}", unit="tensor",
                            file=self.stream, leave=False, dynamic_ncols=True)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last, self.line = now, True
        self.stream.write(f"\rastream: loading {self.label}: weights {done}/{total} "
                          f"({100 * done // max(total, 1)}%)")
        if done >= total:
            self.stream.write(", preparing the KV cache")
        self.stream.flush()

    def finish(self) -> None:
        """The engine is ready: replace the bar with one line saying how long it took."""
        self.close()
        message = f"loaded {self.label} in {time.perf_counter() - self.started:.1f} s"
        log.log(logging.DEBUG if self.stream is not None else logging.INFO, "%s", message)
        if self.stream is not None:
            self.stream.write(f"astream: {message}\n")
            self.stream.flush()

    def close(self) -> None:
        """Take the bar off the screen (also when loading failed)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.line and self.stream is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.line = False


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
