"""The `astream` command: generate | chat | serve | graph | eval | worker.

Engine, sampling and server options are derived from the fields of EngineConfig,
SamplingParams and ServerOptions, so a new knob shows up here without edits.
Heavy imports (torch, the engine) wait until a command needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, TextIO

import anyio

API_KEY_ENV = "ASTREAM_API_KEY"
_SCALARS = {"int": int, "float": float, "str": str}
# Wording meant for Python callers, dropped from messages a command-line user sees.
_PYTHON_ONLY = (" or a SparsePolicy instance",)
SETTINGS_EPILOG = ("Every option above may also come from a --config file (TOML, or YAML) or from an "
                   "environment variable: ASTREAM_ and the option's name in capitals, e.g. "
                   "ASTREAM_MAX_MODEL_LEN=4096. A flag wins over the file, the file over the "
                   "environment, the environment over the default.")


def main(argv: list[str] | None = None) -> int:
    args, configs = parse_command(argv, os.environ)
    try:
        anyio.run(args.run, args, *configs, backend_options=_backend_options())
    except KeyboardInterrupt:
        return 130
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"astream: error: {exc}", file=sys.stderr)
        return 1
    return 0


def parse_command(argv: list[str] | None, environ: Mapping[str, str]) -> tuple[argparse.Namespace, tuple]:
    """The command line read and validated, with options from --config and the environment:
    (arguments, the command's settings). A bad value exits through the subcommand's parser,
    which prints its usage and names the flag, variable or file key that set it."""
    args = build_parser().parse_args(argv)
    command: argparse.ArgumentParser = args.command_parser
    try:
        sources = _apply_settings(args, command, environ)
    except ValueError as exc:
        command.error(str(exc))
    try:
        return args, _configs(args)
    except (TypeError, ValueError) as exc:
        command.error(user_message(str(exc), _option_names(command), sources))


def build_parser() -> argparse.ArgumentParser:
    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.server.options import ServerOptions

    parser = argparse.ArgumentParser(prog="astream", description="asyncio streaming LLM inference")
    parser.add_argument("--version", action="version", version=f"astream {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate", help="stream one answer to stdout",
        description="Stream one answer to stdout. With a model that has a chat template (the "
        "embedded SmolLM2-135M-Instruct has one) the prompt is sent as a user message of a "
        "chat; --raw sends it as plain text to be continued.", epilog=SETTINGS_EPILOG)
    generate.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    mode = generate.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true",
                      help="plain completion: continue the prompt text, without the chat template")
    mode.add_argument("--chat", action="store_true",
                      help="apply the model's chat template (the default when it has one; "
                      "kept for compatibility)")
    generate.add_argument("--verbose", action="store_true",
                          help="after the answer, print prompt tokens, time to first token, decode "
                          "speed and peak memory to stderr")
    chat = commands.add_parser(
        "chat", help="interactive multi-turn chat (/help lists its commands)",
        description="Interactive multi-turn chat. Commands: " + "; ".join(
            f"{name} {text}" for name, text in CHAT_COMMANDS.items()) + ". EOF (Ctrl-D) quits.",
        epilog=SETTINGS_EPILOG)
    chat.add_argument("--system", metavar="TEXT", help="a system prompt for the conversation")
    serve = commands.add_parser("serve", help="websocket (astream-ws/1) and OpenAI API server",
                                epilog=SETTINGS_EPILOG)
    graph = commands.add_parser("graph", help="print the engine's stage graph")
    graph.set_defaults(run=_graph, command_parser=graph, engine_free=True)
    worker = commands.add_parser(
        "worker", help="run the tensor-parallel ranks of a host other than node 0",
        description="Run this host's tensor-parallel ranks for an engine started on node 0 "
        "with the same --nnodes and --tensor-parallel-size (and --node-rank 0, the default). "
        "Both hosts need $MASTER_ADDR (node 0's address) and $MASTER_PORT (a free port there). "
        "Node 0 sends every other setting; this host serves no API and exits when node 0's "
        "engine stops.", epilog=SETTINGS_EPILOG)
    worker.set_defaults(run=_worker)
    worker.add_argument("--model", metavar="PATH", help="where this host keeps the checkpoint "
                        "(default: the path node 0 loads it from)")
    _add_options(worker.add_argument_group("engine options"), EngineConfig,
                 {f.name for f in dataclasses.fields(EngineConfig)} - set(WORKER_OPTIONS))
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
    serve.add_argument("served_model", nargs="?", metavar="MODEL",
                       help="the model, as --model takes it (astream serve Qwen/Qwen2.5-0.5B-Instruct)")
    from astream.eval.cli import add_eval_command
    add_eval_command(commands, lambda group: _add_options(group, EngineConfig, {"model", "seed"}, "auto"))
    for leaf in _leaf_parsers(commands):
        leaf.set_defaults(command_parser=leaf)
        if _option_names(leaf):
            leaf.add_argument("--config", type=Path, metavar="FILE",
                              help="read options from a TOML (.toml) or YAML (.yaml) file of "
                              "option = value lines; flags given here win over it")
    return parser


def version() -> str:
    """The installed distribution's version, else the package's own."""
    try:
        return importlib.metadata.version("astream")
    except importlib.metadata.PackageNotFoundError:
        from astream import __version__
        return __version__


def _leaf_parsers(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """The parsers that run something: subcommands, and the subcommands of those (eval needle)."""
    leaves = []
    for sub in dict.fromkeys(commands.choices.values()):
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += _leaf_parsers(nested[0]) if nested else [sub]
    return leaves


def _add_options(group: argparse._ArgumentGroup, cls: type, skip: set[str] = frozenset(),
                 none: str = "unset") -> None:
    """One flag per dataclass field, its help from the field's metadata["help"];
    unset flags keep the dataclass default."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = _flag_kind(field)
        if kind is None:
            continue
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("flags", ())]
        described = field.metadata.get("help", "")
        if kind == "bool":
            shown = none if field.default is None else ("on" if field.default else "off")
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=_with_default(described, shown))
        elif kind.startswith("tuple["):
            item = _SCALARS[kind[len("tuple["):].split(",")[0].strip()]
            metavar = {int: "N", float: "X"}.get(item, field.name.rstrip("s").split("_")[-1].upper())
            repeat = "" if "repeat" in described else "; repeat the flag for several"
            group.add_argument(*flags, type=item, action="append", default=argparse.SUPPRESS,
                               metavar=metavar, help=f"{described}{repeat}" if described else "")
        else:
            shown = none if field.default is None else field.default
            metavar = {"int": "N", "float": "X"}.get(kind, field.name.split("_")[-1].upper())
            group.add_argument(*flags, type=_SCALARS[kind], default=argparse.SUPPRESS, metavar=metavar,
                               help=_with_default(described, shown))


def _with_default(described: str, shown: object) -> str:
    if "unset:" in described:                  # the help already says what happens by default
        return described
    return f"{described} (default: {shown})" if described else f"default: {shown}"


def _flag_kind(field: dataclasses.Field) -> str | None:
    """The annotation's first type; for a wider one (`object`), the default's type if it is
    expressible on a command line (a policy given by name); None: no flag."""
    kind = field.type.split("|")[0].strip()
    if kind in _SCALARS or kind == "bool" or kind.startswith("tuple["):
        return kind
    default_kind = type(field.default).__name__
    return default_kind if default_kind in _SCALARS else None


# What `astream worker` takes on its command line; node 0 sends it every other setting.
WORKER_OPTIONS = ("tensor_parallel_size", "nnodes", "node_rank", "device")


def _engine_skip(run) -> set[str]:
    # --seed of generate/chat is the request's (SamplingParams.seed), not the engine default.
    return {"model"} if run is _serve else {"model", "seed"}


# ---- settings from a file and the environment, errors in the user's words -----------------

def _option_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options that a file or variable may set: dataclass fields, and --model."""
    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.server.options import ServerOptions

    fields = {"model"} | {f.name for cls in (EngineConfig, SamplingParams, ServerOptions)
                          for f in dataclasses.fields(cls)}
    return {a.dest: a for a in parser._actions if a.dest in fields and a.option_strings}


def _apply_settings(args: argparse.Namespace, parser: argparse.ArgumentParser,
                    environ: Mapping[str, str]) -> dict[str, str]:
    """Fill options not given as flags from --config and ASTREAM_* variables (astream/face/settings.py);
    returns where each option set came from, for error messages."""
    from astream.face.settings import OptionSpec, layered, read_config_file

    actions = _option_names(parser)
    given = {name for name in actions if getattr(args, name, None) is not None}
    specs = [OptionSpec(name, action.type or str, isinstance(action, argparse.BooleanOptionalAction),
                        isinstance(action, argparse._AppendAction)) for name, action in actions.items()]
    path = getattr(args, "config", None)
    file = read_config_file(path) if path is not None else None
    settings = layered(specs, given, file, str(path), environ)
    for name, setting in settings.items():
        setattr(args, name, setting.value)
    sources = {name: "argument " + "/".join(actions[name].option_strings) for name in given}
    return sources | {name: setting.source for name, setting in settings.items()}


def user_message(message: str, options: Mapping[str, argparse.Action], sources: Mapping[str, str]) -> str:
    """A validation message as a command-line user needs it: led by the flag (or variable, or
    file key) that set the value, with option names spelled as flags."""
    for phrase in _PYTHON_ONLY:
        message = message.replace(phrase, "")
    named = [(match.start(), name) for name in options
             if (match := re.search(rf"(?<![\w-]){name}(?!\w)", message))]
    if not named:
        return message
    position, name = min(named)
    flag = options[name].option_strings[0]
    if position == 0:
        message = message[len(name):].lstrip(" :")
    else:                                           # "unknown sparse_policy 'x'": in words
        message = message[:position] + name.replace("_", " ") + message[position + len(name):]
    # name='value' (a Python keyword) reads as --name value; other option names as their flags
    message = re.sub(r"(?<![\w-])(\w+)=(['\"]?)([^'\"\s;,]*)\2",
                     lambda m: f"{options[m[1]].option_strings[0]} {m[3]}" if m[1] in options else m[0],
                     message)
    message = re.sub(r"(?<![\w-])(\w+_\w+)(?!\w)",
                     lambda m: options[m[1]].option_strings[0] if m[1] in options else m[0], message)
    return f"{sources.get(name, f'argument {flag}')}: {message}"


def _configs(args: argparse.Namespace) -> tuple:
    """Validated settings for the command, so bad values fail before the model loads."""
    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.server.options import ServerOptions

    if getattr(args, "engine_free", False):      # graph, eval report: no engine settings
        return ()
    if args.run is _worker:
        config = EngineConfig(**_pick(args, EngineConfig, {"model"}))
        if config.node_rank == 0:
            raise ValueError("node_rank 0 runs the engine itself (generate, chat or serve with "
                             "--nnodes); a worker has --node-rank 1 or more")
        return (config,)
    from astream.engine.engine import Engine

    engine = _pick(args, EngineConfig, _engine_skip(args.run))
    if getattr(args, "served_model", None):
        if args.model is not None and args.model != args.served_model:
            raise ValueError(f"two models given: {args.served_model!r} and --model {args.model!r}")
        args.model = args.served_model
    config = Engine.check_options(args.model, **engine)
    try:
        config.torch_device()
    except RuntimeError as exc:                     # a GPU asked for on a machine without one
        raise ValueError(str(exc)) from None
    if args.run is _serve:
        return engine, ServerOptions(**_pick(args, ServerOptions))
    params = SamplingParams(**_pick(args, SamplingParams))
    if getattr(params, "n", 1) > 1:
        raise ValueError("n: a terminal shows one completion; ask the server or the Python API "
                         "for several")
    return engine, params


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



# ---- commands ------------------------------------------------------------------------------

CHAT_COMMANDS = {"/help": "lists these commands", "/reset": "clears the conversation",
                 "/system TEXT": "sets the system prompt and clears the conversation (/system "
                 "alone removes it)", "/exit": "quits"}


async def _graph(args: argparse.Namespace) -> None:
    from astream.stages.graph import render
    print(render())


async def _worker(args: argparse.Namespace, config) -> None:
    from astream.parallel.worker import run_node

    code = run_node(config, args.model)
    if code:
        raise SystemExit(code)


async def _generate(args: argparse.Namespace, engine_kw: dict, params) -> None:
    from astream.engine.engine import Engine

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    async with Engine(args.model, **engine_kw) as engine:
        as_chat = args.chat or (not args.raw and bool(getattr(engine.tokenizer, "chat_template", None)))
        prompt = [{"role": "user", "content": text}] if as_chat else text
        stats = await _print_stream(engine, prompt, params, StatusLine(sys.stderr))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose:
        print(stats.report(), file=sys.stderr)


async def _chat(args: argparse.Namespace, engine_kw: dict, params) -> None:
    from astream.engine.engine import Engine

    status = StatusLine(sys.stderr)
    conversation = Conversation(args.system)
    async with Engine(args.model, **engine_kw) as engine:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template, so it cannot chat; use "
                             "`astream generate --raw PROMPT` for plain completion")
        print("astream chat: /help lists the commands, /exit or Ctrl-D quits", file=sys.stderr)
        while (line := await anyio.to_thread.run_sync(_read_line, abandon_on_cancel=True)) is not None:
            if line.startswith("/"):
                if not conversation.command(line, sys.stderr):
                    return
                continue
            if not line.strip():
                continue
            try:
                stats = await _print_stream(engine, conversation.ask(line), params, status)
            except (ValueError, RuntimeError) as exc:      # e.g. the history outgrew max_model_len
                conversation.forget_question()
                print(f"\nastream: {exc}", file=sys.stderr)
                continue
            conversation.answer(stats.text)
            sys.stdout.write("\n")
        sys.stdout.write("\n")                 # EOF: end the prompt's line
        sys.stdout.flush()


@dataclass(slots=True)
class Conversation:
    """A chat's messages and its REPL commands."""

    system: str | None = None
    history: list[dict] = dataclasses.field(default_factory=list)

    def ask(self, text: str) -> list[dict]:
        self.history.append({"role": "user", "content": text})
        return self.messages()

    def answer(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})

    def forget_question(self) -> None:
        self.history.pop()

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def command(self, line: str, out: TextIO) -> bool:
        """Run a /command; False: quit."""
        name, _, rest = line.strip().partition(" ")
        if name == "/exit":
            return False
        if name == "/help":
            width = max(map(len, CHAT_COMMANDS))
            out.write("".join(f"  {cmd:<{width}}  {text}\n" for cmd, text in CHAT_COMMANDS.items())
                      + "  Ctrl-D quits too; start a line with a space to send text beginning with '/'\n")
        elif name == "/reset":
            self.history.clear()
            out.write("(conversation cleared)\n")
        elif name == "/system":
            self.system, self.history = rest.strip() or None, []
            out.write("(system prompt set; conversation cleared)\n" if self.system
                      else "(system prompt removed; conversation cleared)\n")
        else:
            out.write(f"unknown command {name}; /help lists the commands\n")
        out.flush()
        return True


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None


@dataclass(slots=True)
class StreamStats:
    """What one streamed answer took, for `generate --verbose`."""

    text: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    started: float = 0.0
    first_token: float | None = None
    finished: float = 0.0

    def report(self) -> str:
        ttft = (self.first_token - self.started) * 1e3 if self.first_token is not None else float("nan")
        decode_s = self.finished - (self.first_token or self.finished)
        speed = (self.generated_tokens - 1) / decode_s if decode_s > 0 else float("nan")
        rows = [("prompt tokens", f"{self.prompt_tokens}"), ("generated tokens", f"{self.generated_tokens}"),
                ("time to first token", f"{ttft:.0f} ms"), ("decode speed", f"{speed:.1f} tok/s"),
                ("total time", f"{self.finished - self.started:.2f} s"), ("peak memory", peak_memory())]
        width = max(len(name) for name, _ in rows) + 1
        return "\n".join(f"{name + ':':<{width}} {value}" for name, value in rows)


def peak_memory() -> str:
    """This process's peak resident memory, and the GPU's peak allocation when there is one."""
    import resource

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024        # bytes on macOS, KiB on Linux
    text = f"{rss / 2**20:,.0f} MiB (process)"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f", {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB (GPU)"
    return text


async def _print_stream(engine, prompt, params, status: StatusLine) -> StreamStats:
    """Stream one request's text to stdout, prefill progress to stderr."""
    from astream.base.outputs import Progress

    stats = StreamStats(started=time.perf_counter())
    async with await engine.request(prompt, params, progress=True) as request:
        async for item in request:
            if isinstance(item, Progress):
                status.show("prefill", item.prefilled, item.total)
                continue
            if stats.first_token is None:
                stats.first_token = time.perf_counter()
            status.end(keep=False)
            sys.stdout.write(item.text)
            sys.stdout.flush()
            stats.text += item.text
            if item.finish_reason == "error":
                raise RuntimeError(f"generation failed: {item.error}")
        stats.finished = time.perf_counter()
        stats.prompt_tokens, stats.generated_tokens = request.prompt_tokens, request.completion_tokens
    return stats


async def _serve(args: argparse.Namespace, engine_kw: dict, options) -> None:
    import logging

    from astream.engine.engine import Engine
    from astream.server import PROTOCOL_VERSION, StreamServer
    from astream.server.engine_process import EngineProcess
    from astream.server.listen import bind

    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = EngineProcess(args.model, log_level=options.log_level, **engine_kw) \
        if options.engine_process else Engine(args.model, **engine_kw)
    # A busy port fails now, not after the model has loaded.
    with bind(options.host, options.port) as sock:
        async with engine, StreamServer(engine, options, sock) as server:
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
