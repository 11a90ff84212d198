"""The stage graph, declared in one place: nodes, the channels between them, and their bounds.

    submit ─▶ tokenize ─▶ admit ┄┄▶ schedule ─▶ forward ─▶ offload_wait ─▶ emit ─▶ request channels

The dotted hop is the scheduler's queue, not a channel: admit adds to it and wakes
schedule. Every channel is bounded, so a slow stage pushes back on the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from astream.stages.admit import admit_stage
from astream.stages.emit import emit_stage
from astream.stages.forward import forward_stage
from astream.stages.offload_wait import offload_wait_stage
from astream.stages.schedule import schedule_stage
from astream.stages.tokenize import tokenize_stage


@dataclass(slots=True, frozen=True)
class Stage:
    name: str
    run: object                          # async fn(ctx, *channel ends)
    doc: str


@dataclass(slots=True, frozen=True)
class Channel:
    source: str
    target: str
    capacity: int
    carries: str


STAGES = (
    Stage("tokenize", tokenize_stage, "prompt -> token ids (long prompts off the loop thread)"),
    Stage("admit", admit_stage, "check against max_model_len, queue in the scheduler"),
    Stage("schedule", schedule_stage, "continuous batching, chunked prefill, preemption"),
    Stage("forward", forward_stage, "prefill chunks + decode step of one batch on the device"),
    Stage("offload_wait", offload_wait_stage, "await the step's KV copies to host memory (offload)"),
    Stage("emit", emit_stage, "await sampled ids, detokenize, stop checks, per-request channels"),
)

CHANNELS = (
    Channel("submit", "tokenize", 256, "Submission"),
    Channel("tokenize", "admit", 64, "list[Admission]"),
    Channel("schedule", "forward", 0, "StepTicket"),
    Channel("forward", "offload_wait", 1, "StepOutput | FailedStep"),
    Channel("offload_wait", "emit", 1, "StepOutput | FailedStep"),
)


def render() -> str:
    """A printable description of the graph."""
    lines = ["astream stage graph", "", "stages:"]
    width = max(len(s.name) for s in STAGES)
    lines += [f"  {s.name:<{width}}  {s.doc}" for s in STAGES]
    lines += ["", "channels (bounded):"]
    lines += [f"  {c.source:>12} ─▶ {c.target:<12} capacity {c.capacity:<4} {c.carries}"
              for c in CHANNELS]
    lines += ["      schedule ◀┄ admit, emit, consumers: wake-up signal (work arrived, step done, "
              "backlog drained)",
              "          emit ─▶ each request: unbounded stream, sequence paused past "
              "stream_buffer_tokens unread"]
    return "\n".join(lines)
