"""PNG plots of a run, drawn with matplotlib when it is installed (the `eval` extra).
Accuracy is plotted in percent, on the axes, the colour bar and in the squares alike."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Sequence

from astream.eval.runner import CellResult
from astream.eval.scoring import accuracy

INSTALL_HINT = 'pip install "astream[eval]"'


def plotting_available() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def missing_matplotlib_message() -> str:
    return f"matplotlib is not installed, so no plot was written; {INSTALL_HINT} to get the plots"


def write_heatmap(cells: Sequence[CellResult], path: Path) -> Path:
    """Accuracy of one configuration: a panel per task, lengths down, depths across."""
    from matplotlib.figure import Figure

    tasks = _unique(c.task for c in cells)
    width = max(4.0, 1.5 + 0.9 * len(_unique(c.depth for c in cells)))
    height = 1.8 + 0.55 * len(_unique(c.length for c in cells))
    figure = Figure(figsize=(width * len(tasks) + 1.0, height), layout="constrained")
    axes = figure.subplots(1, len(tasks), squeeze=False)[0]
    image = None
    for ax, task in zip(axes, tasks):
        mine = [c for c in cells if c.task == task]
        lengths, depths = _unique(c.length for c in mine), _unique(c.depth for c in mine)
        grid = [[100 * _accuracy(mine, length, depth) for depth in depths] for length in lengths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=100.0, aspect="auto")
        for row, values in enumerate(grid):
            for col, value in enumerate(values):
                ax.text(col, row, "-" if math.isnan(value) else f"{value:.0f}", ha="center", va="center")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("depth")
        ax.set_ylabel("prompt tokens")
        ax.set_title(task)
    figure.colorbar(image, ax=list(axes), label="accuracy (%)")
    figure.suptitle(cells[0].config)
    figure.savefig(path, dpi=120)
    return path


def write_compare_plot(cells: Sequence[CellResult], path: Path) -> Path:
    """Accuracy of each configuration (in the order given), one line per length, a panel per task."""
    from matplotlib.figure import Figure

    configs, tasks = _unique(c.config for c in cells), _unique(c.task for c in cells)
    figure = Figure(figsize=(max(5.0, 1.2 * len(configs)) * len(tasks), 4.0), layout="constrained")
    axes = figure.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        mine = [c for c in cells if c.task == task]
        for length in _unique(c.length for c in mine):
            values = [100 * _accuracy([c for c in mine if c.config == k], length) for k in configs]
            ax.plot(range(len(configs)), values, marker="o", label=f"{length} tokens")
        ax.set_xticks(range(len(configs)), configs, rotation=20)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("configuration (policy:budget)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task)
        ax.legend()
    figure.savefig(path, dpi=120)
    return path


def _accuracy(cells: Sequence[CellResult], length: int, depth: float | None = None) -> float:
    """NaN where nothing ran: an empty square, a gap in a line."""
    results = [r for c in cells if c.length == length and (depth is None or c.depth == depth)
               for r in c.results]
    return accuracy((r.score for r in results), empty=math.nan)


def _unique(values) -> list:
    return list(dict.fromkeys(values))
