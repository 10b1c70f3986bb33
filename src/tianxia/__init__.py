"""tianxia: an LLM inference engine for GGUF and Hugging Face models."""

from tianxia.llm import LLM
from tianxia.outputs import CompletionOutput, RequestOutput
from tianxia.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
