"""astream: asyncio streaming LLM inference for long prompts on one GPU with little memory."""

from astream.base.config import EngineConfig
from astream.base.errors import EngineClosedError, PromptTooLongError
from astream.base.outputs import Completion, CompletionOutput, Progress, StreamToken, TokenLogprob
from astream.base.sampling import SamplingParams
from astream.engine.engine import Engine
from astream.face.llm import LLM

__all__ = ["Completion", "CompletionOutput", "Engine", "EngineClosedError", "EngineConfig", "LLM",
           "Progress", "PromptTooLongError", "SamplingParams", "StreamToken", "TokenLogprob"]
__version__ = "0.1.0"
