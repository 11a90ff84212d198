"""What the stages share, passed explicitly: the core and the signals between stages."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from astream.base.metrics import EngineMetrics
from astream.core.engine_core import EngineCore, ScheduledBatch
from astream.core.request import Request
from astream.runtime.events import Notifier
from astream.text.tokenization import Prompt

# Steps launched but not yet emitted. Two lets step n+1 run on the device while
# step n's sampled ids travel to the host; a third would need ids two steps old.
STEPS_IN_FLIGHT = 2


@dataclass(slots=True)
class StageContext:
    core: EngineCore
    wake: Notifier                       # something changed that may let the scheduler run
    step_slots: anyio.Semaphore          # bounds steps between schedule and emit
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    scheduled_at: dict[int, float] = field(default_factory=dict)   # step -> when it was formed
    long_prompt_chars: int = 20_000      # longer string prompts are tokenized off the loop thread
    tokenizer_threads: int = 2           # long prompts tokenized at once


@dataclass(slots=True)
class Submission:
    request: Request
    prompt: Prompt


@dataclass(slots=True)
class Admission:
    request: Request
    prompt_ids: list[int]


@dataclass(slots=True)
class StepTicket:
    """A scheduled batch on its way to the device; `launched` fires once its inputs are taken."""

    batch: ScheduledBatch
    launched: anyio.Event
