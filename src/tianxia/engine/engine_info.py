"""What the API side knows of an engine: enough to tokenize, render chat and check limits.

The engine itself may live in another process (:mod:`tianxia.engine.core_client`), so the server
reads these facts from here, never from a live :class:`LLMEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tianxia.config import EngineConfig, ModelConfig
    from tianxia.engine.llm_engine import LLMEngine


@dataclass
class EngineInfo:
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    model_path: Path
    model_config: ModelConfig
    config: EngineConfig
    max_model_len: int
    num_blocks: int
    num_usable_blocks: int
    # the LoRA adapters served, name -> path (None: LoRA is off). The API side's own copy: it
    # resolves a request's adapter here and keeps it in step with the runtime loads it sends
    # to the engine (every core of a data-parallel model registers each adapter)
    lora_adapters: dict[str, str] | None = None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.tokenizer, engine.chat_template, Path(engine.model_path),
                   engine.model_config, engine.config, engine.max_model_len,
                   engine.block_manager.num_blocks, engine.block_manager.num_usable_blocks,
                   None if engine.lora_manager is None else dict(engine.lora_manager.paths))

    def facts(self) -> dict[str, Any]:
        """The plain-data part, which an engine core process sends when it is ready."""
        return {
            "chat_template": self.chat_template,
            "model_path": str(self.model_path),
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
            "num_usable_blocks": self.num_usable_blocks,
            "lora_adapters": self.lora_adapters,
        }

    @classmethod
    def from_facts(cls, facts: dict[str, Any], config: EngineConfig) -> EngineInfo:
        """The API process's copy: its own tokenizer and model config, read from the files."""
        from tianxia.loader import load_model_config
        from tianxia.loader.tokenizer import load_tokenizer

        path = Path(facts["model_path"])
        return cls(load_tokenizer(path, is_gguf=path.is_file()), facts["chat_template"], path,
                   load_model_config(str(path)), config, facts["max_model_len"],
                   facts["num_blocks"], facts["num_usable_blocks"], facts["lora_adapters"])

    def cache_info(self) -> dict[str, str]:
        """The KV cache's settings as ``/metrics`` labels them (vLLM's ``cache_config_info``)."""
        return {
            "block_size": str(self.config.cache.block_size),
            "num_gpu_blocks": str(self.num_blocks),
            "enable_prefix_caching": str(self.config.cache.enable_prefix_caching),
        }
