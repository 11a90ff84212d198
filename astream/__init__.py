"""astream: asyncio streaming LLM inference for long prompts on one GPU with little memory."""

from astream.config import EngineConfig
from astream.engine import Engine
from astream.errors import EngineClosedError, PromptTooLongError
from astream.llm import LLM
from astream.outputs import Completion, CompletionOutput, Progress, StreamToken, TokenLogprob
from astream.sampling import SamplingParams

__all__ = ["Completion", "CompletionOutput", "Engine", "EngineClosedError", "EngineConfig", "LLM",
           "Progress", "PromptTooLongError", "SamplingParams", "StreamToken", "TokenLogprob"]
__version__ = "0.1.0"
