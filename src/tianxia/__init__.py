"""tianxia: an LLM inference engine for GGUF and Hugging Face models."""

from tianxia.engine.lora_manager import LoRARequest
from tianxia.llm import LLM
from tianxia.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from tianxia.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
    "BeamSearchOutput", "Logprob", "LoRARequest", "__version__",
]
