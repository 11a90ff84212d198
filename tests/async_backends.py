"""The event loops the async tests run on; one not installed is skipped, not failed (the
test extra installs trio, a GPU machine's environment may not)."""

from __future__ import annotations

import importlib.util

import pytest


def _installed(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed")


BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"),
            pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop", marks=_installed("uvloop")),
            pytest.param(("trio", {}), id="trio", marks=_installed("trio"))]
