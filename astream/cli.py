"""The `astream` command: generate | chat | serve | graph | eval.

Engine, sampling and server options are derived from the fields of EngineConfig,
SamplingParams and ServerOptions, so a new knob shows up here without edits.
Heavy imports (torch, the engine) wait until a command needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import anyio

API_KEY_ENV = "ASTREAM_API_KEY"
_SCALARS = {"int": int, "float": float, "str": str}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs = _configs(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    try:
        anyio.run(args.run, args, *configs, backend_options=_backend_options())
    except KeyboardInterrupt:
        return 130
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"astream: error: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from astream.config import EngineConfig
    from astream.sampling import SamplingParams
    from astream.server.options import ServerOptions

    parser = argparse.ArgumentParser(prog="astream", description="asyncio streaming LLM inference")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", help="stream one completion to stdout")
    generate.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    chat = commands.add_parser("chat", help="interactive multi-turn chat (/exit or EOF quits)")
    serve = commands.add_parser("serve", help="websocket (astream-ws/1) and OpenAI API server")
    graph = commands.add_parser("graph", help="print the engine's stage graph")
    graph.set_defaults(run=_graph)
    for sub, run in ((generate, _generate), (chat, _chat), (serve, _serve)):
        sub.set_defaults(run=run)
        sub.add_argument("--model", metavar="PATH", help="HF folder, .gguf file or Hugging Face hub "
                         "id such as Qwen/Qwen2.5-0.5B-Instruct (default: the embedded "
                         "SmolLM2-135M-Instruct)")
        _add_options(sub.add_argument_group("engine options"), EngineConfig, _engine_skip(run), "auto")
    for sub in (generate, chat):
        _add_options(sub.add_argument_group("sampling options"), SamplingParams)
    _add_options(serve.add_argument_group("server options", f"--api-key may also come from "
                                          f"${API_KEY_ENV} (which keeps it out of `ps`)"), ServerOptions)
    serve.set_defaults(api_key=os.environ.get(API_KEY_ENV))
    serve.add_argument("served_model", nargs="?", metavar="MODEL",
                       help="the model, as --model takes it (astream serve Qwen/Qwen2.5-0.5B-Instruct)")
    from astream.eval.cli import add_eval_command
    add_eval_command(commands, lambda group: _add_options(group, EngineConfig, {"model", "seed"}, "auto"))
    return parser


def _add_options(group: argparse._ArgumentGroup, cls: type, skip: set[str] = frozenset(),
                 none: str = "unset") -> None:
    """One flag per dataclass field; unset flags keep the dataclass default."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("flags", ())]
        shown = none if field.default is None else field.default
        kind = _flag_kind(field)
        if kind is None:
            continue
        if kind == "bool":
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"default: {shown}")
        elif kind.startswith("tuple["):
            item = _SCALARS[kind[len("tuple["):].split(",")[0].strip()]
            group.add_argument(*flags, type=item, action="append", default=argparse.SUPPRESS,
                               help="repeat for several")
        else:
            metavar = {"int": "N", "float": "X"}.get(kind, field.name.split("_")[-1].upper())
            described = field.metadata.get("help")
            group.add_argument(*flags, type=_SCALARS[kind], default=argparse.SUPPRESS, metavar=metavar,
                               help=f"{described} (default: {shown})" if described else f"default: {shown}")


def _flag_kind(field: dataclasses.Field) -> str | None:
    """The annotation's first type; for a wider one (`object`), the default's type if it is
    expressible on a command line (a policy given by name); None: no flag."""
    kind = field.type.split("|")[0].strip()
    if kind in _SCALARS or kind == "bool" or kind.startswith("tuple["):
        return kind
    default_kind = type(field.default).__name__
    return default_kind if default_kind in _SCALARS else None


def _engine_skip(run) -> set[str]:
    # --seed of generate/chat is the request's (SamplingParams.seed), not the engine default.
    return {"model"} if run is _serve else {"model", "seed"}


def _configs(args: argparse.Namespace) -> tuple:
    """Validated settings for the command, so bad values fail before the model loads."""
    from astream.config import EngineConfig
    from astream.sampling import SamplingParams
    from astream.server.options import ServerOptions

    if args.run is _graph:
        return ()
    from astream.engine import Engine

    engine = _pick(args, EngineConfig, _engine_skip(args.run))
    if getattr(args, "served_model", None):
        if args.model is not None and args.model != args.served_model:
            raise ValueError(f"two models given: {args.served_model!r} and --model {args.model!r}")
        args.model = args.served_model
    Engine.check_options(args.model, **engine)
    if args.run is _serve:
        if args.api_key == "" and os.environ.get(API_KEY_ENV) == "":
            raise ValueError(f"${API_KEY_ENV} is set but empty; unset it to serve without a key")
        return engine, ServerOptions(**_pick(args, ServerOptions))
    return engine, SamplingParams(**_pick(args, SamplingParams))


def _pick(args: argparse.Namespace, cls: type, skip: set[str] = frozenset()) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and hasattr(args, f.name)}


def _backend_options() -> dict:
    return {"use_uvloop": True} if importlib.util.find_spec("uvloop") else {}


# ---- status lines on stderr --------------------------------------------------------------

@dataclass(slots=True)
class StatusLine:
    """One rewritten line of progress on stderr (only the final state when not a terminal)."""

    stream: TextIO
    shown: bool = False
    last: float = 0.0

    def show(self, label: str, done: int, total: int) -> None:
        now, finished = time.monotonic(), done >= total
        if not self.stream.isatty() and not finished:
            return
        if not finished and now - self.last < 0.1:
            return
        self.last, self.shown = now, True
        self.stream.write(f"\r{label} {done}/{total} ({100 * done // max(total, 1)}%)   ")
        self.stream.flush()

    def end(self, keep: bool) -> None:
        """Finish the line (keep it) or wipe it (so streamed text starts on a clean line)."""
        if self.shown:
            self.stream.write("\n" if keep else "\r" + " " * 60 + "\r")
            self.stream.flush()
            self.shown = False

    def loading(self, done: int, total: int) -> None:
        self.show("loading weights", done, total)
        if done >= total:
            self.end(keep=True)


# ---- commands ------------------------------------------------------------------------------

async def _graph(args: argparse.Namespace) -> None:
    from astream.stages.graph import render
    print(render())


async def _generate(args: argparse.Namespace, engine_kw: dict, params) -> None:
    from astream.engine import Engine

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt = [{"role": "user", "content": text}] if args.chat else text
    status = StatusLine(sys.stderr)
    async with Engine(args.model, load_progress=status.loading, **engine_kw) as engine:
        await _print_stream(engine, prompt, params, status)
    sys.stdout.write("\n")


async def _chat(args: argparse.Namespace, engine_kw: dict, params) -> None:
    from astream.engine import Engine

    status = StatusLine(sys.stderr)
    history: list[dict] = []
    async with Engine(args.model, load_progress=status.loading, **engine_kw) as engine:
        print("astream chat: /exit or Ctrl-D quits", file=sys.stderr)
        while (line := await anyio.to_thread.run_sync(_read_line, abandon_on_cancel=True)) is not None:
            if line.strip() == "/exit":
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            try:
                reply = await _print_stream(engine, history, params, status)
            except (ValueError, RuntimeError) as exc:      # e.g. the history outgrew max_model_len
                history.pop()
                print(f"\nastream: {exc}", file=sys.stderr)
                continue
            history.append({"role": "assistant", "content": reply})
            sys.stdout.write("\n")


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None


async def _print_stream(engine, prompt, params, status: StatusLine) -> str:
    """Stream one request's text to stdout, prefill progress to stderr; returns the text."""
    from astream.outputs import Progress

    text = ""
    async for item in engine.stream(prompt, params, progress=True):
        if isinstance(item, Progress):
            status.show("prefill", item.prefilled, item.total)
            continue
        status.end(keep=False)
        sys.stdout.write(item.text)
        sys.stdout.flush()
        text += item.text
        if item.finish_reason == "error":
            raise RuntimeError(f"generation failed: {item.error}")
    return text


async def _serve(args: argparse.Namespace, engine_kw: dict, options) -> None:
    import logging

    from astream.engine import Engine
    from astream.server import PROTOCOL_VERSION, StreamServer

    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)    # not a line per health probe
    status = StatusLine(sys.stderr)
    async with Engine(args.model, load_progress=status.loading, **engine_kw) as engine:
        async with StreamServer(engine, options) as server:
            http_url = server.url.replace("ws://", "http://", 1)
            print(f"astream: serving {PROTOCOL_VERSION} on {server.url} and the OpenAI API on "
                  f"{http_url}/v1 as model {server.openai.served_model!r} (health: "
                  f"{http_url}/health, metrics: {http_url}/metrics)", file=sys.stderr, flush=True)
            await _serve_until_signalled(server, options.shutdown_timeout)


async def _serve_until_signalled(server, timeout: float) -> None:
    """The first SIGINT/SIGTERM starts a graceful shutdown; a second one cuts it short."""
    import signal

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"astream: {signal.Signals(signum).name}: shutting down (grace {timeout:g} s)",
                  file=sys.stderr, flush=True)
            break
        async with anyio.create_task_group() as group:
            async def hurry() -> None:
                async for _ in signals:
                    server.hurry()

            group.start_soon(hurry)
            await server.shutdown(timeout)
            group.cancel_scope.cancel()


if __name__ == "__main__":
    sys.exit(main())
