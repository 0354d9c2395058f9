"""tokenmill: an LLM inference and serving engine."""

from tokenmill.entrypoints.llm import LLM
from tokenmill.outputs import CompletionOutput, EngineStats, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
