"""moe-runtime: an inference runtime for Mixture-of-Experts language models."""
from moe.outputs import CompletionOutput, Logprob, RequestOutput
from moe.sampling_params import SamplingParams
from moe.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
