"""Errors a caller of the engine may want to catch by type."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a new token within max_model_len."""


class EngineClosedError(RuntimeError):
    """The engine is not running (not started, closed, or stopped by an internal fault)."""
