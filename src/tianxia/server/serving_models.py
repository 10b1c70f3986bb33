"""``/v1/models``: the names this server answers to (``--served-model-name``), the LoRA adapters
it serves (each a model whose ``parent`` is the base), and their cards."""

from __future__ import annotations

import time
from typing import Any

from tianxia.engine.async_engine import AsyncLLMEngine
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.lora_manager import LoRAError, LoRARequest
from tianxia.server.errors import APIError


class ServingModels:
    """The served model under every name clients may use; the first name is the one reported."""

    def __init__(self, llm: EngineInfo, names: list[str]) -> None:
        self.llm = llm
        self.names = list(names)
        self.name = self.names[0]
        self.created = int(time.time())

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served (name -> path); read from the engine thread's registry."""
        manager = self.llm.lora_manager
        return {} if manager is None else dict(manager.paths)

    def resolve(self, requested: str | None) -> str:
        """The reported name for a request's ``model`` (any served name or adapter, or none);
        else a 404."""
        if requested is None or requested in self.names:
            return self.name
        if requested in self.adapters():
            return requested
        raise APIError(
            404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a request's resolved ``model`` names, or None for the base."""
        return None if model in self.names else LoRARequest(model)

    def card(self, name: str, adapter_path: str | None = None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tianxia",
            "root": adapter_path or str(self.llm.model_path),
            "parent": self.name if adapter_path else None,
            "max_model_len": self.llm.max_model_len,
        }

    def list_models(self) -> dict[str, Any]:
        cards = [self.card(n) for n in self.names]
        cards += [self.card(n, path) for n, path in self.adapters().items()]
        return {"object": "list", "data": cards}

    def retrieve(self, model_id: str) -> dict[str, Any]:
        adapters = self.adapters()
        if model_id in adapters:
            return self.card(model_id, adapters[model_id])
        if model_id not in self.names:
            raise APIError(
                404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
            )
        return self.card(model_id)

    # --- runtime adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) -----------

    async def load_lora_adapter(self, engine: AsyncLLMEngine, data: dict[str, Any]) -> str:
        name, path = _text_field(data, "lora_name"), _text_field(data, "lora_path")
        if self.llm.lora_manager is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora")
        if name in self.adapters() or name in self.names:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            # on the engine thread, between steps: the adapter registry is the engine's
            await engine.call(lambda llm: llm.add_lora(name, path))
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, engine: AsyncLLMEngine, data: dict[str, Any]) -> str:
        name = _text_field(data, "lora_name")
        if not await engine.call(lambda llm: llm.remove_lora(name)):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."


def _text_field(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"`{key}` (a non-empty string) is required", param=key)
    return value
