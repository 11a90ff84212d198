"""An event loop on a daemon thread, for synchronous callers of async code (the LLM facade).

A daemon thread, unlike anyio's start_blocking_portal, never holds up interpreter exit
when its owner forgets to close it.
"""

from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable

import anyio
from anyio.from_thread import BlockingPortal


class LoopThread:
    def __init__(self, name: str = "astream-loop") -> None:
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            anyio.run(self._serve)
        except BaseException as exc:      # surfaced to the constructor
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()

    @property
    def portal(self) -> BlockingPortal:
        if self._portal is None:
            raise RuntimeError("the loop thread is stopped")
        return self._portal

    def call(self, fn: Callable[..., Awaitable[Any]], *args) -> Any:
        return self.portal.call(fn, *args)

    def stop(self) -> None:
        if self._portal is not None:
            portal, self._portal = self._portal, None
            portal.call(portal.stop)
            self._thread.join(timeout=30)
