"""What the stages share, passed explicitly: the core, the request registry and the signals."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from astream.core import EngineCore
from astream.runtime.events import Notifier
from astream.sampling import SamplingParams
from astream.scheduler import ScheduledBatch
from astream.stages.requests import RequestHandle, RequestRegistry
from astream.tokenization import Prompt

# Steps launched but not yet emitted. Two lets step n+1 run on the device while
# step n's sampled ids travel to the host; a third would need ids two steps old.
STEPS_IN_FLIGHT = 2


@dataclass(slots=True)
class StageContext:
    core: EngineCore
    registry: RequestRegistry
    wake: Notifier                       # something changed that may let the scheduler run
    step_slots: anyio.Semaphore          # bounds steps between schedule and emit
    long_prompt_chars: int = 20_000      # longer string prompts are tokenized off the loop thread


@dataclass(slots=True)
class Submission:
    handle: RequestHandle
    prompt: Prompt
    params: SamplingParams


@dataclass(slots=True)
class Admission:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class StepTicket:
    """A scheduled batch on its way to the device; `launched` fires once its inputs are taken."""

    batch: ScheduledBatch
    launched: anyio.Event
