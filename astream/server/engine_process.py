"""The engine in a process of its own, behind the interface the server uses.

    async with EngineProcess(model, **engine_options) as engine:
        async with StreamServer(engine, options) as server:
            ...

A server that runs the engine on its own event loop spends that loop's time on HTTP,
JSON and websocket frames between steps, and the GPU waits for it. Here the engine runs
in a spawned child process with its own loop; the server's process only talks to
clients. The two are joined by a socket pair that carries one message per loop turn
each way, however many requests it speaks for:

  parent -> child   open a request, abort it, close it (its consumer left), grant it credit
  child -> parent   request opened or refused, tokens and progress, its end, engine stats

Backpressure crosses the process boundary as credit: the child forwards at most
`stream_buffer_tokens` tokens of a request beyond what the parent's consumer has taken,
so a reader that stops still pauses its sequence in the engine (docs/ENGINE.md).

The child reads its socket until end of file: if the parent dies, so does the engine.
If the child dies, every live request ends with an error and new ones are refused.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio

from astream.base.config import EngineConfig
from astream.base.errors import EngineClosedError, PromptTooLongError
from astream.base.metrics import EngineMetrics
from astream.base.outputs import Progress, StreamToken
from astream.base.sampling import SamplingParams
from astream.core.request import no_timing
from astream.engine.engine import Engine
from astream.engine.request_stream import stream_request
from astream.runtime.events import run_off_loop
from astream.stages.output_queue import OutputQueue
from astream.text.tokenization import Prompt

log = logging.getLogger("astream.engine_process")

_HEADER = struct.Struct("!I")
_STATS_INTERVAL_S = 0.25        # how stale the parent's view of stats() and metrics may be
_EXIT_TIMEOUT_S = 30.0          # for the child to close its engine after "shutdown"

# Exceptions that cross the boundary by name: what Engine.request and a stream may raise.
_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    PromptTooLongError, EngineClosedError, ValueError, TypeError, FileNotFoundError, RuntimeError)}


def _error(name: str, message: str) -> Exception:
    return _ERRORS.get(name, RuntimeError)(message)


def _describe(exc: BaseException) -> tuple[str, str]:
    name = type(exc).__name__
    return (name if name in _ERRORS else "RuntimeError",
            str(exc) if name in _ERRORS else f"{name}: {exc}")


class _Link:
    """One end of the socket pair: messages queued during a loop turn leave as one write."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._outbox: list = []

    def send(self, message: tuple) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if self.writer.is_closing():
            return
        data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(data)) + data)

    async def receive(self) -> list | None:
        """The next batch of messages; None at end of file."""
        try:
            size, = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
            return pickle.loads(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def drain(self) -> None:
        self._flush()
        try:
            await self.writer.drain()
        except ConnectionError:
            pass

    def close(self) -> None:
        self.writer.close()


# ---- the parent's side ---------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class RemoteStream:
    """One request of an EngineProcess, as `Engine.request` returns it (a RequestStream):
    iterate it for StreamTokens (and Progress items when asked for); closing it before the
    last token aborts the request."""

    request_id: str
    _process: "EngineProcess"
    _progress: bool
    _choices: int
    queue: OutputQueue = field(default_factory=OutputQueue)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    _timing: dict = field(default_factory=no_timing)
    _taken: int = 0                 # tokens the consumer took
    _granted: int = 0               # credit last sent to the child
    _ended: int = 0                 # choices whose final token the consumer took

    def timing(self) -> dict:
        return dict(self._timing)

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> StreamToken | Progress:
        while True:
            if self._ended == self._choices:
                raise StopAsyncIteration
            item = await self.queue.__anext__()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Progress):
                if self._progress:
                    return item
                continue
            self._taken += 1
            if self._taken - self._granted >= self._process.window // 2:
                self._granted = self._taken
                self._process.link.send(("credit", self.request_id, self._taken))
            if item.finish_reason is not None:
                self._ended += 1
            return item

    async def aclose(self) -> None:
        self._process.release(self)

    async def __aenter__(self) -> "RemoteStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


class EngineProcess:
    """An Engine in a spawned child process, with the part of Engine's interface that
    StreamServer uses: request, stream, abort, running, stats, metrics, tokenizer, config.

    Options are validated here, before the child starts, so a bad one fails at once with
    the same error Engine would raise. stats() and metrics are the child's, at most
    0.25 s old.
    """

    def __init__(self, model: str | None = None, *, log_level: str = "WARNING", **config: Any) -> None:
        self.config: EngineConfig = Engine.check_options(model, **config)
        self._model, self._options, self._log_level = model, config, log_level
        self.window = self.config.stream_buffer_tokens
        self.metrics = EngineMetrics()
        self._stats: dict = {}
        self._tokenizer = None                    # loaded by the first caller that names tokens
        self._tokenizer_lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self.link: _Link | None = None
        self._streams: dict[str, RemoteStream] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._exit: str | None = None             # why the child is gone, once it is
        self._closing = False                     # __aexit__ began: the child's exit is expected
        self._numbers = 0

    # ---- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "EngineProcess":
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")      # CUDA cannot live in a forked child
        self._process = context.Process(
            target=_child_main, args=(theirs, self._model, self._options, self._log_level),
            name="astream-engine")
        try:
            self._process.start()
        finally:
            theirs.close()
        self.link = _Link(*await asyncio.open_connection(sock=ours))
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read(), name="astream engine link")
        try:
            await self._ready
            gc.freeze()    # what startup made lives as long as the server: full collections skip it
        except BaseException:
            await self.__aexit__(*sys.exc_info())
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._process is None:
            return
        process, self._process, self._closing = self._process, None, True
        if self._exit is None:
            self.link.send(("shutdown",))
            await self.link.drain()
        with anyio.CancelScope(shield=True):
            await run_off_loop(process.join, _EXIT_TIMEOUT_S)
            if process.is_alive():
                log.warning("the engine process did not exit in %g s; killing it", _EXIT_TIMEOUT_S)
                process.kill()
                await run_off_loop(process.join, 5.0)
        self.link.close()
        if self._reader is not None:
            self._reader.cancel()
        self._gone(self._exit or "the engine process was closed")

    # ---- the Engine interface ------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exit is None and self._process is not None and self._stats.get("fault") is None

    @property
    def tokenizer(self):
        """The model's tokenizer in this process, loaded at the first use (logprobs name
        their tokens with it); the loading blocks, so call it off the event loop the first
        time. The engine itself tokenizes in its own process."""
        if self._tokenizer is None:
            if self.link is None:
                raise EngineClosedError("the engine is not running")
            with self._tokenizer_lock:            # two first callers load it once
                if self._tokenizer is None:
                    self._tokenizer = _load_tokenizer(self.config)
        return self._tokenizer

    def stats(self) -> dict:
        if not self._stats:
            raise EngineClosedError("the engine is not running")
        return dict(self._stats)

    async def request(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None, *, progress: bool = False,
                      client: str = "") -> RemoteStream:
        """As Engine.request: raises ValueError for a live id, PromptTooLongError for a
        prompt too large to fit, EngineClosedError once the engine is gone."""
        if self._exit is not None or self.link is None:
            raise EngineClosedError(self._exit or "the engine is not running")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            self._numbers += 1
            request_id = f"p{self._numbers}"
        if request_id in self._streams or request_id in self._opening:
            raise ValueError(f"request id {request_id!r} is still live")
        stream = RemoteStream(request_id, self, progress, params.n)
        self._opening[request_id] = opened = asyncio.get_running_loop().create_future()
        self._streams[request_id] = stream
        self.link.send(("open", request_id, prompt, params, client))
        try:
            await opened
        except BaseException:
            self.release(stream)
            raise
        finally:
            self._opening.pop(request_id, None)
        return stream

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, progress: bool = False, client: str = ""):
        """As Engine.stream (one implementation: engine.request_stream.stream_request)."""
        return stream_request(self, prompt, params, request_id, progress, client)

    async def abort(self, request_id: str) -> None:
        if request_id in self._streams and self._exit is None:
            self.link.send(("abort", request_id))

    def release(self, stream: RemoteStream) -> None:
        """The consumer left: the request ends in the child (aborted if still live)."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if self._exit is None:
                self.link.send(("close", stream.request_id))
        stream.queue.abandon()

    # ---- messages from the child -----------------------------------------------------------

    async def _read(self) -> None:
        try:
            while (batch := await self.link.receive()) is not None:
                for message in batch:
                    self._handle(message)
            code = await run_off_loop(self._process.join, 5.0) if self._process else None
            self._gone(f"the engine process exited (code {code})" if self._process
                       else "the engine process was closed")
        except Exception as exc:                  # a bug here must not leave consumers hanging
            log.exception("reading from the engine process failed")
            self._gone(f"the link to the engine process failed: {exc!r}")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        stream = self._streams.get(message[1]) if kind in _PER_REQUEST else None
        if kind == "token":
            if stream is not None:
                _, rid, index, token_id, text, choice, logprob, top = message
                stream.queue.put(StreamToken(rid, index, token_id, text, None, None, choice, logprob, top))
        elif kind == "final":
            if stream is not None:
                (_, rid, index, token_id, text, reason, error, choice, logprob, top,
                 stream.prompt_tokens, stream.completion_tokens, stream._timing) = message
                stream.finish_reason = reason
                stream.queue.put(StreamToken(rid, index, token_id, text, reason, error, choice, logprob, top))
        elif kind == "progress":
            if stream is not None:
                _, rid, prefilled, total, stream.prompt_tokens = message
                stream.queue.put(Progress(rid, prefilled, total))
        elif kind == "end":
            if stream is not None:
                if message[2] is not None:
                    stream.queue.put(_error(*message[2]))
                stream.queue.close()
        elif kind == "opened":
            self._settle(message[1], message[2])
        elif kind == "stats":
            self._stats, self.metrics = message[1], message[2]
        elif kind == "ready":
            self._stats, self.metrics = message[1], message[2]
            if not self._ready.done():
                self._ready.set_result(None)
        elif kind == "failed":
            self._exit = f"the engine failed to start: {message[2]}"
            if not self._ready.done():
                self._ready.set_exception(_error(*message[1:]))

    def _settle(self, request_id: str, refusal: tuple | None) -> None:
        opened = self._opening.get(request_id)
        if opened is None or opened.done():
            return
        if refusal is None:
            opened.set_result(None)
        else:
            opened.set_exception(_error(*refusal))

    def _gone(self, why: str) -> None:
        """The child is gone: every live request ends with an error, every opening fails."""
        if self._exit is None:
            self._exit = why
            if not self._closing:
                log.error("%s", why)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineClosedError(why))
        for request_id in list(self._opening):
            self._settle(request_id, ("EngineClosedError", why))
        for stream in list(self._streams.values()):
            if not stream.queue.closed:
                for choice in range(stream._choices):
                    stream.queue.put(StreamToken(stream.request_id, -1, -1, "", "error", why, choice))
                stream.queue.close()
        self._stats = {**self._stats, "fault": why} if self._stats else {}


_PER_REQUEST = frozenset({"token", "final", "progress", "end"})


def _load_tokenizer(config: EngineConfig):
    """The model's tokenizer in the server's process (it names logprobs' tokens)."""
    from astream.models.loader import load_tokenizer, open_checkpoint, resolve_model_path

    path = resolve_model_path(config.tokenizer or config.model)
    header = None
    if config.tokenizer is None and path.suffix == ".gguf":
        header = open_checkpoint(path, config.load_format).header
    return load_tokenizer(path, header)


# ---- the child's side ------------------------------------------------------------------------


def _child_main(sock: socket.socket, model: str | None, options: dict, log_level: str) -> None:
    # Ctrl-C reaches the whole process group; the parent drains, then closes the engine
    # through the socket, so the child must not die of the same SIGINT first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    backend_options = {"use_uvloop": importlib.util.find_spec("uvloop") is not None}
    anyio.run(_serve_parent, sock, model, options, backend="asyncio", backend_options=backend_options)


async def _serve_parent(sock: socket.socket, model: str | None, options: dict) -> None:
    link = _Link(*await asyncio.open_connection(sock=sock))
    try:
        engine = Engine(model, **options)
        await engine.__aenter__()
    except Exception as exc:
        link.send(("failed", *_describe(exc)))
        await link.drain()
        link.close()
        return
    try:
        gc.freeze()        # the model and its tokenizer never die: full collections skip them
        link.send(("ready", engine.stats(), engine.metrics))
        await _Bridge(engine, link).run()
    finally:
        # Not under a shielding scope of our own: the engine's task group must exit in
        # the scope it was entered in. Nothing outside this task cancels it.
        await engine.__aexit__(None, None, None)
        await link.drain()
        link.close()


@dataclass(slots=True, eq=False)
class _Relay:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    granted: int = 0
    credit: anyio.Event = field(default_factory=anyio.Event)


class _Bridge:
    """The child's loop: commands in, a relay task per request out."""

    def __init__(self, engine: Engine, link: _Link) -> None:
        self.engine, self.link = engine, link
        self.window = engine.config.stream_buffer_tokens
        self.relays: dict[str, _Relay] = {}

    async def run(self) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._publish_stats)
            while (batch := await self.link.receive()) is not None:
                if not self._dispatch(batch, tasks):
                    break
            tasks.cancel_scope.cancel()

    def _dispatch(self, batch: list, tasks) -> bool:
        for message in batch:
            kind = message[0]
            if kind == "open":
                _, request_id, prompt, params, client = message
                relay = self.relays[request_id] = _Relay()
                tasks.start_soon(self._relay, request_id, prompt, params, client, relay)
            elif kind == "credit":
                relay = self.relays.get(message[1])
                if relay is not None and message[2] > relay.granted:
                    relay.granted = message[2]
                    relay.credit.set()
            elif kind == "abort":
                if message[1] in self.relays:
                    tasks.start_soon(self.engine.abort, message[1])
            elif kind == "close":
                relay = self.relays.get(message[1])
                if relay is not None:
                    relay.scope.cancel()
            elif kind == "shutdown":
                return False
        return True

    async def _relay(self, request_id: str, prompt: Prompt, params: SamplingParams, client: str,
                     relay: _Relay) -> None:
        send, failure = self.link.send, None
        with relay.scope:
            try:
                stream = await self.engine.request(prompt, params, request_id, progress=True,
                                                   client=client)
            except Exception as exc:
                send(("opened", request_id, _describe(exc)))
                if self.relays.get(request_id) is relay:
                    del self.relays[request_id]
                return
            send(("opened", request_id, None))
            forwarded = 0
            try:
                async with stream:
                    async for item in stream:
                        if type(item) is Progress:
                            send(("progress", request_id, item.prefilled, item.total, stream.prompt_tokens))
                            continue
                        if item.finish_reason is None:
                            send(("token", request_id, item.index, item.token_id, item.text,
                                  item.choice, item.logprob, item.top_logprobs))
                        else:
                            send(("final", request_id, item.index, item.token_id, item.text,
                                  item.finish_reason, item.error, item.choice, item.logprob,
                                  item.top_logprobs, stream.prompt_tokens, stream.completion_tokens,
                                  stream.timing()))
                        forwarded += 1
                        while forwarded - relay.granted >= self.window:     # the reader is behind
                            relay.credit = anyio.Event()
                            await relay.credit.wait()
            except Exception as exc:      # a prompt refused after tokenization, or a bug
                failure = _describe(exc)
        if self.relays.get(request_id) is relay:
            del self.relays[request_id]
        send(("end", request_id, failure))

    async def _publish_stats(self) -> None:
        while True:
            await anyio.sleep(_STATS_INTERVAL_S)
            try:
                self.link.send(("stats", self.engine.stats(), self.engine.metrics))
            except EngineClosedError:
                return
