"""Errors a caller of the engine may want to catch by type."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a new token within max_model_len."""


class EngineClosedError(RuntimeError):
    """The engine is not running (not started, closed, or stopped by an internal fault)."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, or a step that every rank had started failed: the ranks
    can no longer stay in step, so the engine stops and every live request ends with this."""
